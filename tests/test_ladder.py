"""The ``ladder`` command (``labkit/app/ladder.py``): every size is checked before the first is
measured, and a stop keeps what finished. Sections 7 and 8 of the reliability issue."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.runs import run_cli


@pytest.mark.slow
def test_ladder_keeps_what_it_measured_on_ctrl_c(tmp_path, capsys, monkeypatch):
    """The stages at one N are measured together (their rounds interleaved), so what a Ctrl-C
    keeps is every group that finished: here the ladder, stopped in the scaling sweep."""
    import labkit.measure.bench

    real = labkit.measure.bench.measure_stages
    calls = []

    def measure_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, as the sweep starts
        return real(*args, **kwargs)

    monkeypatch.setattr(labkit.measure.bench, "measure_stages", measure_then_interrupt)
    code, out, _ = run_cli(["ladder", "--device", "cpu", "--stages", "3,4", "--n-envs", "4",
                            "--n-steps", "8", "--scaling-n-envs", "8", "--no-progress",
                            "--out", str(tmp_path)], capsys)
    assert code == 130
    assert "batched_ops" in out and "PARTIAL: interrupted by SIGINT" in out
    result = json.loads((tmp_path / "ladder_cpu_quick_partial.json").read_text())
    assert result["interrupted"] == "SIGINT"
    assert [r["name"] for r in result["ladder"]] == ["batched_ops", "async_logging"]
    assert result["scaling"] == [] and all(r["status"] == "ok" for r in result["ladder"])


def test_every_size_the_ladder_will_use_is_checked_first(tmp_path, capsys):
    start = time.perf_counter()
    code, out, err = run_cli(["ladder", "--device", "cpu", "--n-envs", "8", "--n-steps", "2",
                              "--scaling-n-envs", "1", "--no-progress", "--out",
                              str(tmp_path)], capsys)
    assert code == 2 and "n_minibatches" in err and out == ""
    assert time.perf_counter() - start < 5 and list(tmp_path.iterdir()) == []


def test_a_stage_stepping_one_env_at_a_time_is_bounded_to_whole_iterations_of_fewer_steps():
    """Stages 0 and 2 step one env at a time in Python: at a GPU ladder's N x T an iteration
    takes a minute. Their rows keep the ladder's N and take the largest T whose N x T keeps
    within the bound and fills the minibatches; the vectorized stages keep the ladder's T."""
    from labkit.config import BenchConfig
    from labkit.measure.bench import bounded
    from labkit.stages import get_stage

    full = BenchConfig.from_profile("full")
    loop, torch_loop, batched = (get_stage(s) for s in ("python_loop", "torch_state",
                                                        "batched_ops"))
    assert (full.run.n_envs, full.run.n_steps, full.loop_steps_bound) == (1024, 128, 8192)
    assert bounded(loop, full).run.n_steps == 8 and bounded(torch_loop, full).run.n_steps == 8
    assert bounded(loop, full).run.n_envs == 1024 and bounded(batched, full) is full
    quick = BenchConfig.from_profile("quick")  # 32 x 64 = 2,048: within the bound
    assert bounded(loop, quick) is quick
    # 6 envs, 4 minibatches: T must be even; 20 // 6 = 3, so T = 2
    odd = BenchConfig.from_profile("tiny", n_envs=6, n_steps=128, loop_steps_bound=20)
    assert bounded(loop, odd).run.n_steps == 2
    # N alone passes the bound: the fewest steps that fill the minibatches, not none
    wide = BenchConfig.from_profile("tiny", n_envs=6, n_steps=128, loop_steps_bound=4)
    assert bounded(loop, wide).run.n_steps == 2
    # measured after the rows at the ladder's T, so a stay cut short keeps those
    import torch

    from labkit.measure.bench import ladder_plan
    plan = ladder_plan(odd, torch.device("cpu"), stages=[0, 1, 2, 3], scaling=False)
    assert [(s.index, c.run.n_steps) for _, s, c in plan] == [(1, 128), (3, 128), (0, 2),
                                                               (2, 2)]
    with pytest.raises(ValueError, match="loop_steps_bound must be >= 1"):
        BenchConfig.from_profile("tiny", loop_steps_bound=0)


