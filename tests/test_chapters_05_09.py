"""Helpers that chapters 05-09 use: recorded GPU results read by code, the break-even size."""
import json

import pytest

from labkit.book.show import recorded_gpu
from labkit.timing import break_even


def _ladder(device: str, name: str) -> dict:
    row = {"stage": 7, "name": "fused_amp", "status": "ok", "n_envs": 1024, "n_steps": 128,
           "sps": 123456.0, "host_reads_per_iter": 1, "precision": "bf16",
           "phase_ms": {"policy": 1.5, "update": 2.25}}
    skipped = {"stage": 8, "name": "cuda_graphs", "status": "skipped: needs CUDA"}
    return {"meta": {"device": device, "device_name": name, "torch": "2.13", "git_commit": "abc",
                     "date": "2026-01-01"}, "ladder": [row, skipped]}


def test_recorded_gpu_says_so_when_there_is_none(tmp_path):
    assert recorded_gpu(["fused_amp"], tmp_path) == "No GPU run recorded yet"
    (tmp_path / "ladder_cpu_quick.json").write_text(json.dumps(_ladder("cpu", "x86_64")))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "bench_env.json").write_text(json.dumps([1, 2]))
    assert recorded_gpu(["fused_amp"], tmp_path) == "No GPU run recorded yet"


def test_recorded_gpu_prints_the_device_and_the_named_stages(tmp_path):
    (tmp_path / "ladder_cuda_full.json").write_text(json.dumps(_ladder("cuda", "NVIDIA H100")))
    lines = recorded_gpu(["fused_amp", "cuda_graphs"], str(tmp_path)).splitlines()
    assert lines[0] == "ladder_cuda_full.json: NVIDIA H100, torch 2.13, 2026-01-01"
    assert lines[1] == "  commit abc, commits behind HEAD unknown (no git history here)"
    # recorded before the device / host-scalar split and without a spread: a dash, never 0 or
    # an error, and the median as its own range
    assert lines[2:5] == [
        "  7 fused_amp       N=1024 T=128, bf16: 123,456 env steps/s (123,456-123,456)",
        "      \u2014 device reads (syncs) and \u2014 host-scalar reads per iteration",
        "      ms per iteration: policy 1.5, update 2.2"]
    assert lines[5].split() == ["8", "cuda_graphs", "skipped:", "needs", "CUDA"]
    assert len(recorded_gpu(["gpu_metrics"], tmp_path).splitlines()) == 2


def test_recorded_gpu_rows_carry_spread_noise_age_and_the_chapters_verdict(tmp_path):
    """Two stages at the same N and T: each row's range and noise flag, the file's age in
    commits, and what ``versus`` (the chapters' rule) says of the pair: here ranges that
    overlap, so no winner is named; apart, the faster one is."""
    from labkit.device import git_commit

    data = _ladder("cuda", "NVIDIA H200")
    data["meta"]["git_commit"] = git_commit()  # this checkout's HEAD: 0 commits behind
    slow = {**data["ladder"][0], "stage": 6, "name": "gpu_metrics", "sps": 100_000.0,
            "iteration_s": 1.31, "iteration_s_samples": [1.2, 1.31, 1.4],
            "sps_spread": [93_623, 100_000, 109_227],
            "noisy": True, "noise": ["marked and plain iterations +29% apart (> 25%)"]}
    fast = {**data["ladder"][0], "iteration_s": 1.1,
            "iteration_s_samples": [1.0, 1.1, 1.25],
            "sps_spread": [104_858, 119_156, 131_072], "sps": 119_156.0}
    data["ladder"] = [slow, fast]
    (tmp_path / "ladder_cuda_full.json").write_text(json.dumps(data))
    text = recorded_gpu(["gpu_metrics", "fused_amp"], tmp_path)
    lines = text.splitlines()
    if git_commit() != "unknown":
        assert lines[1].endswith(", 0 commits behind HEAD")
    assert "(93,623-109,227)" in lines[2] and lines[3] == (
        "      NOISY: marked and plain iterations +29% apart (> 25%)")
    verdict = " ".join(line.strip() for line in lines if line.strip().startswith("=>")
                       or line.startswith("     ") and not line.startswith("      "))
    assert verdict.startswith("=> fused_amp ran at 1.19x gpu_metrics's median") and (
        "overlap" in verdict and "cannot resolve" in verdict)
    assert max(len(line) for line in lines) <= 96
    fast["iteration_s_samples"] = [0.8, 0.85, 0.9]
    (tmp_path / "ladder_cuda_full.json").write_text(json.dumps(data))
    assert "every timed iteration of fused_amp was faster than every one of gpu_metrics" in \
        " ".join(recorded_gpu(["gpu_metrics", "fused_amp"], tmp_path).split())


