from __future__ import annotations

import inspect

import pytest
import torch

from labkit.measure.syncmeter import SyncMeter
from labkit.policy import Agent, PopArtValueHead, ValueHead, flops_per_sample, sample_action


def _obs(n: int, view: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, view, view, generator=g) < 0.3).float()


def test_shapes_and_init():
    torch.manual_seed(0)
    agent = Agent()
    logits, value = agent(_obs(6))
    assert logits.shape == (6, 5) and value.shape == (6,)
    assert agent.body[5].in_features == 288
    # policy head gain 0.01: near-uniform initial policy
    assert logits.abs().max() < 0.1
    w = agent.actor.weight
    assert torch.allclose(w @ w.T, torch.eye(5) * 0.01**2, atol=1e-7)
    assert Agent(view=9).body[5].in_features == 32 * 5 * 5


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="value_head.*plain.*popart"):
        Agent(value_head="fancy")
    with pytest.raises(ValueError, match="view"):
        Agent(view=3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("view", [7, 9])
def test_matmul_convolutions_compute_what_conv2d_does(device, view):
    """conv_math "matmul" runs each convolution as one product with the weight laid out
    densely: the same parameters (the same state dict, the same initial weights), the same
    outputs and gradients within fp32 rounding (relative 1e-5), and under bf16 autocast within
    bf16's (outputs of the two compared against each other, 2e-2 relative to their range)."""
    torch.manual_seed(0)
    ref = Agent(view=view).to(device)
    torch.manual_seed(0)
    mm = Agent(view=view, conv_math="matmul").to(device)
    assert mm.body.conv_math == "matmul" and ref.body.conv_math == "conv2d"
    assert ref.state_dict().keys() == mm.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(),
                                                  mm.state_dict().values()))
    obs = _obs(37, view).to(device)
    outs = []
    for agent in (ref, mm):  # cuDNN's fp32 convolutions as fp32, not TF32 (labkit.device)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            logits, value = agent(obs)
            (logits.square().sum() + value.sum()).backward()
        outs.append((logits, value, [p.grad for p in agent.parameters()]))
    (l1, v1, g1), (l2, v2, g2) = outs
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    with torch.autocast(device, torch.bfloat16):
        (l1, v1), (l2, v2) = ref(obs), mm(obs)
    assert l2.dtype == l1.dtype == torch.bfloat16
    for a, b in ((l1, l2), (v1, v2)):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * a.float().abs().max()


@pytest.mark.parametrize("view", [5, 7, 9])
def test_the_placed_dense_matrix_is_the_convolution_of_every_basis_image(view):
    """What ``Placed`` gathers is, exactly, each convolution applied to every one-hot input
    (the dense matrix's definition), and its gathered-back gradient is the one autograd
    takes through that convolution (the same sums in another order: fp32 rounding)."""
    import torch.nn.functional as F

    torch.manual_seed(1)
    body = Agent(view=view, conv_math="matmul").body
    for i, (conv, side) in enumerate(body._convs(), 1):
        cells = conv.in_channels * side * side
        basis = torch.eye(cells).view(cells, conv.in_channels, side, side)
        reference = F.conv2d(basis, conv.weight).flatten(1)
        placed = body.dense(i)
        assert torch.equal(placed, reference)
        upstream = torch.randn(reference.shape)
        (want,) = torch.autograd.grad(reference, conv.weight, upstream)
        (got,) = torch.autograd.grad(placed, conv.weight, upstream)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_dense_matrices_are_considered_only_where_they_fit_and_slices_work():
    from labkit.policy import ConvBody

    assert [ConvBody(v).matmul_fits for v in (5, 7, 9, 11, 15)] == [True] * 3 + [False] * 2
    head = Agent().body[:2]  # a plain Sequential of the first conv and its ReLU
    assert type(head) is torch.nn.Sequential and len(head) == 2
    assert head(_obs(2)).shape == (2, 16, 5, 5)


