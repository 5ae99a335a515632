"""Writing files (``labkit/files.py``): atomic writes that keep the previous file whole on a
full disk or a size limit and get ordinary permissions, output folders checked up front, the
folder lock, and no write through a link."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.app.cli import main
from labkit.files import FolderLock, OutputError, check_output_dir, unique_folder, write_json
from labkit.logging import SyncLogger
from tests.runs import ROOT, TINY

# ---------------------------------------------------------------- permissions and folders


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


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folders = {unique_folder("runs/train-%Y%m%d-%H%M") for _ in range(3)}
    assert len(folders) == 3 and all(f.is_dir() for f in folders)


def test_check_output_dir_explains_itself(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        check_output_dir(tmp_path / "f")
    assert check_output_dir(tmp_path / "new" / "deep").is_dir()
    assert os.listdir(tmp_path / "new" / "deep") == []  # the probe file is gone


# ---------------------------------------------------------------- the lock and links


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


def test_a_hard_linked_or_foreign_lock_is_refused_and_kept(tmp_path, capsys):
    """A ``.lock`` that is a hard link to a file outside, or another tool's file, in a new run
    folder: one line naming it, exit 2, and the file it holds untouched. A pid is reused."""
    from tests.runs import run_cli
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    linked, foreign = tmp_path / "linked", tmp_path / "foreign"
    linked.mkdir()
    os.link(victim, linked / FolderLock.NAME)
    foreign.mkdir()
    (foreign / FolderLock.NAME).write_text("another tool's lock: do not delete")
    for out, said in ((linked, "is a hard link"), (foreign, "not a labkit pid")):
        code, _, err = run_cli(["train", *TINY, "--out", str(out)],
                               capsys)
        assert code == 2 and err.count("\n") == 1 and said in err
        assert str(out / FolderLock.NAME) in err
    assert victim.read_text() == "precious"
    assert (foreign / FolderLock.NAME).read_text() == "another tool's lock: do not delete"
    (foreign / FolderLock.NAME).write_text("12345")  # a stale lock of an earlier run: reused
    FolderLock(foreign).acquire().release()
    assert (foreign / FolderLock.NAME).read_text() == str(os.getpid())


def test_a_logger_refuses_to_write_through_a_hard_link(tmp_path):
    from labkit.files import open_no_follow
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    os.link(victim, tmp_path / "metrics.jsonl")
    for mode in ("w", "a"):
        with pytest.raises(OutputError, match="is a hard link"):
            open_no_follow(tmp_path / "metrics.jsonl", mode)
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


@pytest.mark.slow
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


# ---------------------------------------------------------------- a full disk


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


@pytest.mark.slow
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


DEEP = "[" * 200000 + "]" * 200000  # deeper than Python's parser can go: a RecursionError


def test_the_json_reader_refuses_deep_nesting_and_size_naming_the_file(tmp_path, monkeypatch):
    import labkit.files as files
    path = tmp_path / "deep.json"
    path.write_text(DEEP)
    with pytest.raises(ValueError, match=f"{path} is JSON nested too deeply"):
        files.read_json(path)
    with pytest.raises(ValueError, match="metrics.jsonl line 3 is JSON nested too deeply"):
        files.parse_json(DEEP, "metrics.jsonl line 3")
    monkeypatch.setattr(files, "JSON_MAX_BYTES", 100)
    with pytest.raises(ValueError, match=f"{path} holds 400,000 bytes, more than the 100"):
        files.read_json(path)


def test_train_resume_plot_runs_and_report_refuse_deep_json_in_one_line(tmp_path, capsys):
    """Nested JSON at the depth that broke the review's runs, in each file the commands read."""
    import shutil

    from tests.runs import run_cli
    done = tmp_path / "done"
    assert run_cli(["train", *TINY, "--out", str(done)], capsys)[0] == 0

    def refused(argv, said):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and said in err, err

    for name in ("config.json", "summary.json"):
        run = tmp_path / f"deep-{name}"
        shutil.copytree(done, run)
        (run / name).write_text(DEEP)
        refused(["train", "--resume", str(run), "--no-progress"], str(run / name))
    run = tmp_path / "deep-first-line"
    shutil.copytree(done, run)
    (run / "metrics.jsonl").write_text(DEEP + "\n" + (done / "metrics.jsonl").read_text())
    refused(["plot-runs", str(run), "--out", str(tmp_path / "p.png")], "metrics.jsonl")
    for summary, said in (("{}", "'steps' is None"), ('{"steps": null}', "'steps' is None")):
        run = tmp_path / f"summary-{len(summary)}"
        shutil.copytree(done, run)
        (run / "summary.json").write_text(summary)
        refused(["train", "--resume", str(run), "--no-progress"], said)
    results = tmp_path / "results"
    results.mkdir()
    (results / "ladder_cpu_quick.json").write_text(DEEP)
    refused(["report", "--results", str(results)], "ladder_cpu_quick.json")


