"""Class 3: values baked in at capture. Python ints, floats, branches and tensor bindings are
read once, when the graph is recorded; eager calls would read new ones. (``torch.manual_seed``
inside the step with the seed the warm-up set is ignored at capture, so replays draw new numbers
where eager calls repeat theirs: see SEED.)"""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

GROWING = ("a capture records kernels, not return values (torch/cuda/graphs.py:365 graph only "
           "brackets capture_begin / capture_end): a Python number returned by the captured "
           "code keeps its capture value, while eager calls return new ones " + f"({src.FROZEN})")

# ---------------------------------------------------------------- a Python int row index


@case("int_index-quoted_counter", "frozen_value", "replays_differ", src.FROZEN,
      family="python_int_index", variant="quoted")
def _int_index():
    buf = torch.zeros(5, 3, device=DEVICE)
    t = [0]

    def step(x):
        buf[t[0] % buf.shape[0]] = x  # HAZARD
        t[0] += 1
        return buf.sum(0)

    return step, (torch.randn(3, device=DEVICE),)


@case("int_index-rollout_column", "frozen_value", "replays_differ", src.FROZEN,
      family="python_int_index", variant="spelling")
def _int_column():
    storage = torch.zeros(4, 8, device=DEVICE)  # envs x steps
    pos = {"step": 0}

    def step(obs):
        storage.select(1, pos["step"] % storage.shape[1]).copy_(obs)  # HAZARD
        pos["step"] += 1
        return storage.mean(1)

    return step, (torch.randn(4, device=DEVICE),)


@case("int_index-replay_buffer_add", "frozen_value", "replays_differ", src.FROZEN,
      family="python_int_index", variant="method", hazard=nets.ReplayBuffer.add)
def _int_method():
    rb = nets.ReplayBuffer(6, 3, DEVICE)

    def step(obs):
        rb.add(obs)
        return rb.obs.sum(0)

    return step, (torch.randn(3, device=DEVICE),)


@case("int_index-helper_write_slot", "frozen_value", "replays_differ", src.FROZEN,
      family="python_int_index", variant="helper", hazard=helpers.write_slot)
def _int_helper():
    buf = torch.zeros(5, 2, device=DEVICE)
    cursor = {"i": 0}

    def step(row):
        helpers.write_slot(buf, cursor, row * 2)
        return buf.clone()

    return step, (torch.randn(2, device=DEVICE),)


# ---------------------------------------------------------------- a Python-float LR schedule


def _net_and_batch():
    net = helpers.mlp(4, 16, 1).to(DEVICE)
    return net, (torch.randn(32, 4, device=DEVICE), torch.randn(32, 1, device=DEVICE))


@case("float_lr-linear_decay_foreach", "frozen_value", "replays_differ", src.FROZEN,
      family="python_float_lr", variant="quoted")
