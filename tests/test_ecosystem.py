"""Meeting users where they are: profiler traces, TensorBoard, and scale-out with torchrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.app import checkpoint
from labkit.app.cli import main
from labkit.app.train import TrainConfig, train
from labkit.capture import tree_tensors
from labkit.config import RunConfig
from labkit.measure.syncmeter import SyncMeter
from labkit.stages import Pipeline

ROOT = Path(__file__).parents[1]


# ---------------------------------------------------------------- profiler traces


@pytest.mark.slow
def test_profile_writes_a_trace_with_the_phases_labelled(tmp_path, capsys):
    code = main(["profile", "--device", "cpu", "--stage", "gpu_metrics", "--n-envs", "8",
                 "--n-steps", "16", "--iterations", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "top ops by self time" in out
    assert "aten::convolution_backward" in out or "aten::mkldnn_convolution" in out
    [trace] = tmp_path.glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    phases = [e for e in events if e.get("name", "").startswith("phase: ")]
    names = {e["name"].removeprefix("phase: ") for e in phases}
    assert {"policy", "env", "io", "metrics", "gae", "update"} <= names
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    first, last = min(e["ts"] for e in phases), max(e["ts"] + e["dur"] for e in phases)
    inside = [e for e in ops if first <= e["ts"] <= last]
    assert len(inside) > 0.9 * len(ops)  # the phase ranges cover the profiled iterations
    updates = [e for e in phases if e["name"] == "phase: update"]
    convs_in_update = [e for e in ops if e["name"] == "aten::convolution_backward"
                       and any(u["ts"] <= e["ts"] <= u["ts"] + u["dur"] for u in updates)]
    assert len(convs_in_update) == 2 * 16 * 2  # 2 iterations x 16 minibatches x 2 convs


# ---------------------------------------------------------------- TensorBoard


@pytest.mark.slow
def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrainConfig.flat(stage="async_logging", device="cpu", n_envs=4, n_steps=16,
                           total_steps=256, seed=2, checkpoint_every=0)
    train(cfg, tmp_path / "run", progress=False, tensorboard=tmp_path / "tb")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key in ("pg_loss", "entropy", "lr", "sps"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [r["step"] for r in records]
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records],
                                                           rel=1e-6)


@pytest.mark.slow
def test_tensorboard_shows_replayed_iterations_once_after_a_resume(tmp_path):
    """A session killed after its checkpoint logged iterations the resume runs again; the
    resumed writer purges them, so TensorBoard shows every iteration once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    cfg = TrainConfig.flat(stage="async_logging", device="cpu", n_envs=4, n_steps=16,
                           total_steps=256, seed=2, checkpoint_every=0)
    run, tb = tmp_path / "run", tmp_path / "tb"
    train(cfg, run, progress=False, tensorboard=tb, stop_after=2)  # checkpoint at 2
    killed = SummaryWriter(str(tb))  # what the killed session logged after it: iteration 3
    killed.add_scalar("pg_loss", 123.0, 3 * 64)
    killed.close()
    train(None, run, resume=True, progress=False, tensorboard=tb)
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = events.Scalars("pg_loss")
    assert [s.step for s in scalars] == [64, 128, 192, 256] and 123.0 not in \
        [s.value for s in scalars]


def test_tensorboard_writes_happen_off_the_training_thread(tmp_path):
    """Tensors logged to the TensorBoard sink are read (and written) by the async logger's
    thread: the training thread makes no host read, and the values arrive."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from labkit.logging import AsyncLogger, TensorBoardSink

    values = torch.linspace(0.5, 2.0, 8)
    board = AsyncLogger(None, sinks=[TensorBoardSink(tmp_path)])
    with SyncMeter() as meter:
        for step, v in enumerate(values):
            board.log(step, loss=v, lr=v * 1e-3)  # device tensors, as the hot path has them
    board.close()
    assert meter.host_reads == 0
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(values.tolist())


# ---------------------------------------------------------------- torchrun


def torchrun(*argv: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """``labkit train`` under torchrun, with Python's fault handler on (a rank that dies of a
    signal prints every thread's stack)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", "-m", "labkit", "train", "--no-progress", *argv]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


