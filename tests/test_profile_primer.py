"""Chapter 00's profile primer: reading a Chrome trace (its top-level events, labkit's phase
ranges), drawing it without a trace viewer, and the bytes a call moves."""
import json

import matplotlib
import pytest
import torch
from torch.profiler import record_function

from labkit.book.plots import trace_timeline
from labkit.config import RunConfig
from labkit.measure.profiling import (
    bytes_moved,
    phase_spans,
    profile_calls,
    profile_stage,
    read_trace,
    top_level,
)

matplotlib.use("Agg")


def _x(name, ts, dur, tid=1, cat="cpu_op", pid=7):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


#: Two threads and a GPU stream: an op with a child, two ops, a kernel, two phases, the
#: profiler's span and a thread name.
SYNTHETIC = [
    {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "main"}},
    _x("PyTorch Profiler (0)", 0, 100, cat="Trace"),
    _x("phase: policy", 10, 30, cat="user_annotation"),
    _x("phase: update", 40, 50, cat="user_annotation"),
    _x("aten::linear", 12, 20),
    _x("aten::addmm", 14, 15),  # inside aten::linear
    _x("Optimizer.step#Adam.step", 45, 30, cat="user_annotation"),
    _x("aten::add_", 50, 5),  # inside the optimizer step
    _x("aten::mul", 45, 3, tid=2),  # another thread, at the same time
    _x("gemm_kernel", 20, 10, cat="kernel", pid=0, tid=7),
    _x("block", 19, 12, cat="gpu_user_annotation", pid=0, tid=7),
    {"ph": "s", "cat": "ac2g", "name": "launch", "pid": 7, "tid": 1, "ts": 15, "id": 1},
]


def test_top_level_keeps_what_each_thread_was_doing_and_no_bookkeeping():
    outer = [(e["name"], e["tid"]) for e in top_level(SYNTHETIC)]
    assert sorted(outer) == [("Optimizer.step#Adam.step", 1), ("aten::linear", 1),
                             ("aten::mul", 2), ("gemm_kernel", 7)]


def test_phase_spans_in_time_order():
    assert phase_spans(list(reversed(SYNTHETIC))) == [("policy", 10.0, 40.0),
                                                      ("update", 40.0, 90.0)]


def test_read_trace_takes_a_dict_or_a_bare_list(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"traceEvents": SYNTHETIC, "schemaVersion": 1}))
    (tmp_path / "b.json").write_text(json.dumps(SYNTHETIC))
    assert read_trace(tmp_path / "a.json") == read_trace(tmp_path / "b.json") == SYNTHETIC


def test_trace_timeline_draws_a_row_per_thread_and_the_phases(tmp_path):
    import matplotlib.pyplot as plt

    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": SYNTHETIC}))
    ax = trace_timeline(tmp_path / "t.json")
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["phases", "main", "7 / 2", "0 / 7"]  # the CPU's threads, then the stream
    assert ax.get_xlim() == pytest.approx((2.0 / 1e3, 65.0 / 1e3))  # ms from the first phase
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"cpu_op", "kernel", "user_annotation", "phase: policy", "phase: update"} \
        == set(legend)
    plt.close(ax.figure)
    ax = trace_timeline(SYNTHETIC, window=(0.0, 0.02))  # the policy phase only
    assert ax.get_xlim() == (0.0, 0.02)
    named = {t.get_text() for t in ax.texts}
    assert "policy" in named and "update" not in named
    assert "phase: update" not in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(ax.figure)
    ax = trace_timeline(SYNTHETIC, window=(0.03, 0.08))  # policy ends where the window starts
    named = {t.get_text() for t in ax.texts}
    assert "update" in named and "policy" not in named
    plt.close(ax.figure)


def test_a_real_profile_reads_back_with_the_block_on_top(tmp_path, cpu):
    w, x = torch.randn(16, 16), torch.randn(8, 16)

    def block():
        with record_function("block"):
            return torch.relu(x @ w).sum()

    prof = profile_calls(block, cpu)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = read_trace(tmp_path / "trace.json")
    assert [e["name"] for e in top_level(events)] == ["block"]
    inside = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert {"aten::matmul", "aten::relu", "aten::sum"} <= inside


def test_bytes_moved_counts_each_tensor_once_per_op_and_no_views():
    a, b = torch.ones(10), torch.ones(10)  # 40 bytes each
    assert bytes_moved(lambda: a + b) == 3 * 40
    assert bytes_moved(lambda: a.add_(b)) == 2 * 40  # in place: a is read and written
    assert bytes_moved(lambda: a.view(2, 5)) == 0  # a view moves nothing
    lin = torch.nn.Linear(10, 4)
    with torch.no_grad():  # addmm: bias, input, weight, output
        assert bytes_moved(lambda: lin(a[None])) == 4 * (4 + 10 + 40 + 4)


@pytest.mark.slow
def test_profile_stage_writes_a_trace_with_one_policy_phase_per_step(tmp_path, cpu):
    profile_stage("async_logging", RunConfig(n_envs=8, n_steps=4), cpu, tmp_path)
    (path,) = tmp_path.glob("*.pt.trace.json")
    events = read_trace(path)
    names = [p for p, _, _ in phase_spans(events)]
    assert names.count("policy") == 4 and names.count("update") == 1
    (update,) = [(s, e) for p, s, e in phase_spans(events) if p == "update"]
    steps = [e for e in events if e.get("name", "").startswith("Optimizer.step#")]
    assert steps and all(update[0] <= e["ts"] and e["ts"] + e["dur"] <= update[1] for e in steps)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_trace_links_each_kernel_to_its_launch(tmp_path):
    dev = torch.device("cuda")
    a = torch.randn(256, 256, device=dev)
    a @ a
    prof = profile_calls(lambda: a @ a, dev)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = read_trace(tmp_path / "trace.json")
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    assert kernels and all(k["args"]["correlation"] in launches for k in kernels)
    assert all(k["ts"] >= launches[k["args"]["correlation"]]["ts"] for k in kernels)
    assert any(e.get("cat") == "kernel" for e in top_level(events))