def _float_lr():
    net, batch = _net_and_batch()
    params = list(net.parameters())
    count = [0]

    def step(x, y):
        count[0] += 1
        lr = 0.1 * (1.0 - count[0] / 10)
        loss = F.mse_loss(net(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)  # HAZARD
        return loss.detach(), params[-1].detach().clone()

    return step, batch


@case("float_lr-param_groups_assignment", "frozen_value", "replays_differ",
      src.FROZEN + "; torch/optim/sgd.py reads group['lr'] as a Python float",
      family="python_float_lr", variant="spelling")
def _float_lr_groups():
    net, batch = _net_and_batch()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    it = [0]

    def step(x, y):
        it[0] += 1
        for group in opt.param_groups:
            group["lr"] = 0.05 * min(1.0, it[0] / 8)  # linear warm-up
        opt.zero_grad(set_to_none=True)
        F.mse_loss(net(x), y).backward()
        opt.step()  # HAZARD
        return net[0].weight.detach().sum()

    return step, batch


@case("float_lr-step_lr_scheduler", "frozen_value", "replays_differ",
      src.FROZEN + "; torch/optim/lr_scheduler.py StepLR writes group['lr'] as a Python "
      "float, which torch/optim/sgd.py reads", family="python_float_lr", variant="spelling")
def _float_lr_sched():
    net, batch = _net_and_batch()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # HAZARD
        sched.step()
        return loss.detach(), net(x).detach()

    return step, batch


@case("float_lr-decaying_trainer", "frozen_value", "replays_differ", src.FROZEN,
      family="python_float_lr", variant="method", hazard=nets.DecayingSGD.step)
def _float_lr_method():
    net, batch = _net_and_batch()
    trainer = nets.DecayingSGD(net, lr=0.1, decay=0.5)
    return trainer.step, batch


@case("float_lr-helper_cosine", "frozen_value", "replays_differ", src.FROZEN,
      family="python_float_lr", variant="helper", hazard=helpers.sgd_update)
def _float_lr_helper():
    net, batch = _net_and_batch()
    params = list(net.parameters())
    it = [0]

    def step(x, y):
        it[0] += 1
        for p in params:
            p.grad = None
        F.mse_loss(net(x), y).backward()
        helpers.sgd_update(params, helpers.cosine_lr(it[0], 10, 0.1))
        return params[0].detach().sum()

    return step, batch


# ------------------------------------------ a fused optimizer's learning rate on the host


@case("fused_host_lr-adam_tensor_lr", "frozen_value", "replays_differ", src.FUSED_HOST_LR,
      family="fused_host_lr", variant="quoted")
def _fused_host_lr():
    net = helpers.mlp(4, 16, 1).to(DEVICE)
    lr = torch.tensor(3e-4, device="cpu")
    opt = torch.optim.Adam(net.parameters(), lr=lr, fused=True, capturable=True)

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # HAZARD
        return loss.detach()

    return step, (torch.randn(32, 4, device=DEVICE), torch.randn(32, 1, device=DEVICE))


@case("fused_host_lr-adamw_inline_full", "frozen_value", "replays_differ", src.FUSED_HOST_LR,
      family="fused_host_lr", variant="spelling")
def _fused_host_lr_inline():
    policy = helpers.mlp(6, 32, 3).to(DEVICE)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=torch.full((), 1e-3),
                                  weight_decay=0.01, fused=True, capturable=True)

    def step(obs, act, adv):
        logp = torch.log_softmax(policy(obs), -1).gather(-1, act[:, None]).squeeze(-1)
        loss = -(logp * adv).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()  # HAZARD
        return loss.detach()

    return step, (torch.randn(16, 6, device=DEVICE), torch.randint(0, 3, (16,), device=DEVICE),
                  torch.randn(16, device=DEVICE))


@case("fused_host_lr-annealed_critic", "frozen_value", "replays_differ", src.FUSED_HOST_LR,
      family="fused_host_lr", variant="method", hazard=nets.AnnealedCritic.update)
def _fused_host_lr_method():
    critic = nets.AnnealedCritic(4, 3e-4)
    critic.v.to(DEVICE)
    return critic.update, (torch.randn(32, 4, device=DEVICE), torch.randn(32, device=DEVICE))


@case("fused_host_lr-helper_step", "frozen_value", "replays_differ", src.FUSED_HOST_LR,
      family="fused_host_lr", variant="helper", hazard=helpers.apply_gradients)
def _fused_host_lr_helper():
    net = helpers.mlp(4, 16, 1).to(DEVICE)
    base_lr = torch.tensor(1e-3, device="cpu")
    opt = torch.optim.Adam(net.parameters(), lr=base_lr, fused=True, capturable=True)

    def step(x, y):
        loss = F.smooth_l1_loss(net(x), y)
        helpers.apply_gradients(opt, loss)
        return loss.detach()

    return step, (torch.randn(32, 4, device=DEVICE), torch.randn(32, 1, device=DEVICE))


@case("device_lr-inplace_decay", "frozen_value", "capturable",
      "the learning rate is a device tensor decayed in place: the decay is a recorded "
      "kernel, replayed every time. " + src.CLEAN)
def _device_lr():
    net, batch = _net_and_batch()
    params = list(net.parameters())
    lr = torch.tensor(0.1, device=DEVICE)

    def step(x, y):
        loss = F.mse_loss(net(x), y)
        grads = torch.autograd.grad(loss, params)
        lr.mul_(0.99)
        with torch.no_grad():
            torch._foreach_add_(params, torch._foreach_mul(grads, -lr))
        return loss.detach()

    return step, batch


