from __future__ import annotations

import math

import pytest
import torch

from labkit.measure.syncmeter import SyncMeter
from labkit.metrics import DeviceEpisodeStats, EagerEpisodeStats

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def episode_stream(steps: int, n: int = 16, integer: bool = True, seed: int = 0):
    """Inputs shaped like the envs' info: done (N,) bool, return (N,) f32, length (N,) i64."""
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        done = torch.rand(n, generator=g) < (0.0 if t % 7 == 3 else 0.15)
        if integer:
            ret = torch.randint(-5, 30, (n,), generator=g).float()
        else:
            ret = torch.randn(n, generator=g) * 10
        length = torch.randint(1, 129, (n,), generator=g)
        yield done, torch.where(done, ret, 0.0), torch.where(done, length, 0)


def run_both(stream, device: str = "cpu") -> list[tuple[dict, dict]]:
    eager, dev = EagerEpisodeStats(), DeviceEpisodeStats(device)
    out = []
    for t, (done, ret, length) in enumerate(stream):
        eager.update(done, ret, length)
        dev.update(done.to(device), ret.to(device), length.to(device))
        if t % 25 == 24:
            out.append((eager.summary(), dev.summary()))
    return out


def test_eager_and_device_summaries_are_identical():
    pairs = run_both(episode_stream(100))
    assert len(pairs) == 4
    for eager, dev in pairs:
        assert eager == dev
        assert eager["episodes"] > 20
    assert pairs[0][0] != pairs[1][0]  # summaries are per window: accumulators were reset


def test_eager_and_device_agree_on_float_returns():
    for eager, dev in run_both(episode_stream(100, integer=False, seed=1)):
        assert eager.keys() == dev.keys()
        assert eager["episodes"] == dev["episodes"]
        for key in eager:
            assert dev[key] == pytest.approx(eager[key], rel=1e-12, abs=1e-12)


def test_known_values():
    stats = DeviceEpisodeStats()
    stats.update(torch.tensor([True, False, True]), torch.tensor([2.0, 0.0, 4.0]),
                 torch.tensor([10, 0, 20]))
    stats.update(torch.tensor([False, False, True]), torch.tensor([0.0, 0.0, -3.0]),
                 torch.tensor([0, 0, 30]))
    s = stats.summary()
    assert s["episodes"] == 3
    assert s["mean_return"] == pytest.approx(1.0)
    assert s["std_return"] == pytest.approx(math.sqrt((1 + 9 + 16) / 3))
    assert (s["min_return"], s["max_return"]) == (-3.0, 4.0)
    assert s["mean_length"] == pytest.approx(20.0)


def test_empty_window_is_nan_for_both():
    for stats in (EagerEpisodeStats(), DeviceEpisodeStats()):
        no_done = torch.zeros(4, dtype=torch.bool)
        stats.update(no_done, torch.zeros(4), torch.zeros(4, dtype=torch.int64))
        s = stats.summary()
        assert s["episodes"] == 0
        assert all(math.isnan(v) for k, v in s.items() if k != "episodes")


def test_device_update_has_no_host_reads_and_summary_exactly_one():
    stats = DeviceEpisodeStats()
    inputs = list(episode_stream(50))
    with SyncMeter() as meter:
        for done, ret, length in inputs:
            stats.update(done, ret, length)
    assert meter.host_reads == 0
    with SyncMeter() as meter:
        stats.summary()
    assert meter.host_reads == 1


def test_eager_update_reads_the_host_every_step():
    stats = EagerEpisodeStats()
    inputs = list(episode_stream(50))
    with SyncMeter() as meter:
        for done, ret, length in inputs:
            stats.update(done, ret, length)
    assert meter.host_reads >= len(inputs)


def test_device_accumulators_have_fixed_memory():
    stats = DeviceEpisodeStats()

    def tensors() -> dict:
        return {k: (tuple(v.shape), v.data_ptr()) for k, v in vars(stats).items()
                if isinstance(v, torch.Tensor)}

    before = tensors()
    for done, ret, length in episode_stream(500, n=64):
        stats.update(done, ret, length)
    assert tensors() == before  # same shapes, same storage: nothing grows
    assert stats.summary()["episodes"] > 1000
    assert tensors() == before


def test_device_rejects_non_bool_done():
    with pytest.raises(TypeError, match="done"):
        DeviceEpisodeStats().update(torch.ones(3), torch.zeros(3), torch.zeros(3, dtype=torch.long))


@cuda
def test_cuda_matches_eager_without_syncs_in_update():
    assert all(e == d for e, d in run_both(episode_stream(100), device="cuda"))
    stats = DeviceEpisodeStats("cuda")
    inputs = [tuple(x.cuda() for x in step) for step in episode_stream(50)]
    with SyncMeter(cuda_debug=True) as meter:
        for done, ret, length in inputs:
            stats.update(done, ret, length)
    assert meter.host_reads == 0
    assert meter.cuda_syncs == 0


def _device_state(stats: DeviceEpisodeStats, **edits: float) -> dict:
    state = stats.state_dict()
    names = ("count", "sum_return", "sum_sq", "sum_length")
    for i, name in enumerate(names):
        if name in edits:
            state["sums"][i] = edits[name]
    for key in ("min", "max"):
        if key in edits:
            state[key].fill_(edits[key])
    return state


@pytest.mark.parametrize("edits, needle", [
    ({"count": 2.5}, "whole number"),
    ({"count": -1.0}, "whole number"),
    ({"count": 0.0}, "with no episode"),
    ({"sum_length": 1.0}, "at least one step per episode"),
    ({"sum_return": 1e9}, "returns must be reachable"),  # 3 episodes of a few steps: never
    ({"max": 1e9}, "returns must be reachable"),
    ({"sum_sq": -1.0}, "squared returns"),
    ({"sum_sq": 1e12}, "squared returns"),
    ({"min": 5.0, "max": 5.0}, "bound the mean"),
])
def test_device_stats_refuse_accumulators_no_episodes_can_make(edits, needle):
    stats = DeviceEpisodeStats()
    done = torch.tensor([True, False, True, True])
    stats.update(done, torch.tensor([2.0, 0.0, -1.0, 0.0]), torch.tensor([4, 1, 3, 2]))
    fresh = DeviceEpisodeStats()
    fresh.load_state_dict(stats.state_dict())  # what it made is taken
    assert fresh.state_dict()["sums"].tolist() == [3.0, 1.0, 5.0, 9.0]
    DeviceEpisodeStats().load_state_dict(DeviceEpisodeStats().state_dict())  # no episode yet
    with pytest.raises(ValueError, match=needle):
        fresh.load_state_dict(_device_state(stats, **edits))
