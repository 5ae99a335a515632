"""The run folder's one door (``labkit/app/run.py``): one run per folder, a damaged or foreign
folder refused in one line naming the file and left as it was, a finished run left alone, and
no file written through a link. The numbered sections are defects of the reliability issue."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from labkit.app.cli import main
from labkit.app.train import train
from labkit.files import FolderLock, write_json
from tests import runs
from tests.runs import (
    TINY,
    metrics_lines,
    rewrite_checkpoint,
    run_cli,
    snapshot,
    start_training,
    wait_for,
)

# The fixtures tests/runs.py shares, found by pytest under these names.
copy_of, finished_run = runs.copy_of, runs.finished_run


def lengthen(run: Path, total_steps: int) -> None:
    """Make ``run`` a longer run, in its checkpoint and its config.json alike (a resume refuses
    a config.json that disagrees with its checkpoint)."""
    rewrite_checkpoint(run / "checkpoint.pt",
                       lambda p: p["config"].update(total_steps=total_steps))
    cfg = json.loads((run / "config.json").read_text())
    cfg["total_steps"] = total_steps
    (run / "config.json").write_text(json.dumps(cfg))


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


# ---------------------------------------------------------------- 9. and 10. the checkpoint's run


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


# ---------------------------------------------------------------- what the folder holds


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


# ------------------------------------------------------------------ 57.3: a torn history


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "rewrite"])
def test_metrics_torn_while_the_run_goes_stop_it_naming_the_file(tmp_path, damage):
    """``metrics.jsonl`` truncated in place (``: > metrics.jsonl``) or its last record
    rewritten by another process while a real run appends to it: the run stops, exit 2, in one
    line naming the file, and a resume refuses the truncated history."""
    out = tmp_path / "run"
    proc = start_training(out, "--checkpoint-every", "2")
    path = out / "metrics.jsonl"
    wait_for(lambda: metrics_lines(out) >= 3, what="three iterations")
    proc.send_signal(signal.SIGSTOP)  # no record lands while the file is damaged
    time.sleep(0.2)
    if damage == "truncate":
        os.truncate(path, 0)
    else:  # the same bytes but one, in the last record: only its hash tells
        data = bytearray(path.read_bytes())
        end = data.rindex(b'"iteration": ')
        data[end + 13:end + 14] = b"9" if data[end + 13:end + 14] != b"9" else b"8"
        with open(path, "r+b") as f:
            f.write(data)
    proc.send_signal(signal.SIGCONT)
    _, err = runs.finish(proc)
    said = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, err[-3000:]
    assert len(said) == 1 and f"{path} changed while the run was writing it" in said[0], err
    if damage == "truncate":  # a rewritten record after the checkpoint's is dropped on resume
        assert main(["train", "--resume", str(out)]) == 2


def test_the_history_check_names_truncation_and_rewrite(tmp_path):
    from labkit.app.session import History

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n')
    history = History(path)
    history.check()
    with open(path, "a") as f:
        f.write('{"iteration": 2}\n')
    history.wrote()
    history.check()  # as written: nothing to say
    path.write_text('{"iteration": 1}\n{"iteration": 3}\n')  # the same size, rewritten
    with pytest.raises(ValueError, match="had its last record rewritten"):
        history.check()
    path.write_text("")
    with pytest.raises(ValueError, match=r"holds 0 bytes where this run had written 34"):
        history.check()
    path.unlink()
    history.check()  # deleted: the logger's flush raises it as a write error


def test_a_folder_named_like_a_stale_temporary_is_refused_not_unlinked(copy_of, capsys):
    """The door deletes what an interrupted atomic write left (``.checkpoint.pt.X.tmp``); a
    folder of that name is not one of those: refused in one line, exit 2, left as it is."""
    run = copy_of()
    (run / ".checkpoint.pt.zzzz.tmp" / "inner").mkdir(parents=True)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert ".checkpoint.pt.zzzz.tmp is a folder named like a temporary file" in err
    assert (run / ".checkpoint.pt.zzzz.tmp" / "inner").is_dir()