def test_break_even_is_the_size_from_which_the_candidate_always_wins():
    sizes = [64, 256, 1024, 4096]
    assert break_even(sizes, [1, 2, 4, 8], [2, 1.5, 3, 6]) == 256
    assert break_even(sizes, [1, 2, 4, 8], [2, 1.5, 5, 6]) == 4096  # lost at 1024
    assert break_even(sizes, [1, 2, 4, 8], [2, 3, 5, 9]) is None
    assert break_even(sizes, [1, 2, 4, 8], [0.5, 1, 2, 4]) == 64
    with pytest.raises(ValueError, match="ascending"):
        break_even([256, 64], [1, 2], [1, 2])
    with pytest.raises(ValueError, match="one baseline"):
        break_even([64, 256], [1], [1, 2])


def test_reads_by_file_drops_lines_functions_and_via():
    from labkit.book.show import reads_by_file

    sites = {"labkit/ppo.py:210 (minibatch_step) via torch/optim/adam.py:400": 96,
             "labkit/ppo.py:214 (minibatch_step) via torch/optim/adam.py:420": 64,
             "labkit/logging.py:60 (_to_python)": 32, "<unknown>": 1}
    assert reads_by_file(sites) == {"labkit/ppo.py": 160, "labkit/logging.py": 32,
                                    "<unknown>": 1}
    assert list(reads_by_file(sites, per=32).values()) == [5.0, 1.0, 1 / 32]


def test_launches_per_step_fused_fewest_and_flat_per_parameter_grows():
    """Chapter 08's launch counts: per-parameter Adam grows with the parameter tensors, foreach
    and fused do not, fused launches fewest; the parameters got gradients of ones."""
    import torch

    from labkit.measure.profiling import optimizer_launches as launches_per_step

    def per_step(n_layers, **flags):
        model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(n_layers)])
        counts = launches_per_step(model.parameters(), **flags)
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
        return sum(counts.values())

    flags = ({"foreach": False}, {"foreach": True}, {"fused": True})
    loop2, foreach2, fused2 = (per_step(2, **f) for f in flags)
    loop4, foreach4, fused4 = (per_step(4, **f) for f in flags)
    assert fused2 < foreach2 < loop2 and fused4 < foreach4 < loop4
    assert loop4 == 2 * loop2 and foreach4 == foreach2 and fused4 == fused2


def _row(stage, samples, phase_samples=None):
    """A measure_stage row with only what claims.versus reads (N x T = 100 samples)."""
    phase_samples = phase_samples or [{"env": 1.0}]
    mid = sorted(samples)[len(samples) // 2]
    return {"stage": stage, "n_envs": 10, "n_steps": 10, "iteration_s": mid,
            "iteration_s_samples": samples, "iteration_s_spread": [min(samples), mid,
                                                                  max(samples)],
            "phase_ms": {"env": sorted(p["env"] for p in phase_samples)[len(phase_samples) // 2]},
            "phase_ms_samples": phase_samples}


def test_versus_says_faster_slower_or_within_and_flips_with_the_order():
    from labkit.book.claims import versus

    slow, fast, close = (_row(6, [0.10, 0.11, 0.12]), _row(7, [0.05, 0.06, 0.07]),
                         _row(7, [0.095, 0.105, 0.115]))
    said = versus(slow, fast)
    assert said.startswith("stage 7 ran at 1.83x stage 6's median env steps/s (1,667 vs 909)")
    assert "every timed iteration of stage 7 was faster than every one of stage 6" in said
    flipped = versus(fast, _row(6, [0.10, 0.11, 0.12]) | {"stage": 6})
    assert "stage 6 ran at 0.55x stage 7's" in flipped
    assert "every timed iteration of stage 6 was slower than every one of stage 7" in flipped
    within = versus(slow, close, names=("stage 6 (first)", "stage 6 (again)"))
    assert within.startswith("stage 6 (again) ran at 1.05x stage 6 (first)'s")
    assert "overlap (stage 6 (again) 95-115 ms, stage 6 (first) 100-120 ms)" in within
    assert "within this run's spread" in within and "beyond" not in within
    # a row recorded with only its spread (no samples) is still compared
    old = {k: v for k, v in slow.items() if k != "iteration_s_samples"}
    assert "faster than every one" in versus(old, fast)


def test_phase_moved_tells_a_move_beyond_the_spread_from_one_within_it():
    from labkit.book.claims import phase_moved

    a = _row(4, [0.1], [{"env": 30.0}, {"env": 31.4}, {"env": 33.0}])
    b = _row(5, [0.1], [{"env": 25.0}, {"env": 26.0}, {"env": 27.0}])
    c = _row(5, [0.1], [{"env": 28.0}, {"env": 30.5}, {"env": 34.0}])
    assert phase_moved(a, b, "env") == \
        "env 31.4 -> 26.0 ms per iteration (shorter in every marked iteration: beyond this " \
        "run's spread)"
    assert "longer in every marked iteration" in phase_moved(b, a, "env")
    assert phase_moved(a, c, "env") == \
        "env 31.4 -> 30.5 ms per iteration (the marked iterations overlap: within this run's " \
        "spread)"
