"""No lost work, no tracebacks for user errors, one run per folder (one test per defect of the
reliability issue, and a table of bad CLI inputs)."""
from __future__ import annotations

import gc
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from labkit import debug
from labkit.app import checkpoint
from labkit.app.cli import main
from labkit.app.train import TrainConfig, TrainingFailed, train
from labkit.config import BenchConfig, RunConfig
from labkit.envs.spec import ForageSpec
from labkit.files import FolderLock, OutputError, check_output_dir, unique_folder, write_json
from labkit.logging import AsyncLogger, SyncLogger
from labkit.ppo import PPOConfig
from labkit.stages import Pipeline, get_stage

ROOT = Path(__file__).parents[1]
SPEC = ForageSpec(episode_length=20)
# 2 iterations of 4 envs x 16 steps: a complete run in about a second.
TINY = ["--stage", "async_logging", "--device", "cpu", "--n-envs", "4", "--n-steps", "16",
        "--total-steps", "128", "--checkpoint-every", "1", "--no-progress"]


def tiny_config(**overrides) -> TrainConfig:
    kwargs = dict(stage="async_logging", device="cpu", n_envs=4, n_steps=16, total_steps=128,
                  seed=3, checkpoint_every=1, spec=SPEC)
    return TrainConfig.flat(**{**kwargs, **overrides})


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and a hash of its bytes (the lock file is not data)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != FolderLock.NAME}


def lengthen(run: Path, total_steps: int) -> None:
    """Make ``run`` a longer run, in its checkpoint and its config.json alike (a resume refuses
    a config.json that disagrees with its checkpoint)."""
    rewrite_checkpoint(run / "checkpoint.pt",
                       lambda p: p["config"].update(total_steps=total_steps))
    cfg = json.loads((run / "config.json").read_text())
    cfg["total_steps"] = total_steps
    (run / "config.json").write_text(json.dumps(cfg))


def rewrite_checkpoint(path: Path, edit) -> None:
    payload = checkpoint.load(path)
    edit(payload)
    payload.pop("format")
    checkpoint.save(path, payload)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    train(tiny_config(), out, progress=False)
    return out


@pytest.fixture
def copy_of(finished_run, tmp_path):
    def make(name: str = "run") -> Path:
        dst = tmp_path / name
        shutil.copytree(finished_run, dst)
        (dst / ".lock").unlink(missing_ok=True)
        return dst
    return make


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def start_training(out: Path, *extra: str, script_prefix: str = "") -> subprocess.Popen:
    """A long training run in a real process (4 envs x 16 steps per iteration)."""
    code = (f"{script_prefix}\nimport sys\nfrom labkit.app.cli import main\n"
            f"sys.exit(main(sys.argv[1:]))")
    argv = ["--stage", "async_logging", "--device", "cpu", "--n-envs", "4", "--n-steps", "16",
            "--total-steps", "640000", "--no-progress", "--out", str(out), *extra]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a hang can be made to say where it is
    return subprocess.Popen([sys.executable, "-c", code, "train", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[str, str]:
    """``proc.communicate()``; a process still running after ``timeout`` is a hang: it is
    aborted, so that Python's fault handler prints every thread's stack, and the test fails
    with those stacks."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"no exit {timeout:.0f} s after the signal; its threads:\n{err[-40000:]}")


def wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def metrics_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


# ---------------------------------------------------------------- 1. file-system errors


@pytest.mark.parametrize("kind", ["file", "under_a_file", "proc"])
def test_unusable_out_is_one_line_exit_2_before_any_work(tmp_path, capsys, kind):
    target = {"file": tmp_path / "f", "under_a_file": tmp_path / "f" / "sub",
              "proc": Path("/proc/labkit-x")}[kind]
    (tmp_path / "f").write_text("not a folder")
    before = snapshot(tmp_path)
    for argv in (["train", *TINY, "--out", str(target)],
                 ["ladder", "--device", "cpu", "--stages", "3", "--no-progress",
                  "--out", str(target)],
                 ["bench-env", "--repeats", "1", "--out", str(target)]):
        start = time.perf_counter()
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and out == "", argv
        assert err.count("\n") == 1 and err.startswith("error: ") and str(target) in err
        assert time.perf_counter() - start < 5  # refused before the benchmark ran
    assert snapshot(tmp_path) == before


def test_a_refused_command_creates_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("f").write_text("not a folder")
    for argv, needle in ((["train", *TINY, "--tensorboard", "f", "--out", "new"], "--tensorboard"),
                         (["profile", "--device", "cpu", "--stage", "cuda_graphs",
                           "--out", "new"], "needs CUDA"),
                         (["report", "--results", "new"], "--results")):
        code, out, err = run_cli(argv, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, argv
        assert sorted(os.listdir(".")) == ["f"], argv


def test_plot_runs_on_a_missing_folder_is_a_clear_error(tmp_path, capsys):
    code, _, err = run_cli(["plot-runs", str(tmp_path / "nope"), "--out",
                            str(tmp_path / "x.png")], capsys)
    assert code == 2 and "not a train run folder" in err and err.count("\n") == 1


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


# ---------------------------------------------------------------- 2. a stuck run folder


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


def test_files_written_atomically_get_the_permissions_of_any_new_file(tmp_path, monkeypatch):
    """mkstemp makes owner-only files: a checkpoint a teammate cannot read is work lost too."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--out", "run"]) == 0
    Path("plain").write_text("")
    expected = Path("plain").stat().st_mode & 0o777
    modes = {p.name: p.stat().st_mode & 0o777 for p in Path("run").iterdir() if p.is_file()}
    assert {"checkpoint.pt", "config.json", "summary.json"} <= set(modes)
    assert set(modes.values()) == {expected}, modes
    os.chmod("run/summary.json", 0o640)  # a rewrite keeps the permissions it finds
    write_json("run/summary.json", {"rewritten": True})
    assert Path("run/summary.json").stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------- 3. and 4. signals


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_and_exit_128_plus_signal(tmp_path, sig):
    # Once in CI (2026-11-25, a fresh clone) a run did not exit within 120 s of SIGTERM; not
    # reproduced in 25 runs here. A first hang is shown with every thread's stack and tried
    # again in a new folder; a second one fails.
    for attempt in (1, 2):
        out = tmp_path / f"r{attempt}"
        proc = start_training(out, "--checkpoint-every", "0")
        wait_for(lambda out=out: metrics_lines(out) >= 2, what="two iterations")
        proc.send_signal(sig)
        try:
            _, err = finish(proc)
            break
        except pytest.fail.Exception as hang:
            if attempt == 2:
                raise
            warnings.warn(f"a stopped run hung; once more: {hang}", stacklevel=1)
    assert proc.returncode == 128 + sig, err
    assert f"interrupted by {signal.Signals(sig).name}" in err and "--resume" in err
    saved = checkpoint.load(out / "checkpoint.pt")["state"]["iteration"]
    # the state of the last finished iteration (its metrics line may be one ahead of it)
    assert saved >= 1 and metrics_lines(out) in (saved, saved + 1)


