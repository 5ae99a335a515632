"""Class 7: inputs the rehearsal must model, or name in one line, instead of raising: an LSTM
with autograd, an inference_mode step, sparse COO tensors, nested tensors. The verdict is what
a real capture does with them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

NESTED_UNSURE = ("no torch test captures nested tensors; an elementwise op touches only the "
                 "buffer, so the capture is expected to succeed")

# ---------------------------------------------------------------- nn.LSTM with autograd


@case("lstm-forward_with_autograd", "crash_input", "capturable", src.LSTM,
      family="lstm_autograd", variant="quoted")
def _lstm():
    lstm = torch.nn.LSTM(4, 8, batch_first=True).to(DEVICE)

    def step(seq):
        out, _ = lstm(seq)
        return out[:, -1].tanh()

    return step, (torch.randn(2, 5, 4, device=DEVICE),)


@case("lstm-explicit_state_two_layers", "crash_input", "capturable", src.LSTM,
      family="lstm_autograd", variant="spelling")
def _lstm_state():
    lstm = torch.nn.LSTM(4, 8, num_layers=2).to(DEVICE)

    def step(seq, h0, c0):
        out, (h, c) = lstm(seq, (h0, c0))
        return out.mean(0), h, c

    return step, (torch.randn(5, 3, 4, device=DEVICE), torch.zeros(2, 3, 8, device=DEVICE),
                  torch.zeros(2, 3, 8, device=DEVICE))


@case("lstm-recurrent_policy", "crash_input", "capturable", src.LSTM,
      family="lstm_autograd", variant="method")
def _lstm_method():
    return nets.RecurrentPolicy(4, 8, 3).to(DEVICE), (torch.randn(2, 6, 4, device=DEVICE),)


@case("lstm-helper_encode", "crash_input", "capturable", src.LSTM,
      family="lstm_autograd", variant="helper")
def _lstm_helper():
    lstm = torch.nn.LSTM(3, 6, batch_first=True).to(DEVICE)
    head = torch.nn.Linear(6, 1).to(DEVICE)

    def step(seq):
        return head(helpers.encode_sequence(lstm, seq))

    return step, (torch.randn(4, 5, 3, device=DEVICE),)


@case("lstm-forward_backward_sgd", "crash_input", "capturable", src.LSTM + "; " + src.SGD,
      unsure="torch's graph tests capture the cuDNN LSTM forward only; the backward "
             "(_cudnn_rnn_backward, reserve space from the caching allocator) is assumed "
             "capturable like the forward")
def _lstm_train():
    lstm = torch.nn.LSTM(4, 8, batch_first=True).to(DEVICE)
    head = torch.nn.Linear(8, 1).to(DEVICE)
    params = [*lstm.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)

    def step(seq, target):
        out, _ = lstm(seq)
        loss = F.mse_loss(head(out[:, -1]), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, (torch.randn(2, 5, 4, device=DEVICE), torch.randn(2, 1, device=DEVICE))


# ---------------------------------------------------------------- inference_mode


@case("inference_mode-context", "crash_input", "capturable", src.INFERENCE,
      family="inference_mode", variant="quoted")
def _inference():
    policy = helpers.mlp(4, 16, 3).to(DEVICE)

    def step(obs):
        with torch.inference_mode():
            return policy(obs).softmax(-1)

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("inference_mode-decorator", "crash_input", "capturable", src.INFERENCE,
      family="inference_mode", variant="spelling")
def _inference_decorated():
    critic = helpers.mlp(4, 16, 1).to(DEVICE)

    @torch.inference_mode()
    def step(obs, reward):
        return reward + 0.99 * critic(obs).squeeze(-1)

    return step, (torch.randn(8, 4, device=DEVICE), torch.randn(8, device=DEVICE))


@case("inference_mode-actor_method", "crash_input", "capturable", src.INFERENCE,
      family="inference_mode", variant="method")
def _inference_method():
    actor = nets.InferenceActor(4, 3).to(DEVICE)
    return actor.act, (torch.randn(8, 4, device=DEVICE),)


@case("inference_mode-helper_greedy", "crash_input", "capturable", src.INFERENCE,
      family="inference_mode", variant="helper")
def _inference_helper():
    qnet = helpers.mlp(5, 16, 4).to(DEVICE)

    def step(obs):
        return helpers.greedy_action(qnet, obs)

    return step, (torch.randn(8, 5, device=DEVICE),)


# ---------------------------------------------------------------- sparse COO tensors


@case("sparse-message_passing", "crash_input", "refused", src.COALESCE,
      family="sparse_coo", variant="quoted")
def _sparse():
    def step(edges, weight, x):
        adj = torch.sparse_coo_tensor(edges, weight, (4, 4))
        return torch.sparse.mm(adj, x)  # HAZARD

    edges = torch.tensor([[0, 1, 2, 3, 1], [1, 2, 3, 0, 2]], device=DEVICE)
    return step, (edges, torch.rand(5, device=DEVICE), torch.randn(4, 3, device=DEVICE))


@case("sparse-to_sparse_in_step", "crash_input", "refused",
      "aten/src/ATen/native/sparse/SparseTensor.cpp dense_to_sparse: the indices are "
      "self.nonzero(), whose count is read on the host (" + src.NONZERO.split(": ", 1)[1]
      + ")", family="sparse_coo", variant="spelling")
def _sparse_to_sparse():
    def step(adj_dense, x):
        adj = adj_dense.to_sparse()  # HAZARD
        return torch.sparse.mm(adj, x)

    return step, ((torch.rand(4, 4, device=DEVICE) < 0.5).float(),
                  torch.randn(4, 3, device=DEVICE))


@case("sparse-graph_conv_module", "crash_input", "refused", src.COALESCE,
      family="sparse_coo", variant="method", hazard=nets.GraphConv.forward)
def _sparse_method():
    edges = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]], device=DEVICE)
    return nets.GraphConv(4, 3).to(DEVICE), (torch.randn(4, 3, device=DEVICE), edges,
                                             torch.rand(4, device=DEVICE))


@case("sparse-helper_coalesce", "crash_input", "refused", src.COALESCE,
      family="sparse_coo", variant="helper", hazard=helpers.coalesce_adjacency)
def _sparse_helper():
    def step(edges, weight):
        adj = helpers.coalesce_adjacency(edges, weight, 4)
        return adj.values().sum()

    edges = torch.tensor([[0, 0, 1], [1, 1, 2]], device=DEVICE)
    return step, (edges, torch.rand(3, device=DEVICE))


# ---------------------------------------------------------------- nested tensors


def _ragged() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], device=DEVICE)


@case("nested-elementwise", "crash_input", "capturable", src.NESTED,
      family="nested_tensor", variant="quoted", unsure=NESTED_UNSURE)
def _nested():
    def step(nt):
        return nt.relu()

    return step, (_ragged(),)


@case("nested-jagged_layout", "crash_input", "capturable",
      "torch/nested/_internal/nested_tensor.py: a jagged NestedTensor is a Python subclass "
      "whose elementwise ops run on its values tensor (torch/nested/_internal/ops.py:297 "
      "jagged_unary_pointwise, :306 jagged_binary_pointwise); offsets stay as they are",
      family="nested_tensor", variant="spelling", unsure=NESTED_UNSURE)
def _nested_jagged():
    def step(nt):
        return nt * 2.0

    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)],
                                    layout=torch.jagged, device=DEVICE)
    return step, (nt,)


@case("nested-set_encoder", "crash_input", "capturable", src.NESTED,
      family="nested_tensor", variant="method", unsure=NESTED_UNSURE)
def _nested_method():
    return nets.SetEncoder(), (_ragged(),)


@case("nested-helper", "crash_input", "capturable", src.NESTED,
      family="nested_tensor", variant="helper", unsure=NESTED_UNSURE)
def _nested_helper():
    def step(nt):
        return helpers.nested_relu(nt)

    return step, (_ragged(),)