# ---------------------------------------------------------------- state rebound each call


@case("rebound-ema_in_dict", "frozen_value", "replays_differ", src.REBOUND,
      family="rebound_state", variant="quoted")
def _rebound_dict():
    stats = {"mean": torch.zeros(4, device=DEVICE)}

    def step(x):
        stats["mean"] = 0.99 * stats["mean"] + 0.01 * x.mean(0)  # HAZARD
        return x - stats["mean"]

    return step, (torch.randn(16, 4, device=DEVICE),)


@case("rebound-running_total_unread", "frozen_value", "replays_differ", src.REBOUND,
      family="rebound_state", variant="spelling")
def _rebound_unread():
    totals = {"reward": torch.zeros((), device=DEVICE)}

    def step(obs, reward):
        totals["reward"] = totals["reward"] + reward.sum()  # HAZARD
        return obs * 2

    return step, (torch.randn(8, 4, device=DEVICE), torch.randn(8, device=DEVICE))


@case("rebound-running_max", "frozen_value", "replays_differ", src.REBOUND,
      family="rebound_state", variant="spelling")
def _rebound_max():
    peak = [torch.ones(3, device=DEVICE)]

    def step(obs):
        peak[0] = torch.maximum(peak[0] * 1.01, obs.abs().amax(0))  # HAZARD
        return obs / peak[0]

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("rebound-ema_normalizer", "frozen_value", "replays_differ", src.REBOUND,
      family="rebound_state", variant="method", hazard=nets.EMANormalizer.forward)
def _rebound_method():
    norm = nets.EMANormalizer(4, DEVICE, momentum=0.1)
    return norm, (torch.randn(16, 4, device=DEVICE) + 1.0,)


@case("rebound-gru_hidden_attribute", "frozen_value", "replays_differ", src.REBOUND,
      family="rebound_state", variant="method", hazard=nets.GRUPolicy.forward)
def _rebound_gru():
    policy = nets.GRUPolicy(5, 8, 3, 4, DEVICE).to(DEVICE)
    return policy, (torch.randn(4, 5, device=DEVICE),)


@case("rebound-helper_ema", "frozen_value", "replays_differ", src.REBOUND,
      family="rebound_state", variant="helper", hazard=helpers.ema_into)
def _rebound_helper():
    state = {"ret": torch.zeros(8, device=DEVICE)}

    def step(rewards):
        ret = helpers.ema_into(state, "ret", rewards, decay=0.9)
        return rewards / (ret.abs() + 1.0)

    return step, (torch.rand(8, device=DEVICE),)


@case("inplace-running_mean_std", "frozen_value", "capturable",
      "statistics updated in place (copy_): the same buffers every call. " + src.CLEAN)
def _inplace_rms():
    rms = nets.RunningMeanStd(4).to(DEVICE)
    return rms, (torch.randn(16, 4, device=DEVICE) * 3 + 1,)


@case("inplace-lstm_cell_state", "frozen_value", "capturable",
      "the recurrent state is updated in place (copy_ into buffers). " + src.CLEAN)
def _inplace_lstm_cell():
    policy = nets.LSTMCellPolicy(5, 8, 3, 4).to(DEVICE)
    return policy, (torch.randn(4, 5, device=DEVICE),)


@case("inplace-helper_lerp", "frozen_value", "capturable",
      "the average is updated in place (lerp_). " + src.CLEAN)
def _inplace_lerp():
    mean = torch.zeros(4, device=DEVICE)

    def step(x):
        m = helpers.lerp_into(mean, x.mean(0), 0.05)
        return x - m

    return step, (torch.randn(16, 4, device=DEVICE),)


# ---------------------------------------------------------------- a random.random() branch


@case("random_branch-epsilon_greedy", "frozen_value", "replays_differ", src.FROZEN,
      family="python_random_branch", variant="quoted")
def _random_branch():
    random.seed(0)  # the checker restores Python's random state afterwards

    def step(q):
        if random.random() < 0.5:  # HAZARD
            return torch.randint(0, q.shape[-1], q.shape[:-1], device=q.device)
        return q.argmax(-1)

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("random_branch-numpy_augmentation", "frozen_value", "replays_differ", src.FROZEN,
      family="python_random_branch", variant="spelling")