def slow_save_prefix(marker: Path) -> str:
    """Script lines that make every checkpoint save touch ``marker`` and take 1.5 s."""
    return ("import time, pathlib, labkit.app.checkpoint as c\n_save = c.save\n"
            "def slow_save(path, payload):\n"
            f"    pathlib.Path({str(marker)!r}).touch()\n"
            "    time.sleep(1.5)\n    return _save(path, payload)\nc.save = slow_save")


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_save_does_not_lose_it(tmp_path):
    out = tmp_path / "r"
    marker = tmp_path / "saving"
    prefix = slow_save_prefix(marker)
    proc = start_training(out, "--checkpoint-every", "0", script_prefix=prefix)
    wait_for(lambda: metrics_lines(out) >= 2, what="two iterations")
    proc.send_signal(signal.SIGINT)
    wait_for(marker.exists, what="the save to start")
    proc.send_signal(signal.SIGINT)  # while saving
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "nothing saved" not in err and "interrupted by SIGINT" in err
    iteration = checkpoint.load(out / "checkpoint.pt")["state"]["iteration"]
    assert f"state after iteration {iteration}" in err and iteration >= 1


@pytest.mark.slow
def test_a_stop_during_a_periodic_save_stops_training_after_it(tmp_path):
    out = tmp_path / "r"
    marker = tmp_path / "saving"
    prefix = slow_save_prefix(marker)
    proc = start_training(out, "--checkpoint-every", "1", script_prefix=prefix)
    wait_for(marker.exists, what="the first periodic save")
    proc.send_signal(signal.SIGTERM)  # while saving iteration 1
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    iteration = checkpoint.load(out / "checkpoint.pt")["state"]["iteration"]
    assert iteration == 1 and metrics_lines(out) == 1  # it did not train on


def signal_on_call(monkeypatch, owner, name: str, sig: int, call: int = 1,
                   swallow: bool = False) -> list:
    """Make the ``call``-th call of ``owner.name`` send ``sig`` to this process first (a real
    signal, handled by whatever handler is installed); ``swallow``: catch the stop it raises,
    as code that clears every error does (torch.compile's guards)."""
    real, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            try:
                signal.raise_signal(sig)
            except KeyboardInterrupt:
                if not swallow:
                    raise
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def test_a_stop_that_something_swallows_is_never_lost(tmp_path, monkeypatch, capsys):
    """C-SIGINT-ignored-once: a torch.compile guard whose Python check raises is cleared and
    counted as failed, so a Ctrl-C landing in one vanished and the run trained to its end.
    The stop is remembered and taken at the end of the iteration it landed in."""
    calls = signal_on_call(monkeypatch, Pipeline, "iteration", signal.SIGINT, call=3,
                           swallow=True)
    out = tmp_path / "r"
    code, _, err = run_cli(["train", *TINY[:-3], "--total-steps", "640", "--checkpoint-every",
                            "0", "--no-progress", "--out", str(out)], capsys)
    assert code == 130 and "interrupted by SIGINT" in err and "--resume" in err, err
    assert len(calls) == 3 and metrics_lines(out) == 3
    assert checkpoint.load(out / "checkpoint.pt")["state"]["iteration"] == 3


def test_raise_if_stopped_raises_only_a_stop_caught_in_its_block():
    from labkit.signals import Stop, raise_if_stopped, stop_signals

    raise_if_stopped()  # outside any block: nothing
    with stop_signals():
        raise_if_stopped()
        with pytest.raises(Stop):
            signal.raise_signal(signal.SIGHUP)
        with pytest.raises(Stop) as stop:
            raise_if_stopped()
        assert stop.value.signum == signal.SIGHUP
        with stop_signals():
            raise_if_stopped()  # an inner block caught nothing
    raise_if_stopped()


def test_a_stop_while_the_pipeline_builds_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """C-sigint-during-build-message, C-startup-SIGTERM-1.0s: config.json is written, so the
    same command again is refused; the stop says so and gives the --resume hint."""
    import labkit.app.train

    signal_on_call(monkeypatch, labkit.app.train, "build_pipeline", signal.SIGTERM)
    out = tmp_path / "r"
    argv = ["train", *TINY, "--out", str(out)]
    code, _, err = run_cli(argv, capsys)
    assert code == 143 and "SIGTERM before training started" in err
    assert "holds the run's config" in err and f"--resume {out}" in err
    assert (out / "config.json").exists() and not (out / "checkpoint.pt").exists()
    monkeypatch.undo()
    assert run_cli(argv, capsys)[0] == 2  # the folder holds the run
    code, stdout, _ = run_cli(["train", "--resume", str(out), "--no-progress"], capsys)
    assert code == 0 and "trained 128 steps" in stdout


def _bench_env(tmp_path):
    return ["bench-env", "--device", "cpu", "--n-envs", "64", "--repeats", "3", "--out",
            str(tmp_path)]


@pytest.mark.parametrize("case", ["bench-env-round-2", "bench-env-round-1", "doctor",
                                  "profile",
                                  pytest.param("ladder-figures", marks=pytest.mark.slow)])
