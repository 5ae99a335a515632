"""What the tests of a training run share (not a test module): the tiny run, as a config and
as CLI flags; a finished run to copy (``finished_run``, ``copy_of``); a training run in a real
process and waiting on it; and the folder snapshots that show nothing was written.

Import the helpers by name (``from tests.runs import TINY, run_cli``); a test module that uses
a fixture binds it at module level (``finished_run = runs.finished_run``), where pytest finds it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.app import checkpoint
from labkit.app.cli import main
from labkit.app.train import TrainConfig, train
from labkit.envs.spec import ForageSpec
from labkit.files import FolderLock

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
