from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import debug
from labkit.app import checkpoint
from labkit.app.cli import main
from labkit.app.train import TrainConfig, TrainingFailed, TrainingInterrupted, train
from labkit.capture import tree_tensors
from labkit.config import RunConfig
from labkit.device import deterministic
from labkit.envs.policies import mean_return
from labkit.envs.spec import ForageSpec
from labkit.executors import Eager
from labkit.files import FolderLock
from labkit.ppo import PPOConfig
from labkit.stages import Pipeline, PipelineState, get_stage
from tests.runs import (
    ROOT,
    TINY,
    metrics_lines,
    run_cli,
    start_training,
    tiny_config,
    wait_for,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Short episodes so that a few tiny iterations finish some (no NaN statistics to compare).
SPEC = ForageSpec(episode_length=20)
TIMING_KEYS = {"iter_s", "sps", "wall_s"}


def small_config(**overrides) -> TrainConfig:
    """6 iterations of 8 envs x 16 steps on the CPU: about a second."""
    kwargs = dict(stage="async_logging", device="cpu", n_envs=8, n_steps=16,
                  total_steps=6 * 128, seed=3, checkpoint_every=2, spec=SPEC)
    return TrainConfig.flat(**{**kwargs, **overrides})


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def assert_same_state(a: dict | PipelineState, b: dict | PipelineState) -> None:
    """Bit-identical model, optimizer, env, collector, generator state and counters (a state
    as a pipeline holds it, or as a checkpoint file stores it)."""
    a, b = (PipelineState.from_dict(s) if isinstance(s, dict) else s for s in (a, b))
    flat_a, flat_b = tree_tensors(a), tree_tensors(b)
    assert len(flat_a) == len(flat_b) > 0
    for x, y in zip(flat_a, flat_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)
    assert (a.iteration, a.global_step) == (b.iteration, b.global_step)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """Six iterations in one go."""
    out = tmp_path_factory.mktemp("reference")
    train(small_config(), out, progress=False)
    return out


# ---------------------------------------------------------------- configuration and CLI


@pytest.mark.parametrize("overrides, field", [
    (dict(n_envs=0), "n_envs"),
    (dict(n_steps=-1), "n_steps"),
    (dict(total_steps=100), "total_steps"),
    (dict(seed=-1), "seed"),
    (dict(value_head="gaussian"), "value_head"),
    (dict(stage=9), "stage"),
    (dict(stage="warp_drive"), "stage"),
    (dict(device="tpu"), "device"),
    (dict(checkpoint_every=-1), "checkpoint_every"),
    (dict(ppo=PPOConfig(n_minibatches=3)), "n_minibatches"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises((ValueError, TypeError), match=field):
        small_config(**overrides)


def test_config_derives_iterations_and_round_trips():
    cfg = small_config(total_steps=6 * 128 + 100, stage=7, value_head="popart")
    assert cfg.stage == "fused_amp" and cfg.run.batch_size == 128 and cfg.n_iterations == 6
    assert cfg.run.lr_horizon == 6  # the LR anneals over the whole run
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("argv, needle", [
    (["--stage", "warp"], "--stage"),
    (["--stage", ""], "fused_amp"),
    (["--value-head", "gaussian"], "--value-head"),
    (["--n-envs", "0"], "--n-envs"),
])
def test_cli_rejects_bad_arguments(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_reports_config_errors(capsys, tmp_path):
    rc = main(["train", "--device", "cpu", "--n-envs", "64", "--n-steps", "128",
               "--total-steps", "100", "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "total_steps" in err and "8192" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cli_rejects_a_stage_the_device_cannot_run(capsys, tmp_path):
    rc = main(["train", "--stage", "cuda_graphs", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 2
    assert "cuda_graphs" in capsys.readouterr().err


def test_cli_resume_takes_no_config_flags(capsys, tmp_path):
    rc = main(["train", "--resume", str(tmp_path), "--n-envs", "8"])
    assert rc == 2
    assert "--n-envs" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_trains_and_writes_metrics_checkpoint_and_summary(capsys, tmp_path):
    out = tmp_path / "run"
    rc = main(["train", "--stage", "batched_ops", "--device", "cpu", "--n-envs", "8",
               "--n-steps", "16", "--total-steps", "400", "--checkpoint-every", "1",
               "--seed", "5", "--out", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "384 steps" in stdout and "final mean return" in stdout
    records = read_metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert [r["step"] for r in records] == [128, 256, 384]
    # The LR anneals linearly over the 3 iterations of the whole run.
    assert [r["lr"] for r in records] == pytest.approx([2.5e-4, 2.5e-4 * 2 / 3, 2.5e-4 / 3])
    for r in records:
        assert {"mean_return", "mean_length", "pg_loss", "v_loss", "entropy", "approx_kl",
                "clipfrac", "grad_norm", "sps", "wall_s"} <= set(r)
        assert 0 < r["entropy"] <= torch.log(torch.tensor(5.0)).item() + 1e-6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 384 and summary["complete"]
    assert summary["config"]["stage"] == "batched_ops"
    assert f"after this session's {summary['setup_s']:.1f} s set-up" in stdout
    saved = checkpoint.load(out / "checkpoint.pt")
    assert saved["state"]["iteration"] == 3
    assert saved["state"]["global_step"] == 384


@pytest.mark.slow
def test_the_summary_counts_the_set_up_apart_from_training(monkeypatch, tmp_path):
    """What a session spends before its first iteration (building the pipeline; for a stage
    that chooses, compiling and timing its choices) is the summary's ``setup_s``, apart from
    the training time ``wall_s``, whose rate it would otherwise understate; a resumed session
    counts its own."""
    import time

    import labkit.app.train as train_module

    build = train_module.build_pipeline

    def slow_build(*args, **kwargs):
        time.sleep(0.5)
        return build(*args, **kwargs)

    monkeypatch.setattr(train_module, "build_pipeline", slow_build)
    out = tmp_path / "run"
    start = time.perf_counter()
    first = train(small_config(), out, progress=False, stop_after=1)
    elapsed = time.perf_counter() - start
    assert 0.5 <= first["setup_s"] and first["setup_s"] + first["wall_s"] <= elapsed
    start = time.perf_counter()
    resumed = train(None, out, resume=True, progress=False)  # wall_s: both sessions' training
    assert resumed["complete"] and 0.5 <= resumed["setup_s"] < time.perf_counter() - start


@pytest.mark.slow
def test_a_resume_told_to_stop_where_it_already_is_is_refused(tmp_path, capsys):
    """--stop-after at or before the checkpoint's iteration has nothing to train: one line and
    exit 2, the run untouched (it said the unfinished run "was complete" before)."""
    out = tmp_path / "run"
    train(small_config(), out, progress=False, stop_after=2)
    saved = [(out / name).read_bytes() for name in ("checkpoint.pt", "summary.json")]
    assert main(["train", "--resume", str(out), "--stop-after", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stop_after (2)" in err and "(2 of 6)" in err, err
    assert [(out / name).read_bytes() for name in ("checkpoint.pt", "summary.json")] == saved
    assert main(["train", "--resume", str(out), "--stop-after", "3", "--no-progress"]) == 0


def test_train_refuses_to_overwrite_a_run(reference_run):
    with pytest.raises(ValueError, match="already holds a run"):
        train(small_config(), reference_run, progress=False)


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("overrides", [
    {},
    pytest.param(dict(stage="batched_ops", value_head="popart"), marks=pytest.mark.slow),
    pytest.param(dict(stage="python_loop", total_steps=6 * 64, n_envs=4),
                 marks=pytest.mark.slow),
    pytest.param(dict(stage="numpy_vec"), marks=pytest.mark.slow),
])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, reference_run, overrides):
    cfg = small_config(**overrides)
    one_go = tmp_path / "one_go"
    if overrides:
        train(cfg, one_go, progress=False)
    else:
        one_go = reference_run
    split = tmp_path / "split"
    half = train(cfg, split, progress=False, stop_after=3)
    assert not half["complete"] and half["iterations"] == 3
    # Fresh process state: a new Pipeline is built and loaded from checkpoint.pt. Lines that a
    # crash after the checkpoint left behind (a later iteration, half a line) are dropped.
    with open(split / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 512, "iteration": 4}) + "\n" + '{"step": 6')
    torch.manual_seed(12345)  # the global RNG plays no part: the pipeline has its own
    summary = train(None, split, resume=True, progress=False)
    assert summary["complete"] and summary["steps"] == cfg.total_steps
    assert_same_state(checkpoint.load(one_go / "checkpoint.pt")["state"],
                      checkpoint.load(split / "checkpoint.pt")["state"])
    assert untimed(read_metrics(split)) == untimed(read_metrics(one_go))


@pytest.mark.slow
def test_fused_optimizer_state_restores_in_place(cpu):
    """Stage 7's fused Adam keeps its LR as a device tensor that compiled code and graphs hold:
    restore must write into it, not replace it. (Compile is off here: a CPU compile takes a
    minute; it does not change what is saved.)"""
    stage = dataclasses.replace(get_stage("fused_amp"), rollout_executor=Eager(),
                                update_executor=Eager())
    cfg = RunConfig(n_envs=8, n_steps=16, seed=2, spec=SPEC, value_head="popart",
                    lr_horizon=4)

    def pipeline() -> Pipeline:
        return Pipeline(stage, cfg, cpu)

    a = pipeline()
    for _ in range(2):
        a.iteration()
    saved = a.state_dict()
    for _ in range(2):
        a.iteration()
    b = pipeline()
    lr = b.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    b.load_state_dict(checkpoint.to_cpu(saved))
    assert b.optimizer.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(2.5e-4 * 3 / 4)  # annealed at the start of iteration 2
    for _ in range(2):
        b.iteration()
    assert_same_state(a.state_dict(), b.state_dict())
    a.close()
    b.close()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("stage", ["fused_amp", "cuda_graphs"])
def test_resume_is_bit_identical_on_cuda(tmp_path, stage):
    """Under ``deterministic()``, as a GPU user's bit-identical resume needs it (the
    cuda_graphs case once differed on the H200 with cuDNN alone made deterministic, among 6
    test processes and 8 chapters sharing the GPU; results/GPU-RUNS.md)."""
    if get_stage(stage).skip_reason(torch.device("cuda")):
        pytest.skip(get_stage(stage).skip_reason(torch.device("cuda")))
    # compile forced: each run timing eager against compiled could keep a different kind
    cfg = small_config(stage=stage, device="cuda", compile="compiled")
    with deterministic():
        train(cfg, tmp_path / "one_go", progress=False)
        train(cfg, tmp_path / "split", progress=False, stop_after=3)
        train(None, tmp_path / "split", resume=True, progress=False)
    assert_same_state(checkpoint.load(tmp_path / "one_go" / "checkpoint.pt")["state"],
                      checkpoint.load(tmp_path / "split" / "checkpoint.pt")["state"])


# ---------------------------------------------------------------- interrupts and crashes


def interrupt_at(monkeypatch, iteration: int) -> None:
    """Ctrl-C inside iteration ``iteration`` (1-based), after its rollout, before its update:
    env, generator and collector have moved on, so the torn state must not be saved."""
    learn = Pipeline.learn

    def learn_or_interrupt(self, batch):
        if self.iteration_index == iteration - 1:
            raise KeyboardInterrupt
        return learn(self, batch)

    monkeypatch.setattr(Pipeline, "learn", learn_or_interrupt)


@pytest.mark.slow
def test_ctrl_c_saves_the_last_finished_iteration_and_its_metrics(tmp_path, monkeypatch,
                                                                   reference_run):
    out = tmp_path / "run"
    interrupt_at(monkeypatch, 4)
    with pytest.raises(TrainingInterrupted) as exc:
        train(small_config(checkpoint_every=0), out, progress=False)
    assert exc.value.iteration == 3 and exc.value.checkpoint_path == out / "checkpoint.pt"
    assert checkpoint.load(out / "checkpoint.pt")["state"]["iteration"] == 3
    reference = untimed(read_metrics(reference_run))
    assert untimed(read_metrics(out)) == reference[:3]
    monkeypatch.undo()
    train(None, out, resume=True, progress=False)
    assert_same_state(checkpoint.load(reference_run / "checkpoint.pt")["state"],
                      checkpoint.load(out / "checkpoint.pt")["state"])
    assert untimed(read_metrics(out)) == reference


def test_cli_exits_130_on_ctrl_c(capsys, tmp_path, monkeypatch):
    interrupt_at(monkeypatch, 2)
    out = tmp_path / "run"
    rc = main(["train", "--stage", "async_logging", "--device", "cpu", "--n-envs", "8",
               "--n-steps", "16", "--total-steps", "512", "--out", str(out), "--no-progress"])
    assert rc == 130
    assert f"--resume {out}" in capsys.readouterr().err
    assert len(read_metrics(out)) == 1
    assert checkpoint.load(out / "checkpoint.pt")["state"]["iteration"] == 1


def test_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, reference_run):
    """The disk fills up while the new checkpoint is being written: the old one is intact and
    the torn temporary file is gone."""
    import labkit.files

    path = tmp_path / "checkpoint.pt"
    before = (reference_run / "checkpoint.pt").read_bytes()
    path.write_bytes(before)

    def fsync_fails(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(labkit.files.os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(path, {"state": {"iteration": 99}})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert checkpoint.load(path)["state"]["iteration"] == 6
    assert list(tmp_path.iterdir()) == [path]  # the torn temporary file was removed


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")
def test_kill_during_write_leaves_the_previous_checkpoint(tmp_path, reference_run):
    """A process killed after writing the new file but before renaming it over the old one
    (no cleanup can run)."""
    path = tmp_path / "checkpoint.pt"
    before = (reference_run / "checkpoint.pt").read_bytes()
    path.write_bytes(before)
    script = f"""
import os, signal, torch
import labkit.files
from labkit.app import checkpoint
def die(fd):
    os.kill(os.getpid(), signal.SIGKILL)
labkit.files.os.fsync = die
checkpoint.save({str(path)!r}, {{"state": {{"iteration": 99, "x": torch.zeros(10000)}}}})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [tmp] = tmp_path.glob(".checkpoint.pt.*.tmp")
    assert tmp.stat().st_size > 0  # the new file is there, beside it, under its own name
    assert path.read_bytes() == before
    assert checkpoint.load(path)["state"]["iteration"] == 6
    checkpoint.save(path, {"state": {"iteration": 7}})  # the next save is not disturbed by it
    assert checkpoint.load(path)["state"]["iteration"] == 7


def test_missing_or_corrupt_checkpoint_errors_name_the_path(tmp_path, reference_run, capsys):
    missing = tmp_path / "nowhere" / "checkpoint.pt"
    with pytest.raises(checkpoint.CheckpointError, match=f"no checkpoint at {missing}"):
        checkpoint.load(missing)
    corrupt = tmp_path / "corrupt" / "checkpoint.pt"
    corrupt.parent.mkdir()
    good = (reference_run / "checkpoint.pt").read_bytes()
    for data in (good[: len(good) // 2], b"not a checkpoint"):
        corrupt.write_bytes(data)
        with pytest.raises(checkpoint.CheckpointError, match=str(corrupt)):
            checkpoint.load(corrupt)
    torch.save({"something": "else"}, corrupt)
    with pytest.raises(checkpoint.CheckpointError, match="not a labkit checkpoint"):
        checkpoint.load(corrupt)
    assert main(["train", "--resume", str(corrupt.parent), "--no-progress"]) == 2
    assert str(corrupt) in capsys.readouterr().err


# ---------------------------------------------------------------- learning


# Budget measured on the 2-core CPU this was written on (CleanRL's PPO defaults, LR annealed
# over the run; `python -m labkit train --stage async_logging --device cpu --n-envs 64
# --n-steps 32 --total-steps 262144 --seed S`). Mean episode return at env steps (episodes end
# every 4th iteration, so every 16k steps):
#   seed 1: 16k 0.2, 32k 0.9, 49k 3.5, 65k 8.2, 98k 13.3, 131k 15.3, 163k 16.9, 196k 16.3,
#           229k 15.5, 262k 18.1; final (last 5 iterations) 17.1
#   seed 2: final 15.4 (13.8 at 131k);  seed 3: final 17.3 (14.8 at 131k)
# Oracle 24.8-26.3 (sample-dependent), random 0.5. So the threshold, half the oracle (~12.5-13),
# sits 2.4+ below the worst of three seeds, the margin a different CPU's float rounding needs;
# 204800 steps gave 14.6-15.9 (too close), N=64 x T=128 reached only 12.6 after 410k steps
# (fewer updates per step). 128 iterations take ~35 s at ~7.5-8.5k steps/s on 2 idle cores.
# Stage 4 (async_logging) runs the same PPO math as stage 7 (fused_amp) without the minute
# torch.compile needs on a CPU (fused_amp on seed 1: see the report).
@pytest.mark.slow
def test_training_reaches_half_the_oracle_on_cpu(tmp_path):
    cfg = TrainConfig.flat(stage="async_logging", device="cpu", n_envs=64, n_steps=32,
                           total_steps=262_144, seed=1, checkpoint_every=0)
    summary = train(cfg, tmp_path, progress=False)
    oracle = mean_return("oracle", n_envs=256, episodes=2, seed=1)
    random = mean_return("random", n_envs=256, episodes=2, seed=1)
    assert oracle > 20 * random
    records = read_metrics(tmp_path)
    assert len(records) == 128 and summary["steps"] == 262_144
    early = [r["mean_return"] for r in records[:8] if r["episodes"]]
    assert early and max(early) < 3 * random + 1  # it starts from a random policy
    assert summary["final_mean_return"] >= 0.5 * oracle, (summary, oracle)


def _count_judgements(monkeypatch) -> dict[str, int]:
    """Count the device resolutions of the run's path (``resolve_device`` in labkit.app and
    labkit.stages: the layers the architecture review counted; an env still checks its own
    ``device`` argument, as every component checks its input) and every ``Stage.check``."""
    import labkit.device
    from labkit.stages import Stage

    counts = {"resolve_device": 0, "Stage.check": 0}
    resolve, check = labkit.device.resolve_device, Stage.check

    def counted_resolve(*args, **kwargs):
        counts["resolve_device"] += 1
        return resolve(*args, **kwargs)

    def counted_check(self, *args, **kwargs):
        counts["Stage.check"] += 1
        return check(self, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith(("labkit.app", "labkit.stages")) \
                and getattr(module, "resolve_device", None) is resolve:
            monkeypatch.setattr(module, "resolve_device", counted_resolve)
    monkeypatch.setattr(Stage, "check", counted_check)
    return counts


@pytest.mark.parametrize("how", ["new", "resume", "cli"])
def test_a_run_is_judged_once(tmp_path, monkeypatch, how, capsys):
    """One door (labkit.app.run.open_run) judges a run: the device is resolved and the stage
    checked there, and once more by the Pipeline, which refuses bad input on its own; the CLI
    only maps its flags (4 stage checks and 5 device resolutions per run before)."""
    out = tmp_path / "run"
    if how == "resume":
        train(small_config(total_steps=2 * 128), out, progress=False, stop_after=1)
    counts = _count_judgements(monkeypatch)
    if how == "cli":
        assert main(["train", "--stage", "async_logging", "--device", "cpu", "--n-envs", "8",
                     "--n-steps", "16", "--total-steps", "256", "--out", str(out),
                     "--no-progress"]) == 0
    else:
        train(None if how == "resume" else small_config(total_steps=2 * 128), out,
              resume=how == "resume", progress=False)
    assert counts == {"resolve_device": 2, "Stage.check": 2}


# ---------------------------------------------------------------- a run that fails as it trains


def test_a_full_disk_during_training_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys,
                                                                           monkeypatch):
    real_save = checkpoint.save
    calls = []

    def save_or_fail(path, payload):
        calls.append(payload["state"]["iteration"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        return real_save(path, payload)

    monkeypatch.setattr(checkpoint, "save", save_or_fail)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *TINY, "--total-steps", "320", "--out", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert "No space left on device" in err and "state after iteration 1" in err
    assert checkpoint.load(out / "checkpoint.pt")["state"]["iteration"] == 1


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_resumes_from_its_start(tmp_path):
    out = tmp_path / "r"
    proc = start_training(out, "--total-steps", "640", "--checkpoint-every", "0",
                          script_prefix="import time, labkit.app.train as t\n"
                          "_it = t.Pipeline.iteration\n"
                          "def slow(self):\n    time.sleep(0.3)\n    return _it(self)\n"
                          "t.Pipeline.iteration = slow")
    wait_for(lambda: metrics_lines(out) >= 2, what="two iterations")
    proc.kill()
    proc.wait(timeout=60)
    assert not (out / "checkpoint.pt").exists() and (out / "config.json").exists()
    r = subprocess.run([sys.executable, "-m", "labkit", "train", "--resume", str(out),
                        "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["iteration"] for rec in records] == list(range(1, 11))


def test_a_run_folder_deleted_mid_run_is_said_so(tmp_path, monkeypatch):
    """C-deleted-folder-midrun: the line said the deleted checkpoint held the state."""
    out = tmp_path / "r"
    real = Pipeline.iteration
    calls = []

    def delete_the_folder(self):
        calls.append(1)
        if len(calls) == 3:
            shutil.rmtree(out)
        return real(self)

    monkeypatch.setattr(Pipeline, "iteration", delete_the_folder)
    with pytest.raises(TrainingFailed, match="was deleted, with its checkpoint") as err:
        train(tiny_config(total_steps=640), out, progress=False)
    assert "holds the state" not in str(err.value) and not out.exists()
    # the file by its name, not by its descriptor number ("the log file 5")
    assert f"the log file {out / 'metrics.jsonl'} was deleted" in str(err.value)


def test_a_deleted_run_folder_stops_training(tmp_path, monkeypatch):
    out = tmp_path / "r"
    iteration = Pipeline.iteration

    def delete_then_iterate(self):
        if self.iteration_index == 1:
            (out / "metrics.jsonl").unlink()
        return iteration(self)

    monkeypatch.setattr(Pipeline, "iteration", delete_then_iterate)
    with pytest.raises(TrainingFailed, match="was deleted"):
        train(tiny_config(total_steps=320), out, progress=False)


def test_a_run_whose_lock_is_deleted_stops_before_its_next_save(tmp_path, monkeypatch, capsys):
    """A second `--resume` after `.lock` was deleted would lock a new file and train the same
    run alongside: the run notices at its next checkpoint and stops with one line."""
    from labkit.app import checkpoint as ckpt
    monkeypatch.chdir(tmp_path)
    original = ckpt.save

    def save_then_delete_the_lock(path, payload):
        original(path, payload)
        (Path(path).parent / FolderLock.NAME).unlink(missing_ok=True)

    monkeypatch.setattr(ckpt, "save", save_then_delete_the_lock)
    code, _, err = run_cli(["train", *TINY, "--out", "run"], capsys)
    assert code == 2 and "was deleted while this run held it" in err, err
    assert err.count("\n") == 1, err


def poison_the_weights_before_iteration_3(monkeypatch) -> None:
    """Every pipeline's actor weights become NaN when its third iteration starts."""
    iteration = Pipeline.iteration

    def poisoned(self):
        if self.iteration_index == 2:
            with torch.no_grad():
                self.agent.actor.weight.fill_(math.nan)
        return iteration(self)

    monkeypatch.setattr(Pipeline, "iteration", poisoned)


def test_training_stops_when_the_loss_becomes_non_finite(tmp_path, monkeypatch):
    poison_the_weights_before_iteration_3(monkeypatch)
    out = tmp_path / "r"
    with pytest.raises(TrainingFailed, match="non-finite .* in iteration 3.*after iteration 2"):
        train(tiny_config(total_steps=320, checkpoint_every=0), out, progress=False)
    saved = checkpoint.check(checkpoint.load(out / "checkpoint.pt"), out)
    assert saved["state"]["iteration"] == 2  # the last finite state, and it loads


def test_debug_checks_in_training_name_the_point_and_keep_the_last_good_state(
        tmp_path, monkeypatch, capsys):
    poison_the_weights_before_iteration_3(monkeypatch)
    out = tmp_path / "r"
    assert main(["train", *TINY, "--total-steps", "320", "--checkpoint-every", "0", "--debug",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert re.fullmatch(r"error: debug checks: logits is not finite at step \d+ .* in "
                        r"iteration 3; stopped\. .* after iteration 2", err), err
    assert checkpoint.load(out / "checkpoint.pt")["state"]["iteration"] == 2
    assert not debug.enabled()  # switched off again after the run