def test_every_command_stops_alike_on_a_signal(tmp_path, monkeypatch, capsys, case):
    """bench-env, doctor, profile and ladder (also while writing figures): one line, exit
    128 + the signal, and what finished is kept (C-bench-env-SIGTERM, C-doctor-SIGTERM,
    C-profile-SIGHUP, C-ladder-SIGTERM-while-saving-figures)."""
    import labkit.book.plots
    import labkit.measure.envbench

    sig = signal.SIGHUP if case == "profile" else signal.SIGTERM
    if case.startswith("bench-env"):  # 4 implementations per round
        call = 6 if case.endswith("2") else 2
        signal_on_call(monkeypatch, labkit.measure.envbench, "timed", sig, call=call)
        argv = _bench_env(tmp_path)
    elif case == "ladder-figures":
        signal_on_call(monkeypatch, labkit.book.plots, "save_figures", sig)
        argv = ["ladder", "--device", "cpu", "--stages", "3", "--n-envs", "4", "--n-steps",
                "8", "--iterations", "2", "--no-scaling", "--no-progress", "--out",
                str(tmp_path)]
    else:
        signal_on_call(monkeypatch, Pipeline, "iteration", sig, call=2)
        argv = {"doctor": ["doctor", "--device", "cpu", "--stage", "4", "--iterations", "5"],
                "profile": ["profile", "--device", "cpu", "--stage", "4", "--n-envs", "8",
                            "--n-steps", "16", "--out", str(tmp_path)]}[case]
    code, _, err = run_cli(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 128 + sig and len(lines) == 1, err
    assert f"interrupted by {signal.Signals(sig).name}" in lines[0]
    files = sorted(p.name for p in tmp_path.iterdir())
    if case == "bench-env-round-2":
        assert files == ["bench_env_cpu_partial.json"] and "1 round(s)" in lines[0]
        result = json.loads((tmp_path / files[0]).read_text())
        assert result["interrupted"] == "SIGTERM" and result["repeats"] == 1
        assert all(len(r["samples_s"]) == 1 for r in result["rows"])
    elif case == "ladder-figures":  # the stop waited for the figures (no scaling: no sweep)
        assert files == ["ladder_cpu_quick.json", "ladder_cpu_quick_ladder.png",
                         "ladder_cpu_quick_learning.png", "ladder_cpu_quick_phases.png"]
        assert "while writing the results; they are all written" in lines[0]
    else:
        assert files == [] and "stopped" in lines[0]


# ---------------------------------------------------------------- 5. one run per folder


@pytest.mark.slow
def test_a_second_process_cannot_write_to_a_folder_in_use(tmp_path, capsys):
    out = tmp_path / "r"
    proc = start_training(out, "--checkpoint-every", "1")
    try:
        wait_for(lambda: metrics_lines(out) >= 1, what="one iteration")
        for argv in (["train", *TINY, "--out", str(out)],
                     ["train", "--resume", str(out), "--no-progress"]):
            code, _, err = run_cli(argv, capsys)
            assert code == 2 and "in use by another labkit process" in err, argv
            assert f"pid {proc.pid}" in err
        assert proc.poll() is None  # the first run was not disturbed
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    with FolderLock(out):  # released when its holder exits
        pass


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folders = {unique_folder("runs/train-%Y%m%d-%H%M") for _ in range(3)}
    assert len(folders) == 3 and all(f.is_dir() for f in folders)


# ---------------------------------------------------------------- 6. damaged metrics


def test_a_bad_line_in_the_middle_of_the_metrics_stops_resume(copy_of, capsys):
    run = copy_of()
    # make the run unfinished (4 iterations, 2 done) so that resuming reads its metrics
    lengthen(run, 256)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(lines[0][:10] + "\n" + "\n".join(lines[1:]) + "\n")
    before = snapshot(run)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and "metrics.jsonl line 1 is not valid JSON" in err
    assert snapshot(run) == before  # nothing dropped


def _unfinished_copy(copy_of) -> Path:
    """A copy of the finished run made unfinished (4 iterations, 2 done), so that resuming
    reads its metrics."""
    run = copy_of()
    lengthen(run, 256)
    (run / "summary.json").unlink()
    return run


@pytest.mark.parametrize("damage, needle", [
    ("duplicate", "metrics.jsonl line 2 repeats iteration 1"),
    ("gap", "metrics.jsonl line 1 skips from iteration 0 to 2"),
    ("short", "metrics.jsonl ends at iteration 1, but the checkpoint holds iteration 2"),
    ("metrics-folder", "metrics.jsonl is a folder"),
    ("lock-folder", ".lock is a folder"),
    ("config-folder", "config.json is a folder"),
])
def test_a_damaged_run_folder_is_refused_naming_the_file(copy_of, capsys, damage, needle):
    """C-metrics-duplicate-record, C-metrics-missing-record, C-metrics-is-directory,
    C-lock-is-directory: one line naming the file, exit 2, the folder untouched."""
    run = _unfinished_copy(copy_of)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    edits = {"duplicate": lambda: [lines[0], *lines], "gap": lambda: lines[1:],
             "short": lambda: lines[:1]}
    if damage in edits:
        (run / "metrics.jsonl").write_text("\n".join(edits[damage]()) + "\n")
    else:
        name = {"metrics-folder": "metrics.jsonl", "lock-folder": ".lock",
                "config-folder": "config.json"}[damage]
        (run / name).unlink(missing_ok=True)
        (run / name).mkdir()
    before = snapshot(run)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert snapshot(run) == before


def test_a_read_only_folder_is_refused_naming_the_flag_given(copy_of, capsys, monkeypatch):
    """C-resume-readonly-folder: the user gave --resume, so the message names --resume."""
    import errno

    import labkit.files

    run = _unfinished_copy(copy_of)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(labkit.files.tempfile, "mkstemp", read_only)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and f"--resume {run}: cannot write there (Read-only file system)" in err
    # A-report-readonly: refused up front naming --results (it named a temporary file, exit 1)
    results = run.parent / "results"
    results.mkdir()
    code, _, err = run_cli(["report", "--results", str(results)], capsys)
    assert code == 2 and f"--results {results}: cannot write there" in err
    assert list(results.iterdir()) == []


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


def test_a_trace_the_profiler_could_not_write_is_named(tmp_path, monkeypatch, capsys):
    """C-diskfull-profile: torch's trace export fails silently on a full disk (no file, or a
    cut one), and the error named a file labkit then failed to read. Now: the trace's path and
    the cause, exit 1, no leftovers."""
    import labkit.measure.profiling as profiling

    def full_disk_export(self, path):
        Path(f"{path}.tmp").write_text("")  # what the export leaves on a full disk

    monkeypatch.setattr(profiling.profile, "export_chrome_trace", full_disk_export)
    monkeypatch.setattr(profiling.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(
        1 << 30, 1 << 30, 4096))
    argv = ["profile", "--device", "cpu", "--stage", "3", "--n-envs", "8", "--n-steps", "16",
            "--out", str(tmp_path)]
    code, _, err = run_cli(argv, capsys)
    trace = tmp_path / "batched_ops_cpu.pt.trace.json"
    assert code == 1 and err == f"error: No space left on device {trace}\n"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- 7. and 8. the ladder


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


# ---------------------------------------------------------------- 9. and 10. checkpoints


@pytest.mark.parametrize("edit, needle", [
    (lambda p: p.pop("device"), "field 'device' is missing"),
    (lambda p: p["state"].pop("optimizer"), "field 'state.optimizer' is missing"),
    (lambda p: p.update(device="tpu:0"), "field 'device' is not a device"),
    (lambda p: p["config"]["run"].update(value_head="popart"), "does not fit its config"),
    (lambda p: p["config"]["run"]["spec"].update(view=9), "does not fit its config"),
    (lambda p: p["config"]["run"].update(n_envs="four"), "config is not valid"),
    (lambda p: p["state"].update(iteration=99, global_step=99 * 64), "state.iteration"),
    (lambda p: p["state"].update(iteration=-1), "state.iteration"),
    (lambda p: p["state"]["agent"]["actor.weight"].fill_(math.nan),
     "'state.agent.actor.weight' holds non-finite"),
])
def test_checkpoint_contents_are_validated(copy_of, capsys, edit, needle):
    run = copy_of()
    rewrite_checkpoint(run / "checkpoint.pt",
                       lambda p: (p["config"].update(total_steps=256), edit(p)))
    # config.json agrees with the edited config: what is tested is the state against it.
    edited = checkpoint.load(run / "checkpoint.pt")["config"]
    (run / "config.json").write_text(json.dumps(edited))
    before = snapshot(run)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert str(run / "checkpoint.pt") in err or "config" in err
    assert needle in err
    assert snapshot(run) == before


@pytest.mark.parametrize("field, edit", [
    ("run.seed", lambda c: c["run"].update(seed=4)),
    ("run.n_envs", lambda c: c["run"].update(n_envs=8)),
    ("run.spec.episode_length", lambda c: c["run"]["spec"].update(episode_length=30)),
    ("run.ppo.clip_coef", lambda c: c["run"]["ppo"].update(clip_coef=0.3)),
    ("stage", lambda c: c.update(stage="gpu_metrics")),
])
def test_a_checkpoint_of_another_run_is_refused(copy_of, capsys, field, edit):
    """A checkpoint copied into another run's folder would continue that run with the other
    run's model, mixing two runs' metrics: refused, naming the field that differs."""
    run = copy_of()
    config = json.loads((run / "config.json").read_text())
    edit(config)
    (run / "config.json").write_text(json.dumps(config))
    before = snapshot(run)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run / 'checkpoint.pt'} belongs to another run: its {field} is" in err
    assert snapshot(run) == before