@pytest.mark.slow
def test_the_ladder_times_a_bounded_stage_over_its_own_whole_iterations_and_says_so(
        tmp_path, capsys):
    code, out, _ = run_cli(["ladder", "--device", "cpu", "--stages", "0,2,3", "--n-envs", "4",
                            "--n-steps", "8", "--iterations", "2", "--loop-steps-bound", "8",
                            "--no-scaling", "--no-progress", "--out", str(tmp_path)], capsys)
    assert code == 0, out
    rows = json.loads((tmp_path / "ladder_cpu_quick.json").read_text())["ladder"]
    assert [(r["name"], r["n_steps"], r["status"]) for r in rows] == [
        ("python_loop", 2, "ok"), ("torch_state", 2, "ok"), ("batched_ops", 8, "ok")]
    for r in rows[:2]:  # the rate is over whole iterations of its own steps, update included
        assert r["steps_bound"] == {"env_steps": 8, "n_steps_of": 8}
        assert r["sps"] == pytest.approx(4 * 2 / r["iteration_s"])
        assert r["phase_ms"]["update"] > 0
    assert "steps_bound" not in rows[2] and rows[2]["x_vs_stage0"] is not None
    head = out.splitlines()[0].split()
    assert head[:4] == ["#", "stage", "N", "T"]
    assert ("bounded: 0 python_loop at T=2, 2 torch_state at T=2 of 8: a stage that steps one "
            "env at a time") in " ".join(out.split())


def test_every_row_shares_one_peak_and_each_dtype_is_measured_once(monkeypatch):
    """The H200 file printed a bf16 peak of 791 TFLOP/s and divided stage 7 by a second
    measurement of the same matmul (692.5), and stages 1-6 by the fp32 peak: '% of peak' fell
    from 1.40 to 0.14 between stages 6 and 7 though stage 7 ran 1.32x faster. Now a run
    measures each dtype once (the peak's own dtype is the peak) and every row divides by the
    one peak its notes print, the update's model work over its phase as well; an older file
    is put on that peak when it is written or reported."""
    import torch

    import labkit.device
    import labkit.precision
    from labkit.measure import bench
    from labkit.stages import STAGES

    for module in (labkit.device, labkit.precision):  # stage 7 runs bf16 on this CPU
        monkeypatch.setattr(module, "cpu_bf16", lambda: "AVX-512 BF16")
    speeds = {None: 100e9, torch.float32: 100e9, torch.bfloat16: 400e9}
    asked = []

    def peak(device, seconds=1.0, dtype=None):
        asked.append(dtype)
        return {"peak_flops": speeds[dtype], "peak_dtype": "float32", "peak_n": 8}

    monkeypatch.setattr(bench, "matmul_peak_flops", peak)
    cal = bench.calibrate(torch.device("cpu"), [STAGES[3], STAGES[7]])
    assert asked == [None, torch.bfloat16]
    assert cal["peak_flops"] == 100e9 and cal["peaks"] == {"bf16": 400e9, "fp32": 100e9}
    full = bench.BenchConfig.from_profile("full")
    result = {"config": full.to_dict(), "peak_flops": 100e9, "ladder": [
        {"status": "ok", "n_envs": 1024, "n_steps": 128, "flops_per_s": 1e9,
         "frac_of_peak": 0.01, "precision": "fp32", "phase_ms": {"update": 50.0}},
        {"status": "ok", "n_envs": 1024, "n_steps": 128, "flops_per_s": 2e9,
         "frac_of_peak": 0.005, "precision": "bf16", "phase_ms": {"update": 25.0}},
        {"status": "skipped: needs CUDA"},
        {"status": "ok", "flops_per_s": 1e9, "frac_of_peak": 0.02, "peak_flops": 50e9}]}
    bench.one_denominator(result)
    fp32, bf16, skipped, kept = result["ladder"]
    assert (fp32["frac_of_peak"], bf16["frac_of_peak"]) == (0.01, 0.02)
    assert fp32["peak_flops"] == bf16["peak_flops"] == 100e9
    assert kept == {"status": "ok", "flops_per_s": 1e9, "frac_of_peak": 0.02,
                    "peak_flops": 50e9}  # divided when measured, by the peak it keeps
    update = 1024 * 128 * 4 * bench.flops_per_sample(7, "conv")["train"]  # 282.8 GFLOP
    assert bf16["update_flops_per_s"] == pytest.approx(update / 0.025)
    assert bf16["update_frac_of_peak"] == pytest.approx(update / 0.025 / 100e9)
    assert skipped == {"status": "skipped: needs CUDA"}