def test_conv_math_is_checked_and_switchable():
    agent = Agent()
    with pytest.raises(ValueError, match="conv_math must be one of conv2d, matmul; got 'fft'"):
        agent.body.conv_math = "fft"
    with pytest.raises(ValueError, match="conv_math must be one of"):
        Agent(conv_math="fft")
    with pytest.raises(ValueError, match="conv_math applies to the conv body"):
        Agent(body="attention", conv_math="matmul")
    obs = _obs(5)
    before = agent(obs)[0]
    assert not list(agent.named_buffers())
    agent.body.conv_math = "matmul"  # its place tables are buffers, not saved
    assert {n for n, _ in agent.named_buffers()} == {f"body._{t}{i}" for t in ("place", "taken")
                                                     for i in (1, 2)}
    assert not any("._place" in k or "._taken" in k for k in agent.state_dict())
    torch.testing.assert_close(agent(obs)[0], before, rtol=1e-5, atol=1e-7)
    agent.body.conv_math = "conv2d"
    assert torch.equal(agent(obs)[0], before)


def test_flops_match_hand_count():
    macs = 5 * 5 * 16 * (3 * 9) + 3 * 3 * 32 * (16 * 9) + 288 * 128 + 128 * 5 + 128 * 1
    assert macs == 89_904
    assert flops_per_sample(7) == {"forward": 179_808, "train": 539_424}


def test_sample_action_samples_on_device_without_host_reads():
    torch.manual_seed(0)
    agent = Agent(value_head="popart")
    obs = _obs(4096)
    with SyncMeter() as m:
        a1, lp1, v1 = sample_action(agent, obs, generator=torch.Generator().manual_seed(3))
    assert m.host_reads == 0
    a2, lp2, v2 = sample_action(agent, obs, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and a1.dtype == torch.int64
    lp, ent, v = agent.evaluate(obs, a1)
    torch.testing.assert_close(lp, lp1)
    torch.testing.assert_close(agent.value_head.denormalize(v), v1)
    assert torch.all(ent <= torch.log(torch.tensor(5.0)) + 1e-6)
    # sampled frequencies follow the policy: a nearly uniform one here
    freq = torch.bincount(a1, minlength=5).float() / len(a1)
    assert torch.allclose(freq, torch.full((5,), 0.2), atol=0.03)


def test_gumbel_max_matches_softmax_probabilities():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5, -3.0]]).expand(20_000, 5)
    logp = logits.log_softmax(-1)
    noise = torch.empty_like(logp).exponential_(generator=torch.Generator().manual_seed(0))
    freq = torch.bincount((logp - noise.log()).argmax(-1), minlength=5).float() / 20_000
    torch.testing.assert_close(freq, logp[0].exp(), atol=0.01, rtol=0)


def _public(cls) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_value_heads_share_one_interface():
    assert _public(ValueHead) == _public(PopArtValueHead)
    assert {"forward", "get_training_value", "denormalize", "prepare_targets",
            "update_stats"} <= _public(ValueHead)


def test_plain_head_update_is_a_no_op():
    torch.manual_seed(0)
    head = ValueHead()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    h = torch.randn(8, 128)
    out = head(h)
    head.update_stats(torch.randn(100) * 5 + 3)
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())
    assert torch.equal(head(h), out)
    r = torch.randn(10)
    assert torch.equal(head.prepare_targets(r), r) and torch.equal(head.denormalize(r), r)


def test_popart_preserves_unnormalized_outputs():
    torch.manual_seed(0)
    head = PopArtValueHead(beta=0.1)
    h = torch.randn(32, 128)
    for scale, shift in [(10.0, 5.0), (0.5, -2.0), (100.0, 50.0)]:
        before = head.denormalize(head(h))
        norm_before = head(h)
        with SyncMeter() as m:
            head.update_stats(torch.randn(1000) * scale + shift)
        assert m.host_reads == 0
        torch.testing.assert_close(head.denormalize(head(h)), before, rtol=1e-5, atol=1e-4)
        assert not torch.allclose(head(h), norm_before)  # the normalized outputs did move


def test_popart_stats_and_state_dict():
    head = PopArtValueHead(beta=0.01)
    returns = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 4 + 7
    head.update_stats(returns)
    # first call: statistics of the batch itself, no start-up bias
    torch.testing.assert_close(head.mean, returns.mean())
    torch.testing.assert_close(head.std, returns.std(unbiased=False), rtol=1e-4, atol=0)
    targets = head.prepare_targets(returns)
    assert abs(float(targets.mean())) < 1e-4 and abs(float(targets.std()) - 1) < 1e-3
    torch.testing.assert_close(head.denormalize(targets), returns)
    assert {"mean", "mean_sq", "std", "count"} <= set(head.state_dict())
    fresh = PopArtValueHead()
    fresh.load_state_dict(head.state_dict())
    torch.testing.assert_close(fresh.std, head.std)