def _random_numpy():
    rng = np.random.default_rng(0)
    enc = torch.nn.Linear(6, 4).to(DEVICE)

    def step(obs):
        if rng.random() < 0.5:  # HAZARD
            obs = obs.flip(-1)
        return enc(obs)

    return step, (torch.randn(8, 6, device=DEVICE),)


@case("random_branch-epsilon_greedy_module", "frozen_value", "replays_differ", src.FROZEN,
      family="python_random_branch", variant="method", hazard=nets.EpsilonGreedy.forward)
def _random_method():
    actor = nets.EpsilonGreedy(eps=0.5, seed=0)
    return actor, (torch.randn(8, 4, device=DEVICE),)


@case("random_branch-helper_explore", "frozen_value", "replays_differ", src.FROZEN,
      family="python_random_branch", variant="helper", hazard=helpers.explore)
def _random_helper():
    rng = random.Random(0)
    qnet = torch.nn.Linear(5, 3).to(DEVICE)

    def step(obs):
        return helpers.explore(qnet(obs), 0.5, rng)

    return step, (torch.randn(8, 5, device=DEVICE),)


@case("epsilon_greedy-on_device", "frozen_value", "capturable",
      "the coin is drawn on the device (torch.rand) and applied with torch.where. "
      + src.RNG_OK)
def _eps_device():
    def step(q):
        explore = torch.rand(q.shape[0], device=q.device) < 0.1
        random_action = torch.randint(0, q.shape[-1], (q.shape[0],), device=q.device)
        return torch.where(explore, random_action, q.argmax(-1))

    return step, (torch.randn(8, 4, device=DEVICE),)


# ---------------------------------------------------------------- torch.manual_seed(k)


@case("manual_seed-in_step", "frozen_value", "replays_differ", src.SEED,
      family="manual_seed_in_step", variant="quoted")
def _seed():
    def step(mu):
        torch.manual_seed(1234)  # HAZARD
        noise = torch.randn_like(mu)
        return mu + 0.1 * noise

    return step, (torch.zeros(8, 2, device=DEVICE),)


@case("manual_seed-cuda_spelling", "frozen_value", "replays_differ",
      src.SEED + " (torch/cuda/random.py torch.cuda.manual_seed: the same generator call)",
      family="manual_seed_in_step", variant="spelling")
def _seed_cuda():
    def step(mu):
        torch.cuda.manual_seed(7)  # HAZARD
        return mu + 0.1 * torch.randn_like(mu)

    return step, (torch.zeros(8, 2, device=DEVICE),)


@case("manual_seed-random_module_spelling", "frozen_value", "replays_differ", src.SEED,
      family="manual_seed_in_step", variant="spelling")
def _seed_random_module():
    policy = torch.nn.Linear(4, 2).to(DEVICE)

    def step(obs):
        torch.random.manual_seed(0)  # HAZARD
        return policy(torch.nn.functional.dropout(obs, 0.1))

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("manual_seed-reseeded_module", "frozen_value", "replays_differ", src.SEED,
      family="manual_seed_in_step", variant="method", hazard=nets.ReseededNoise.forward)
def _seed_method():
    return nets.ReseededNoise(seed=3), (torch.zeros(8, 2, device=DEVICE),)


@case("manual_seed-helper", "frozen_value", "replays_differ", src.SEED,
      family="manual_seed_in_step", variant="helper", hazard=helpers.seeded_noise)
def _seed_helper():
    def step(action):
        return action + 0.2 * helpers.seeded_noise(action, 42)

    return step, (torch.zeros(8, 2, device=DEVICE),)


# ---------------------------------------------------------------- Python numbers returned


@case("python_output-growing_count", "frozen_value", "replays_differ",
      GROWING)
def _growing_count():
    seen: list = []

    def step(x):
        seen.append(None)
        return x.square().mean(), len(seen)  # HAZARD

    return step, (torch.randn(8, device=DEVICE),)


@case("python_output-module_call_counter", "frozen_value", "replays_differ",
      GROWING, hazard=nets.EpochReporter.forward)
def _module_counter():
    return nets.EpochReporter(4).to(DEVICE), (torch.randn(8, 4, device=DEVICE),)