def test_a_checkpoint_with_a_longer_run_still_resumes(copy_of, capsys):
    """The run's length is not what makes it another run: a longer total resumes, where the
    checkpoint and config.json agree on it; a config.json edited alone is refused, not
    silently ignored."""
    run = copy_of()
    lengthen(run, 192)
    summary = train(None, run, resume=True, progress=False)
    assert summary["complete"] and summary["iterations"] == 3
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "total_steps": 256}))
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "config.json says total_steps 256, but the run in" in err and "has 192" in err, err


def test_stale_temporary_checkpoints_are_removed_on_the_next_start(copy_of):
    """A kill during an atomic write leaves its temporary file (a whole checkpoint); the next
    start in that folder, holding its lock, removes them and nothing else."""
    run = copy_of()
    lengthen(run, 192)
    stale = [run / ".checkpoint.pt.k1ll3d.tmp", run / ".summary.json.abc.tmp"]
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    (run / "notes.tmp").write_text("the user's")
    train(None, run, resume=True, progress=False)
    assert not any(path.exists() for path in stale) and (run / "notes.tmp").exists()


@pytest.mark.parametrize("argv, needle", [
    (["train", "--n-envs", "1", "--n-steps", "4", "--total-steps", "8"], "n_minibatches=4 "
     "leaves one sample per minibatch"),
    (["bench-env", "--repeats", "99999999999999999999"], "--repeats: expected an integer in "
     "[1, 1,000]"),
    (["profile", "--iterations", "101"], "--iterations: expected an integer in [1, 100]"),
    (["doctor", "--iterations", "99999999999999999999"], "--iterations: expected an integer "
     "in [2, 10,000]"),
    (["rehearse", "--iterations", "10001"], "--iterations: expected an integer in [1, 10,000]"),
])
def test_work_a_typo_makes_huge_or_impossible_is_refused_first(tmp_path, capsys, argv, needle):
    out = ["--out", str(tmp_path / "o")] if argv[0] in ("train", "bench-env", "profile") else []
    try:
        code = main([*argv, *out])
    except SystemExit as stop:  # argparse's refusals
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_a_complete_run_without_its_summary_gets_it_back(copy_of, capsys):
    """A full disk, a stop or a crash at the very end leaves a finished run without
    summary.json: --resume writes it from the final checkpoint and the metrics."""
    run = copy_of()
    original = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    before = snapshot(run)
    code, out, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 0 and not err and "without its summary; wrote" in out, (out, err)
    restored = json.loads((run / "summary.json").read_text())
    for key in ("complete", "iterations", "steps", "param_checksums", "final_mean_return",
                "config"):
        assert restored[key] == original[key], key
    assert {k: v for k, v in snapshot(run).items() if k != "summary.json"} == before
    code, out, _ = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 0 and "already complete" in out


def test_a_summary_that_cannot_be_written_says_what_is_safe(copy_of, capsys, monkeypatch):
    import errno

    from labkit.app import run as run_module

    def full_disk(path, data):
        if Path(path).name == "summary.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_json(path, data)

    run = copy_of()
    (run / "summary.json").unlink()
    monkeypatch.setattr(run_module, "write_json", full_disk)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"could not write {run / 'summary.json'}" in err and "No space left" in err
    assert f"safe in {run / 'checkpoint.pt'}" in err and "--resume" in err