def test_a_refusal_after_the_output_check_leaves_no_folder_made(tmp_path):
    """files.output_dir: a folder the check made is removed where the work refuses (bench-env
    under RLIMIT_AS said no to 4M envs and left its empty --out folder behind); a folder that
    was there, or one the work wrote into, stays."""
    from labkit.files import output_dir

    made, there = tmp_path / "new", tmp_path / "old"
    there.mkdir()
    for folder in (made, there):
        with pytest.raises(ValueError, match="too big"), output_dir(folder):
            raise ValueError("too big")
    assert not made.exists() and there.is_dir()
    with pytest.raises(ValueError), output_dir(made) as folder:
        (folder / "partial.json").write_text("{}")
        raise ValueError("stopped after writing")
    assert (made / "partial.json").exists()
    with output_dir(tmp_path / "fine") as folder:
        pass
    assert folder.is_dir()


def test_a_lock_whose_whole_folder_was_deleted_says_so_as_a_machine_fault(tmp_path):
    """The run folder deleted mid-run stops the run with exit 1 however it is noticed: by the
    log file gone (a write error) or here, by the lock's folder gone (it said 'was deleted
    while this run held it' as a user error, exit 2, in one try of three)."""
    import shutil

    folder = tmp_path / "run"
    lock = FolderLock(folder).acquire()
    try:
        shutil.rmtree(folder)
        with pytest.raises(FileNotFoundError, match=r"the run folder .*run was deleted while"):
            lock.check()
    finally:
        lock.release()


def test_one_jsonl_reader_leaves_out_only_the_line_a_killed_writer_was_cut_off_in(tmp_path):
    """resume and plot-runs read metrics.jsonl through one reader with one rule: the last line,
    unterminated and no JSON object, was being written when the run died; every other bad
    line is damage, named with its file and number."""
    from labkit.files import read_jsonl

    path = tmp_path / "metrics.jsonl"
    whole = '{"iteration": 1}\n{"iteration": 2}\n'
    for tail, kept in (('{"iterat', 2), ("12", 2), ('{"iteration": 3}', 3), ("", 2)):
        path.write_text(whole + tail)
        assert [n for n, _ in read_jsonl(path)] == list(range(1, kept + 1)), tail
    for text, line in ((whole + '{"iterat\n', 3), ('{"iterat\n' + whole, 1)):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"metrics.jsonl line {line} is not valid JSON"):
            list(read_jsonl(path))
    path.write_text('{"iteration": 1}\n\n{"iteration": 2}\n' + '{"iterat\n')
    records = read_jsonl(path)  # read as asked: a reader that stops early never meets line 4
    assert [next(records)[0], next(records)[0]] == [1, 3]


def test_resume_reads_the_metrics_it_keeps_and_no_further(tmp_path):
    """A resume keeps iterations 1..k of the checkpoint: lines past those run again, so damage
    there is never read (the reader stops at the first record past k); damage within them is
    refused with what to do."""
    from labkit.app.run import _read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": 2}\n{"itera\n{"iteration": 4}\n')
    assert [r["iteration"] for r in _read_metrics(path, 1)] == [1]
    with pytest.raises(ValueError, match="line 3 is not valid JSON .*repair or delete that "
                                         "line, then resume"):
        _read_metrics(path, 3)
