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
    assert lines[0].startswith("ladder_cuda_full.json: NVIDIA H100, torch 2.13")
    # recorded before the device / host-scalar split: a dash, never 0 or an error
    assert lines[1].split() == ["7", "fused_amp", "N=1024", "T=128:", "123,456", "env",
                                "steps/s,", "\u2014", "device", "reads", "(syncs)", "and",
                                "\u2014", "host-scalar", "reads", "per", "iteration,", "bf16;",
                                "ms", "per", "iteration:", "policy", "1.5,", "update", "2.2"]
    assert lines[2].split() == ["8", "cuda_graphs", "skipped:", "needs", "CUDA"]
    assert len(recorded_gpu(["gpu_metrics"], tmp_path).splitlines()) == 1


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