def test_a_flipped_byte_is_caught_by_the_checksum(copy_of, capsys):
    run = copy_of()
    data = bytearray((run / "checkpoint.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (run / "checkpoint.pt").write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load(run / "checkpoint.pt")
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and "corrupt" in err


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


# ---------------------------------------------------------------- 11. a finished run


def test_resuming_a_finished_run_changes_nothing(copy_of, capsys):
    run = copy_of()
    before = snapshot(run)
    code, out, _ = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 0 and "already complete" in out
    assert snapshot(run) == before
    summary = json.loads((run / "summary.json").read_text())  # standard JSON: no bare NaN
    assert "NaN" not in (run / "summary.json").read_text()
    assert summary["complete"] and summary["steps"] == 128


# ---------------------------------------------------------------- 12. memory across builds


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["compile_warmup", "fused_amp"])
def test_rebuilding_compiled_pipelines_does_not_grow_memory(stage, tiny_run):
    """Building a pipeline used to reset dynamo and compile afresh each time (memory grew with
    every rebuild); compiled code is now shared by every pipeline of the same shapes."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    rss = []
    for _ in range(10):
        with Pipeline(stage, tiny_run, "cpu") as p:
            p.iteration()
        del p
        gc.collect()
        rss.append(proc.memory_info().rss)
    assert (rss[-1] - rss[3]) / 6 < 0.5 * 2**20, [r / 2**20 for r in rss]


# ---------------------------------------------------------------- 13. API edges


def test_api_edges_give_clear_errors(tiny_run):
    with Pipeline(get_stage(7), tiny_run, "cpu") as p:
        assert p.device.type == "cpu"
    with Pipeline(3, tiny_run, "cpu") as p:
        assert p.stage.name == "batched_ops"
    with pytest.raises(ValueError, match="stage must be one of"):
        get_stage(True)
    with pytest.raises(TypeError, match="stage_timeout_s"):
        BenchConfig(stage_timeout_s="10")
    with pytest.raises(ValueError, match="stage_timeout_s"):
        BenchConfig(stage_timeout_s=math.nan)
    with pytest.raises(TypeError, match="max_queue"):
        AsyncLogger(io.StringIO(), max_queue="5")
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="lr"):
            PPOConfig(lr=value)
    with pytest.raises(ValueError, match="needs about .* GiB on cpu"):
        Pipeline(3, RunConfig(n_envs=2**24, n_steps=32), "cpu")


# ---------------------------------------------------------------- 14. the logger


class FlushFails(io.StringIO):
    def __init__(self, ok_flushes: int) -> None:
        super().__init__()
        self.ok = ok_flushes

    def flush(self) -> None:
        if self.ok == 0:
            raise OSError(28, "No space left on device")
        self.ok -= 1
        super().flush()


def test_a_writer_error_surfaces_at_the_next_log():
    logger = AsyncLogger(FlushFails(ok_flushes=3))
    for i in range(4):
        logger.log(i, x=i)
    wait_for(lambda: logger._writer.error is not None, 10, "the writer to fail")
    with pytest.raises(RuntimeError, match="No space left"):
        logger.log(4, x=4)


@pytest.mark.slow
def test_a_dropped_logger_reports_its_error_on_stderr(tmp_path):
    script = ("import io\nfrom labkit.logging import AsyncLogger\n"
              "class Bad(io.StringIO):\n"
              "    def write(self, s):\n        raise OSError('disk full')\n"
              "logger = AsyncLogger(Bad())\nlogger.log(1, x=1)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "AsyncLogger writer failed" in r.stderr
    assert "disk full" in r.stderr


@pytest.mark.parametrize("cls", [SyncLogger, AsyncLogger])
def test_a_deleted_log_folder_is_noticed(tmp_path, cls):
    folder = tmp_path / "logs"
    logger = cls(folder / "steps.jsonl")
    logger.log(0, x=1)
    logger.flush()
    shutil.rmtree(folder)
    with pytest.raises((RuntimeError, FileNotFoundError), match="was deleted"):
        for i in range(1, 1000):
            logger.log(i, x=i)
            logger.flush()
    logger.close()


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


# ---------------------------------------------------------------- bad CLI inputs, a table

NO_CUDA = not torch.cuda.is_available()


BAD_TRAIN = [
    (["--n-envs", "0"], "--n-envs"), (["--n-envs", "-3"], "--n-envs"),
    (["--n-envs", "abc"], "--n-envs"), (["--n-envs", "1.5"], "--n-envs"),
    (["--n-steps", "0"], "--n-steps"), (["--n-steps", "x"], "--n-steps"),
    (["--total-steps", "0"], "--total-steps"), (["--total-steps", "10"], "total_steps"),
    (["--seed", "-1"], "--seed"), (["--seed", "4294967296"], "seed"),
    (["--seed", "abc"], "--seed"), (["--stage", "9"], "--stage"),
    (["--stage", "warp"], "--stage"), (["--stage", ""], "--stage"),
    (["--stage", "-1"], "--stage"), (["--device", "tpu"], "device"),
    (["--device", ""], "device"), (["--device", "cuda:99"], "CUDA"),
    (["--value-head", "gaussian"], "--value-head"), (["--compile", "yes"], "--compile"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--checkpoint-every", "x"], "--checkpoint-every"),
    (["--n-envs", "3", "--n-steps", "3"], "n_minibatches"),
    (["--n-envs", "16777216", "--total-steps", "10000000000000"], "needs about"),
    (["--n-envs", "16777217"], "n_envs"),
    (["--bogus"], "unrecognized arguments"), (["--n-envs"], "--n-envs"),
]
if NO_CUDA:
    BAD_TRAIN.append((["--stage", "cuda_graphs"], "cuda_graphs"))

BAD_LADDER = [
    (["--n-envs", "0"], "--n-envs"), (["--n-steps", "0"], "--n-steps"),
    (["--iterations", "1"], "--iterations"), (["--iterations", "x"], "--iterations"),
    (["--stages", ""], "--stages"), (["--stages", ","], "--stages"),
    (["--stages", "0,warp"], "--stages"), (["--stages", "9"], "--stages"),
    (["--profile", "medium"], "--profile"), (["--device", "tpu"], "device"),
    (["--compile", "always"], "--compile"), (["--scaling-n-envs", "0"], "--scaling-n-envs"),
    (["--scaling-n-envs", "x"], "--scaling-n-envs"),
    (["--n-envs", "8", "--n-steps", "2", "--scaling-n-envs", "1"], "n_minibatches"),
    (["--n-envs", "3", "--n-steps", "3"], "n_minibatches"),
    (["--n-envs", "16777216"], "needs about"), (["--n-envs", "16777217"], "n_envs"),
]
if NO_CUDA:
    BAD_LADDER.append((["--device", "cuda"], "CUDA is not available"))

BAD_BENCH_ENV = [
    (["--repeats", "0"], "--repeats"), (["--repeats", "x"], "--repeats"),
    (["--device", "tpu"], "device"), (["--device", "cuda:x"], "device"),
]


def _cases():
    cases = [(["train", *TINY[:6], *argv, "--out", "OUT"], needle)
             for argv, needle in BAD_TRAIN]
    cases += [(["ladder", "--device", "cpu", "--no-progress", *argv, "--out", "OUT"], needle)
              for argv, needle in BAD_LADDER]
    cases += [(["bench-env", *argv, "--out", "OUT"], needle) for argv, needle in BAD_BENCH_ENV]
    cases += [
        (["train", *TINY, "--out", "FILE"], "exists and is not a folder"),
        (["train", *TINY, "--out", "FILE/sub"], "cannot write there"),
        (["train", *TINY, "--out", "/proc/labkit-x"], "cannot write there"),
        (["ladder", "--device", "cpu", "--out", "FILE"], "exists and is not a folder"),
        (["ladder", "--device", "cpu", "--out", "/proc/labkit-x"], "cannot write there"),
        (["ladder", "--device", "cpu", "--out", "JSONDIR"], "is a folder"),
        (["bench-env", "--out", "FILE"], "exists and is not a folder"),
        (["bench-env", "--out", "/proc/labkit-x"], "cannot write there"),
        (["train", "--resume", "MISSING"], "no such run folder"),
        (["train", "--resume", "EMPTY"], "no run to resume"),
        (["train", "--resume", "RUN", "--n-envs", "8"], "--n-envs"),
        (["train", "--resume", "RUN", "--out", "EMPTY"], "--resume continues"),
        (["train", *TINY, "--out", "RUN"], "already holds a run"),
        (["plot-runs", "MISSING"], "not a train run folder"),
        (["plot-runs", "EMPTY"], "not a train run folder"),
        (["plot-runs", "RUN", "--oracle", "x"], "--oracle"),
        (["plot-runs", "RUN", "--out", "FILE/x.png"], "not a folder"),
        (["plot-runs", "RUN", "--out", "EMPTY"], "is a folder"),
        ([], "command"), (["warp"], "invalid choice"),
    ]
    # Empty or blank paths and globs are user errors, never "here" (issue 23, class 4).
    cases += [
        (["train", *TINY, "--out", ""], "--out: expected a path, got ''"),
        (["train", "--resume", ""], "--resume: expected a path"),
        (["train", "--resume", " "], "--resume: expected a path"),
        (["train", *TINY, "--tensorboard", "", "--out", "OUT"], "--tensorboard: expected a path"),
        (["ladder", "--device", "cpu", "--out", ""], "--out: expected a path"),
        (["bench-env", "--out", ""], "--out: expected a path"),
        (["profile", "--out", ""], "--out: expected a path"),
        (["report", "--results", ""], "--results: expected a path"),
        (["plot-runs", ""], "runs: expected a path"),
        (["plot-runs", "RUN", "--out", ""], "--out: expected a path"),
        (["record", "--out", "", "--plan"], "--out: expected a path"),
        (["record", "--parts", "", "--plan"], "parts (--parts) must name at least one"),
        (["record", "--notebooks", "", "--plan"], "notebooks (--notebooks) must be a glob"),
        (["record", "--notebooks", "zzz*.ipynb", "--plan"],
         "--notebooks) 'zzz*.ipynb' matches no notebook"),
        (["record", "--notebooks", "none", "--parts", "notebooks", "--plan"],
         "parts (--parts) notebooks select nothing"),
    ]
    # A name longer than the file system allows names its flag (issue 23, G4).
    long = "x" * 300
    cases += [
        (["train", *TINY, "--out", long], "--out"),
        (["train", "--resume", long], "--resume"),
        (["ladder", "--device", "cpu", "--stages", "3", "--out", long], "--out"),
        (["bench-env", "--out", long], "--out"),
        (["profile", "--out", long], "--out"),
        (["report", "--results", long], "--results"),
        (["plot-runs", long], "runs"),
    ]
    return cases


CASES = _cases()


def test_the_table_is_large_enough():
    assert len(CASES) >= 60


@pytest.mark.parametrize("argv, needle", CASES,
                         ids=[" ".join(a)[-60:] for a, _ in CASES])
def test_bad_cli_input_is_one_line_exit_2_and_writes_nothing(argv, needle, tmp_path, capsys,
                                                            finished_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file")
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "JSONDIR" / "ladder_cpu_quick.json").mkdir(parents=True)
    shutil.copytree(finished_run, tmp_path / "RUN")
    before = snapshot(tmp_path)
    argv = [str(tmp_path / a) if a in ("FILE", "EMPTY", "RUN", "MISSING", "OUT", "JSONDIR")
            or a.startswith("FILE/") else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exit, with our one-line message
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    assert needle in captured.err, captured.err
    assert captured.out == ""
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "OUT").exists() and not (tmp_path / "runs").exists()


def test_check_output_dir_explains_itself(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        check_output_dir(tmp_path / "f")
    assert check_output_dir(tmp_path / "new" / "deep").is_dir()
    assert os.listdir(tmp_path / "new" / "deep") == []  # the probe file is gone


@pytest.mark.slow
def test_a_path_the_terminal_cannot_encode_does_not_fail_a_finished_run(tmp_path):
    """A non-UTF-8 byte in --out, printed to a strict UTF-8 stdout (an en_US.UTF-8 terminal):
    the run finishes, its summary line shows the byte escaped, and it exits 0 (issue 23, G5)."""
    out = os.fsencode(tmp_path) + b"/bad\xffname"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    argv = [sys.executable.encode(), b"-m", b"labkit", b"train", b"--stage", b"async_logging",
            b"--device", b"cpu", b"--n-envs", b"8", b"--n-steps", b"16", b"--total-steps",
            b"256", b"--no-progress", b"--out", out]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"bad\\udcffname" in done.stdout and os.path.isdir(out)
    again = subprocess.run([*argv[:4], b"--resume", out, b"--no-progress"], cwd=ROOT, env=env,
                           capture_output=True, timeout=300)
    assert again.returncode == 0 and b"already complete" in again.stdout, again.stderr[-2000:]


def _results_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for path in (ROOT / "results").glob("*.json"):
        shutil.copy(path, folder)
    return folder


@pytest.mark.parametrize("name, text, needle", [
    ("ladder_cpu_quick.json", "{}", "is not a labkit result: field 'meta' is missing"),
    ("bench_env_cpu_quick.json", "[]", "holds a JSON list, not a labkit result"),
    ("ladder_cpu_quick.json", '{"meta": {"device": "cpu"', "is not valid JSON"),
    ("learning_cpu_quick.json", None, "field 'budget' is missing"),
    ("ladder_cpu_quick.json", None, "field 'config' is missing"),
])
def test_report_names_the_file_it_cannot_use(tmp_path, capsys, name, text, needle):
    """Every results file is checked at the door (issue 23, class 2): one line naming the file
    and what is wrong, exit 2, and RESULTS.md left as it was."""
    folder = _results_copy(tmp_path)
    if text is None:  # the file's meta, and nothing else of what its kind holds
        meta = json.loads((folder / name).read_text())["meta"]
        text = json.dumps({"meta": meta})
    (folder / name).write_text(text)
    code, _, err = run_cli(["report", "--results", str(folder)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert str(folder / name) in err and needle in err, err
    assert not (folder / "RESULTS.md").exists()


def _metrics_run(tmp_path: Path, lines: list[str]) -> Path:
    run = tmp_path / "RUN"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


GOOD = '{"step": 64, "wall_s": 1.0, "mean_return": 0.5}'


@pytest.mark.parametrize("lines, needle", [
    (['{"step": 64, "mean_return": 0.5}'], "line 1 has no number 'wall_s'"),
    ([GOOD, '{"step": 128, "wall_s": 2.0, "mean_re', GOOD], "line 2 is not valid JSON"),
    ([], "no iteration logged yet"),
    (["[1, 2]"], "line 1 is not a record"),
])
def test_plot_runs_names_the_metrics_it_cannot_plot(tmp_path, capsys, lines, needle):
    run = _metrics_run(tmp_path, lines)
    code, _, err = run_cli(["plot-runs", str(run), "--out", str(tmp_path / "p.png")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run / 'metrics.jsonl'}: {needle}" in err, err
    assert not (tmp_path / "p.png").exists()


def test_plot_runs_leaves_out_the_line_a_killed_run_was_writing(tmp_path, capsys):
    run = _metrics_run(tmp_path, [GOOD, '{"step": 128, "wall_s": 2.0, "mean_re'])
    code, out, _ = run_cli(["plot-runs", str(run), "--out", str(tmp_path / "p.png")], capsys)
    assert code == 0 and (tmp_path / "p.png").exists()


def test_plot_runs_plots_a_real_run_whose_first_iterations_ended_no_episode(finished_run,
                                                                          tmp_path, capsys):
    """mean_return is null until an episode ends: such records are part of the run, with no
    point to draw (the validation of the last pass refused them: every short run failed)."""
    first = json.loads((finished_run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["mean_return"] is None  # the fixture's first iteration ends no episode
    out = tmp_path / "p.png"
    code, _, err = run_cli(["plot-runs", str(finished_run), "--out", str(out)], capsys)
    assert code == 0 and out.exists(), err


@pytest.mark.parametrize("text, needle", [
    ("[1, 2]", "holds a JSON list, not a run config object"),
    ('{"stage": "async_logging", "run": {"n_envs": 4', "is not valid JSON"),
    ('{"stage": "async_logging"}', "its config is not valid"),
])
def test_resume_names_a_config_json_it_cannot_use(tmp_path, capsys, text, needle):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(text)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert str(run / "config.json") in err and needle in err, err


def test_python_api_names_the_argument(tmp_path):
    """Bad input to the public API is a TypeError naming the argument, raised at the call
    (not in a writer thread or deep in pathlib): issue 23, G9."""
    import gymnasium as gym

    from labkit.logging import AsyncLogger, SyncLogger

    for bad in (5, {"height": 9}, "x"):
        with pytest.raises(TypeError, match="forage must be a ForageSpec"):
            gym.make("labkit/Forage-v0", forage=bad)
        with pytest.raises(TypeError, match="forage must be a ForageSpec"):
            gym.make_vec("labkit/Forage-v0", num_envs=2, forage=bad)
    with pytest.raises(TypeError, match="out must be a folder path"):
        train(tiny_config(), None, progress=False)
    for cls in (AsyncLogger, SyncLogger):
        with cls(tmp_path / f"{cls.__name__}.jsonl") as log:
            with pytest.raises(TypeError, match="x: expected a real number or tensor"):
                log.log(1, x=torch.tensor(1 + 2j))
            with pytest.raises(TypeError, match="step must be an int, got Tensor"):
                log.log(torch.tensor(1), x=1.0)
            log.log(2, x=1.0)  # still usable: nothing reached the writer


@pytest.mark.parametrize("argv, needle", [
    (["train", "--stage", "²"], "stage must be one of 0-8"),
    (["ladder", "--stages", "3,²"], "stage must be one of 0-8"),
    (["plot-runs", "RUN", "--oracle", "inf"], "--oracle: expected a finite number, got 'inf'"),
    (["plot-runs", "RUN", "--oracle", "nan"], "--oracle: expected a finite number, got 'nan'"),
    (["plot-runs", "RUN", "--out", "curves.txt"], "--out: curves.txt names no image format"),
])
def test_more_flags_name_themselves(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    _metrics_run(tmp_path, [GOOD])
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "curves.txt").exists()


def test_a_stage_named_twice_is_measured_once():
    from labkit.app.flags import stage_list

    assert [s.index for s in stage_list("3,3,batched_ops,4")] == [3, 4]


# ---------------------------------------------------------------- no write through a link

def _run_names() -> tuple[str, ...]:
    """Every name a training run writes in its folder, from the code's own constants."""
    from labkit.app.run import RUN_FILES, SUMMARY
    return (*RUN_FILES, SUMMARY, FolderLock.NAME)


def test_a_run_writes_only_the_names_the_door_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--out", "run"]) == 0
    assert {p.name for p in Path("run").rglob("*")} <= set(_run_names())


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.parametrize("dangling", [False, True], ids=["to_a_victim", "dangling"])
def test_no_file_is_written_through_a_link_in_the_run_folder(tmp_path, monkeypatch, capsys,
                                                             resume, dangling):
    """A link at any name a run writes (dangling, or to a file the user can write) is refused
    at the door with one line, exit 2: the victim keeps its bytes and nothing is created where
    a dangling link points. A new run and a resume alike."""
    monkeypatch.chdir(tmp_path)
    if resume:
        assert main(["train", *TINY, "--out", "base"]) == 0
    for name in _run_names():
        run = Path(f"run-{name.strip('.')}")
        if resume:
            shutil.copytree("base", run)
            (run / name).unlink(missing_ok=True)
        else:
            run.mkdir()
        victim = tmp_path / f"victim-{name.strip('.')}"
        if not dangling:
            victim.write_text("keep me")
        (run / name).symlink_to(victim)
        argv = ["train", "--resume", str(run), "--no-progress"] if resume else \
            ["train", *TINY, "--out", str(run)]
        code, _, err = run_cli(argv, capsys)
        assert code == 2, (name, err)
        assert f"{run / name} is a symbolic link" in err and err.count("\n") == 1, err
        assert victim.exists() != dangling, name
        if not dangling:
            assert victim.read_text() == "keep me", name
        assert (run / name).is_symlink()


def test_the_lock_and_the_loggers_refuse_a_link_themselves(tmp_path):
    """Behind the door too (the library's own callers): the lock file and a logger's path are
    opened without following a link in their last component."""
    from labkit.files import OutputError, open_no_follow
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / FolderLock.NAME).symlink_to(victim)
    with pytest.raises(OutputError, match="is a symbolic link"):
        FolderLock(tmp_path).acquire()
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    for mode in ("w", "a"):
        with pytest.raises(OutputError, match="is a symbolic link"):
            open_no_follow(tmp_path / "metrics.jsonl", mode)
        with pytest.raises(OutputError, match="is a symbolic link"):
            SyncLogger(tmp_path / "metrics.jsonl", mode=mode)
    assert victim.read_text() == "keep me"


