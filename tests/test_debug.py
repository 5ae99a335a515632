"""labkit.debug: finite-ness checks at named points that cost nothing when off (no host read,
no kernel: the sync meter and the profiler's op counts say so) and name a NaN's first step."""
import importlib

import pytest
import torch

from labkit import debug
from labkit.capture import warmup
from labkit.config import RunConfig
from labkit.doctor.plants import nan_observation
from labkit.measure.profiling import op_counts, profile_calls
from labkit.measure.syncmeter import SyncMeter
from labkit.stages import Pipeline

CPU = torch.device("cpu")
RUN = RunConfig(n_envs=8, n_steps=8)
MINIBATCH_STEPS = RUN.ppo.update_epochs * RUN.ppo.n_minibatches


@pytest.fixture(scope="module")
def pipe():
    # the choices forced (compiled, conv2d): timing them is not this file's subject
    forced = RUN.replace(compile="compiled", conv_math="conv2d")
    with debug.enable(False), Pipeline("fused_amp", forced, CPU) as p:
        warmup(p)
        yield p


def _measure(p: Pipeline, saved: dict) -> tuple[int, dict]:
    """Host reads and op counts of one iteration from ``saved`` (the async logger's writer is
    drained before and inside the profiled call, so its ops land in the count every time)."""
    p.load_state_dict(saved)
    p.logger.flush()
    with SyncMeter() as meter:
        prof = profile_calls(lambda: (p.iteration(), p.logger.flush()), CPU)
    return meter.host_reads, op_counts(prof)


@pytest.mark.slow
def test_off_adds_no_host_read_and_no_kernel(pipe, monkeypatch):
    saved = pipe.state_dict()
    with debug.enable(False):
        reads_off, ops_off = _measure(pipe, saved)
    monkeypatch.setattr(debug, "check", lambda **points: None)  # no checks in the code at all
    monkeypatch.setattr(debug, "check_grads", lambda params: None)
    reads_none, ops_none = _measure(pipe, saved)
    assert reads_off == reads_none == 1  # the device metrics' one read per update
    assert ops_off == ops_none
    assert "aten::isfinite" not in ops_off


@pytest.mark.slow
def test_on_costs_one_read_per_point_and_counts_steps(pipe):
    saved = pipe.state_dict()
    with debug.enable():
        reads_on, ops_on = _measure(pipe, saved)
        steps = debug.steps()
    per_step = 3  # observations, logits + values, rewards
    per_minibatch = 2  # losses, gradients
    assert reads_on == 1 + per_step * RUN.n_steps + per_minibatch * MINIBATCH_STEPS
    assert ops_on["aten::isfinite"] > 0
    assert steps == {"observations": RUN.n_steps, "logits": RUN.n_steps,
                     "values": RUN.n_steps, "rewards": RUN.n_steps,
                     "losses": MINIBATCH_STEPS, "gradients": MINIBATCH_STEPS}
    assert debug.steps() == {} and not debug.enabled()  # the context restored the setting


@pytest.mark.slow
def test_a_planted_nan_is_reported_at_its_first_step():
    stage = nan_observation("fused_amp", step=5)  # compiled policy and loss
    with Pipeline(stage, RUN, CPU) as p, debug.enable():
        with pytest.raises(debug.NonFiniteError) as err:
            p.iteration()
    assert err.value.point == "observations"
    assert err.value.step == 5
    assert err.value.index == (0, 0, 0, 0) and err.value.count == 1
    assert "observations is not finite at step 5" in str(err.value)


@pytest.mark.slow
def test_without_debug_the_nan_spreads_silently():
    with debug.enable(False), Pipeline(nan_observation("fused_amp", step=5), RUN, CPU) as p:
        p.iteration()
        params = torch.cat([q.detach().flatten() for q in p.agent.parameters()])
    assert not torch.isfinite(params).all()


@pytest.mark.slow
def test_gradients_and_losses_are_checked_in_the_update():
    with Pipeline("fused_amp", RUN, CPU) as p, debug.enable():
        batch = p.rollout()
        batch.advantages[3] = float("inf")
        with pytest.raises(debug.NonFiniteError) as err:
            p.ppo_update(batch)
    assert err.value.point in ("losses", "gradients")


def test_a_check_never_breaks_a_compiled_graph():
    def double(x):
        debug.check(x=x)
        return 2 * x

    compiled = torch.compile(double, fullgraph=True, backend="eager")
    x = torch.tensor([1.0, float("nan")])
    for on in (False, True):
        with debug.enable(on):
            assert torch.equal(compiled(x[:1]), torch.tensor([2.0]))
    with debug.enable(), pytest.raises(debug.NonFiniteError, match="x is not finite at step 0"):
        double(x)  # eagerly, the same check finds the NaN


def test_labkit_debug_environment_variable(monkeypatch):
    try:
        for value, expected in (("1", True), ("yes", True), ("0", False), ("", False)):
            monkeypatch.setenv("LABKIT_DEBUG", value)
            importlib.reload(debug)
            assert debug.enabled() is expected, value
    finally:
        monkeypatch.delenv("LABKIT_DEBUG")
        importlib.reload(debug)
    assert not debug.enabled()