#: Each rank joins through labkit, imports what torch.optim and torch.compile import lazily
#: (after the join, as in a run), talks, leaves, and writes the gloo threads it has left.
_LEAVE = """
import os, sys, torch
from labkit.distributed import join, leave
group = join("cpu")
import torch._dynamo  # noqa: F401  (the first optimizer or compile imports it)
x = torch.ones(2)
torch.distributed.all_reduce(x)
leave(group)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(os.path.join(sys.argv[1], f"rank{group.rank}.txt"), "w") as f:  # one file a rank
    f.write(f"threads left: {sorted(n for n in names if 'gloo' in n)}")
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_leaving_the_group_ends_its_threads(tmp_path):
    """After ``leave`` no gloo thread is left: a group that outlives destroy_process_group
    keeps gloo's C++ threads running into the interpreter's teardown, where a rank of a
    two-rank run sometimes died of SIGABRT ("terminate called without an active exception";
    CI, three times). It outlived it because torch.distributed.nn.functional, first imported
    after the join (by torch._dynamo), binds the live group as ten functions' default
    argument; the join imports it first."""
    script = tmp_path / "leave.py"
    script.write_text(_LEAVE)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--standalone", str(script), str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "threads left: []"


TINY = ["--device", "cpu", "--stage", "gpu_metrics", "--n-envs", "8", "--n-steps", "16",
        "--seed", "3"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "run"
    r = torchrun(*TINY, "--total-steps", "2048", "--checkpoint-every", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_ranks_keep_identical_parameters_and_count_all_steps(two_rank_run):
    summary = json.loads((two_rank_run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2048
    assert summary["params_identical_on_all_ranks"] and len(summary["param_checksums"]) == 2
    records = [json.loads(line) for line in (two_rank_run / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [256 * (i + 1) for i in range(8)]
    saved = checkpoint.load(two_rank_run / "checkpoint.pt")
    ranks = saved["ranks"]
    assert len(ranks) == 2
    env0, env1 = (r["collector"]["env"] for r in ranks)
    assert not torch.equal(env0["grid"], env1["grid"])  # each rank steps its own envs


def test_the_process_group_follows_the_runs_device(monkeypatch):
    """A CPU run under torchrun uses gloo and never touches CUDA, even on a GPU machine (rank
    1 of two on a one-GPU box once asked for cuda:1); a CUDA run with more ranks on a node
    than GPUs is refused in one line."""
    from labkit import distributed

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, timeout: calls.append(("init", backend)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    group = distributed.join("cpu")
    assert (group.rank, group.world, group.local_rank) == (1, 2, 1)
    assert calls == [("init", "gloo")]
    with pytest.raises(ValueError, match=r"LOCAL_RANK 1 has no GPU: this node has 1 CUDA "
                                         r"device\(s\).*--nproc-per-node 1"):
        distributed.join("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    calls.clear()
    distributed.join("cuda")
    assert calls == [("set_device", 1), ("init", "cpu:gloo,cuda:nccl")]


def test_each_rank_steps_its_own_slice_of_the_global_envs():
    """Rank r of a run of N envs per rank steps global env indices r*N .. r*N + N - 1: rank 1
    of two starts where envs 8-15 of one 16-env pipeline start."""
    from labkit.distributed import Group

    with Pipeline("gpu_metrics", RunConfig(n_envs=16, n_steps=16, seed=3), "cpu") as p:
        wide = p.collector.obs.clone()
    with Pipeline("gpu_metrics", RunConfig(n_envs=8, n_steps=16, seed=3), "cpu",
                  group=Group(rank=1, world=2)) as p:
        assert torch.equal(p.collector.obs, wide[8:])
        assert not torch.equal(p.collector.obs, wide[:8])


def _same_checkpoints(a_path: Path, b_path: Path) -> None:
    a, b = checkpoint.load(a_path), checkpoint.load(b_path)
    for x, y in zip(tree_tensors(a["state"]), tree_tensors(b["state"]), strict=True):
        assert torch.equal(x, y)
    for ra, rb in zip(a["ranks"], b["ranks"], strict=True):
        for x, y in zip(tree_tensors(ra), tree_tensors(rb), strict=True):
            assert torch.equal(x, y)


@pytest.mark.slow
def test_a_two_rank_run_resumes_exactly(two_rank_run, tmp_path):
    out = tmp_path / "split"
    r = torchrun(*TINY, "--total-steps", "2048", "--checkpoint-every", "4", "--out", str(out),
                 "--stop-after", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert checkpoint.load(out / "checkpoint.pt")["state"]["iteration"] == 4
    r = torchrun("--resume", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    _same_checkpoints(out / "checkpoint.pt", two_rank_run / "checkpoint.pt")
    def strip(rec):
        return {k: v for k, v in rec.items() if k not in ("iter_s", "sps", "wall_s")}
    lines = [(run / "metrics.jsonl").read_text().splitlines() for run in (out, two_rank_run)]
    assert [strip(json.loads(x)) for x in lines[0]] == [strip(json.loads(x)) for x in lines[1]]


@pytest.mark.slow
def test_a_two_rank_run_learns_and_resumes_after_sigterm(tmp_path):
    out = tmp_path / "r"
    args = ["--device", "cpu", "--stage", "gpu_metrics", "--n-envs", "32", "--n-steps", "32",
            "--seed", "1",
            "--total-steps", "98304", "--checkpoint-every", "8", "--out", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "labkit", "train", "--no-progress", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 600
    while not (out / "checkpoint.pt").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    stopped_at = checkpoint.load(out / "checkpoint.pt")["state"]["iteration"]
    assert stopped_at % 8 == 0 and stopped_at < 48
    r = torchrun("--resume", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["params_identical_on_all_ranks"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 49))
    early = [r["mean_return"] for r in records[:4] if r["episodes"]]
    assert summary["final_mean_return"] > 3 * max(early + [0.5])  # it learns
    one_go = tmp_path / "one_go"
    r = torchrun(*args[:-1], str(one_go), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    _same_checkpoints(out / "checkpoint.pt", one_go / "checkpoint.pt")