def test_a_deleted_or_replaced_lock_is_noticed(tmp_path):
    lock = FolderLock(tmp_path).acquire()
    lock.check()  # held and in place
    (tmp_path / FolderLock.NAME).unlink()
    from labkit.files import OutputError
    with pytest.raises(OutputError, match="was deleted while this run held it"):
        lock.check()
    (tmp_path / FolderLock.NAME).write_text("another process")
    with pytest.raises(OutputError, match="was replaced while this run held it"):
        lock.check()
    lock.release()


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


def test_figures_and_results_replace_a_link_instead_of_writing_through_it(tmp_path):
    """In a results folder every file is written atomically: a link at a figure's or a JSON
    file's name is replaced by the file, and what it pointed to is untouched."""
    from labkit.book.plots import save_figures
    recorded = json.loads((ROOT / "results" / "ladder_cpu_quick.json").read_text())
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    out = tmp_path / "results"
    out.mkdir()
    for suffix in ("ladder", "scaling", "phases", "learning"):
        (out / f"x_{suffix}.png").symlink_to(victim)
    (out / "x.json").symlink_to(tmp_path / "dangling")
    written = save_figures(recorded, out, "x")
    write_json(out / "x.json", {"a": 1})
    assert len(written) == 4 and victim.read_text() == "keep me"
    assert not (tmp_path / "dangling").exists()
    for path in [*written, out / "x.json"]:
        assert not path.is_symlink() and path.stat().st_size > 0


def test_a_summary_no_run_wrote_is_kept_and_a_torn_one_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("foreign").mkdir()
    Path("foreign/summary.json").write_text('{"mine": 1}')
    code, _, err = run_cli(["train", *TINY, "--out", "foreign"], capsys)
    assert code == 2 and "holds a summary.json that no run there wrote" in err, err
    assert Path("foreign/summary.json").read_text() == '{"mine": 1}'
    assert main(["train", *TINY, "--out", "run"]) == 0
    for torn in ('{"final_return": 1', "[1, 2]", "\xff\xfe"):
        Path("run/summary.json").write_text(torn, encoding="latin-1")
        code, _, err = run_cli(["train", "--resume", "run", "--no-progress"], capsys)
        assert code == 2 and "run/summary.json is not the summary a run writes" in err, err
        assert err.count("\n") == 1, err


_FSIZE_SCRIPT = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from labkit.files import describe_os_error, save_figure, write_json
out = Path(sys.argv[1])
for name, write in (("big.json", lambda p: write_json(p, {"x": "y" * 100_000})),
                    ("fig.png", lambda p: save_figure(plt.figure(figsize=(20, 20)), p, dpi=200))):
    try:
        write(out / name)
    except OSError as err:
        print(describe_os_error(err))
"""


def test_a_write_past_a_file_size_limit_keeps_the_previous_file_and_names_it(tmp_path):
    """A real RLIMIT_FSIZE (what a quota or a full disk does to a write): the JSON and the
    figure that were there stay whole, and the error names the file and says so."""
    (tmp_path / "big.json").write_text('{"old": true}\n')
    (tmp_path / "fig.png").write_bytes(b"old image")
    done = subprocess.run([sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == 2, (done.stdout, done.stderr)
    for line, name in zip(lines, ("big.json", "fig.png")):
        assert "File too large" in line and f"{tmp_path / name} is kept as it was" in line
    assert (tmp_path / "big.json").read_text() == '{"old": true}\n'
    assert (tmp_path / "fig.png").read_bytes() == b"old image"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2"}, "RANK is not set, but WORLD_SIZE=2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 must be in 0..1 (WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 must be in 0..1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' must be an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2 must be in 0..1 (LOCAL_WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 must be in"),
    ({"LABKIT_DEBUG": "maybe"}, "LABKIT_DEBUG='maybe' must be one of"),
    ({"LABKIT_GIT_COMMIT": "<script>"}, "LABKIT_GIT_COMMIT='<script>' must be a commit"),
    ({"LABKIT_GIT_COMMIT": "abc"}, "must be a commit: 7 to 40 hex digits"),
])
def test_the_environment_is_checked_like_the_flags(tmp_path, monkeypatch, capsys, env, needle):
    """torchrun's and labkit's variables, each named in one line, exit 2, before any
    rendezvous or any file: a rank outside the world never waits forever."""
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_cli(["train", *TINY, "--out", "run"], capsys)
    assert code == 2 and needle in err and err.count("\n") == 1, err
    assert not Path("run").exists()


def test_a_commit_shaped_variable_is_taken(monkeypatch):
    from labkit.device import git_commit
    for given, said in (("0229760", "0229760"), ("b49405fa53aefa4c8c2463a35a65bbce4c02b0cf",
                                                 "b49405f"), ("0229760-dirty", "0229760-dirty")):
        monkeypatch.setenv("LABKIT_GIT_COMMIT", given)
        assert git_commit() == said


class _Payload:
    """A pickle that, if ever unpickled, creates the file named in ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _hostile_bodies(marker: str) -> dict[str, bytes]:
    import pickle
    zipped, legacy = io.BytesIO(), io.BytesIO()
    torch.save({"format": 3, "x": _Payload(marker)}, zipped)
    torch.save({"format": 3, "x": _Payload(marker)}, legacy,
               _use_new_zipfile_serialization=False)
    return {"zip": zipped.getvalue(), "legacy": legacy.getvalue(),
            "raw": pickle.dumps({"format": 3, "x": _Payload(marker)})}


@pytest.mark.parametrize("kind", ["zip", "legacy", "raw"])
def test_a_hostile_checkpoint_with_a_valid_header_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                          capsys, kind):
    """A pickle behind labkit's own header and a correct checksum never runs its payload, and
    a body that is not torch.save's zip archive is refused before torch reads (and warns
    about) it: one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--out", "run"]) == 0
    marker = tmp_path / "payload-ran"
    body = _hostile_bodies(str(marker))[kind]
    Path("run/checkpoint.pt").write_bytes(checkpoint.MAGIC + hashlib.sha256(body).digest() + body)
    code, _, err = run_cli(["train", "--resume", "run", "--no-progress"], capsys)
    assert code == 2 and "run/checkpoint.pt" in err and err.count("\n") == 1, err
    assert not marker.exists()
    if kind != "zip":
        assert "not the zip archive torch.save writes" in err, err


def test_the_memory_cgroup_limit_is_read_v2_with_its_parents_and_v1(tmp_path):
    """A cgroup folder given by parameter (CI cannot set cgroup limits): v2 takes the smallest
    room over the cgroup and its parents, "max" is no limit, v1's huge number is no limit."""
    from labkit.config import cgroup_headroom
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    (root / "a" / "b" / "memory.max").write_text("1000000\n")
    (root / "a" / "b" / "memory.current").write_text("400000\n")
    assert cgroup_headroom(root, proc) == 600_000
    (root / "a" / "memory.max").write_text("700000\n")
    (root / "a" / "memory.current").write_text("650000\n")
    assert cgroup_headroom(root, proc) == 50_000  # the parent's limit binds
    for f in ("a/b/memory.max", "a/memory.max"):
        (root / f).write_text("max\n")
    assert cgroup_headroom(root, proc) is None
    proc.write_text("4:memory:/x\n0::/\n")
    (root / "memory" / "x").mkdir(parents=True)
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (root / "memory" / "x" / "memory.usage_in_bytes").write_text("400000000")
    assert cgroup_headroom(root, proc) is None
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("1000000000")
    assert cgroup_headroom(root, proc) == 600_000_000
    assert cgroup_headroom(root, tmp_path / "missing") is None


_RLIMIT_SCRIPT = """
import resource, sys
from labkit.app.cli import main
from labkit.config import address_space_headroom
import labkit.app.train, labkit.stages  # what train imports, mapped before the limit
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 2**28, resource.RLIM_INFINITY))
assert address_space_headroom() <= 2**28
sys.exit(main(sys.argv[2:]))
"""
_TRAIN_BIG = ["train", "--stage", "async_logging", "--device", "cpu", "--n-envs", "4096",
              "--n-steps", "128", "--total-steps", "524288", "--out"]


def test_a_run_larger_than_the_address_space_limit_is_refused_up_front(tmp_path):
    """A real RLIMIT_AS (ulimit -v) 256 MiB above what the process maps: a run estimated at
    gigabytes is refused in one line naming the limit, exit 2, before anything is allocated."""
    done = subprocess.run([sys.executable, "-c", _RLIMIT_SCRIPT, "-", *_TRAIN_BIG,
                           str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "left under the address-space limit (RLIMIT_AS" in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]


def test_a_bench_env_size_past_the_address_space_limit_is_refused_up_front(tmp_path):
    argv = ["bench-env", "--device", "cpu", "--n-envs", "1048576", "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-c", _RLIMIT_SCRIPT, "-", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "benchmark's runners need about" in done.stderr, done.stderr[-2000:]
    assert "left under the address-space limit (RLIMIT_AS" in done.stderr, done.stderr[-2000:]
    assert not list((tmp_path / "out").glob("*.json"))


def _edits() -> list[tuple[str, object]]:
    """Hostile but well-formed edits of a checkpoint's state (the header and checksum are
    rewritten valid), each with what the refusal must name."""
    def env(key, fn):
        return lambda p: p["state"]["collector"]["env"].__setitem__(
            key, fn(p["state"]["collector"]["env"][key]))
    return [
        ("state['episode_return']", env("episode_return", lambda v: torch.full_like(v, math.nan))),
        ("state['episode']", env("episode", lambda v: torch.full_like(v, -1))),
        ("state['seed']", env("seed", lambda v: torch.full_like(v, -1))),
        ("state['pos']", env("pos", lambda v: torch.zeros_like(v))),
        ("state['grid']", env("grid", lambda v: torch.full_like(v, 99))),
        ("collector state['t']", lambda p: p["state"]["collector"].__setitem__(
            "t", torch.full_like(p["state"]["collector"]["t"], 999))),
        ("collector state['done']", lambda p: p["state"]["collector"].__setitem__(
            "done", torch.full_like(p["state"]["collector"]["done"], math.nan))),
        ("metrics state['returns']", lambda p: p["state"]["metrics"].__setitem__(
            "returns", [math.nan])),
        ("metrics state['lengths']", lambda p: p["state"]["metrics"].update(
            returns=[1.0], lengths=[0])),
    ]


def test_hostile_but_well_formed_saved_state_is_refused_at_the_door(tmp_path, monkeypatch,
                                                                    capsys):
    """Each edit behind a valid header and checksum: `train --resume` refuses it in one line
    naming the key, exit 2, and the checkpoint is left as it was."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--stop-after", "1", "--out", "base"]) == 0
    for i, (needle, edit) in enumerate(_edits()):
        run = Path(f"run{i}")
        shutil.copytree("base", run)
        rewrite_checkpoint(run / "checkpoint.pt", edit)
        before = (run / "checkpoint.pt").read_bytes()
        code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, (needle, err)
        assert (run / "checkpoint.pt").read_bytes() == before


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 KiB tmpfs (root only, where mounting is allowed), unmounted after."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_a_full_disk_keeps_the_previous_file_and_names_it(small_disk):
    from labkit.files import describe_os_error
    old = small_disk / "results.json"
    write_json(old, {"old": True})
    with pytest.raises(OSError) as caught:
        write_json(old, {"x": "y" * 200_000})
    said = describe_os_error(caught.value)
    assert "No space left on device" in said and f"{old} is kept as it was" in said, said
    assert json.loads(old.read_text()) == {"old": True}
    assert [p.name for p in small_disk.iterdir()] == ["results.json"]
