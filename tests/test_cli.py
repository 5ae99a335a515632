import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.app.cli import main
from tests import runs
from tests.runs import ROOT, TINY, run_cli, snapshot

# The fixture tests/runs.py shares, found by pytest under this name.
finished_run = runs.finished_run


def test_unknown_device_is_a_clear_error(capsys):
    assert main(["bench-env", "--device", "tpu"]) == 2
    assert "device must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("stages, needle", [
    ("0,warp_speed", "stage must be one of"),
    ("", "expected comma-separated stages"),
    (",", "expected comma-separated stages"),
    (" , ", "expected comma-separated stages"),
])
def test_bad_stage_lists_are_rejected_by_the_parser(capsys, stages, needle):
    with pytest.raises(SystemExit) as exc:
        main(["ladder", "--stages", stages])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow
def test_ladder_writes_json_and_figures(tmp_path, capsys):
    code = main(["ladder", "--device", "cpu", "--stages", "3,6,8", "--n-envs", "8",
                 "--n-steps", "16", "--iterations", "2", "--scaling-n-envs", "4", "8",
                 "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "batched_ops" in out and "skipped: needs CUDA" in out
    assert "where an iteration goes" in out
    result = json.loads((tmp_path / "ladder_cpu_quick.json").read_text())
    assert [r["stage"] for r in result["ladder"]] == [3, 6, 8]
    assert result["ladder"][1]["host_reads_rollout_per_step"] == 0
    assert result["meta"]["torch"] and result["meta"]["cpu_count"] >= 1
    assert result["headline"]["stage"] == 6  # the highest stage that ran
    assert set(result["ladder"][1]["phase_ms"]) >= {"policy", "env", "update"}
    assert result["ladder"][1]["ceiling_sps"] > 0
    for suffix in ("ladder", "scaling", "phases", "learning"):
        assert (tmp_path / f"ladder_cpu_quick_{suffix}.png").stat().st_size > 1000


def test_config_flags_take_help_and_defaults_from_the_config_fields():
    """The train flags are generated from TrainConfig/RunConfig: each --help line is the
    field's docstring with the config's own default, so help cannot drift from the config."""
    import argparse
    import dataclasses

    from labkit.app.cli import build_parser
    from labkit.app.train import TrainConfig
    from labkit.config import RunConfig, field_docs

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    train = {a.dest: a for a in sub.choices["train"]._actions}
    for cls in (TrainConfig, RunConfig):
        docs = field_docs(cls)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name in ("stage", "device", "total_steps", "checkpoint_every", "n_envs", "n_steps",
                     "seed", "value_head", "compile"):
            if name in docs:
                assert train[name].help.replace("%%", "%") == \
                    f"{docs[name]} (default: {defaults[name]})"
                assert train[name].default is None  # unset: the config's (or resumed run's)
    assert train["value_head"].choices == ("plain", "popart")
    assert train["compile"].choices == ("auto", "compiled", "eager")


def test_one_exit_mapper_maps_every_way_a_command_ends(monkeypatch, capsys):
    """cli.main alone turns how a command ended into an exit code and at most one line:
    commands return a code or raise (issue 36)."""
    import signal as sig

    import pytest

    from labkit.app import cli, report
    from labkit.app.run import TrainingFailed
    from labkit.signals import Stop

    def ending(outcome):
        def command(args):
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        monkeypatch.setattr(report, "cmd_report", command)  # the command's flags live there
        monkeypatch.setattr(cli, "_silence_stdout", lambda: None)  # keep pytest's stdout
        code = cli.main(["report"])
        return code, capsys.readouterr().err.strip()

    oom = RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
    oom.add_note("labkit: runs/x/checkpoint.pt holds the state after iteration 7")
    assert ending(7) == (7, "")  # a command (a user's script, say) may return its own code
    assert ending(ValueError("--out: bad")) == (2, "error: --out: bad")
    assert ending(OSError(28, "No space left on device")) == (1, "error: No space left on "
                                                                "device")
    assert ending(TrainingFailed("the loss became non-finite")) == (
        1, "error: the loss became non-finite")
    assert ending(oom) == (1, "error: out of memory in report: CUDA out of memory. Tried to "
                              "allocate 2 GiB; runs/x/checkpoint.pt holds the state after "
                              "iteration 7")
    assert ending(MemoryError())[0] == 1
    assert ending(Stop(sig.SIGTERM, said="interrupted by SIGTERM: 3 rows kept")) == (
        128 + sig.SIGTERM, "interrupted by SIGTERM: 3 rows kept")
    assert ending(KeyboardInterrupt()) == (130, "interrupted by SIGINT: report stopped; each "
                                                "file it writes is replaced whole or not at "
                                                "all")
    assert ending(BrokenPipeError()) == (128 + sig.SIGPIPE, "")  # `labkit ... | head`: quiet
    with pytest.raises(RuntimeError, match="a bug"):  # a bug keeps its traceback
        ending(RuntimeError("a bug"))


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


def test_plot_runs_names_a_gap_in_a_runs_history(finished_run, tmp_path, capsys):
    """A history with iterations missing (truncated in place, or edited) is drawn without
    them, and the gap is named, on stderr and in the figure's legend."""
    import matplotlib.pyplot as plt

    from labkit.book.plots import history_gaps, run_curve

    run = tmp_path / "torn"
    shutil.copytree(finished_run, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # TINY: 2 iterations; make it 5 with 1, 4 and 5 kept
    records = [json.loads(lines[0])] + [{**json.loads(lines[1]), "iteration": i}
                                        for i in (4, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert history_gaps(run_curve(run)) == ["2-3"]
    assert history_gaps(run_curve(finished_run)) == []
    shown = []
    real = plt.Axes.legend
    plt.Axes.legend = lambda ax, *a, **k: shown.extend(ax.get_legend_handles_labels()[1]) or \
        real(ax, *a, **k)
    try:
        code, _, err = run_cli(["plot-runs", str(run), "--out", str(tmp_path / "c.png")], capsys)
    finally:
        plt.Axes.legend = real
    assert code == 0 and (tmp_path / "c.png").is_file()
    assert f"note: {run / 'metrics.jsonl'} has no record of iteration(s) 2-3" in err
    assert "torn (no iteration 2-3)" in shown


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
        (["train", *TINY, "--out", "OUT\x1b[31mred\x07"], r"holds the control character '\x1b'"),
        (["plot-runs", "RUN", "--out", "a\nb.png"], r"holds the control character '\n'"),
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


@pytest.mark.parametrize("board", ["metrics.jsonl", "checkpoint.pt/tb", ".lock",
                                   "summary.json"])
def test_tensorboard_at_a_file_the_run_writes_is_refused_and_nothing_made(board, tmp_path,
                                                                           capsys, finished_run):
    """``--tensorboard`` naming a file of the run's own folder, for a new run or a resume:
    refused in one line before any folder is made (it was made a folder there, and left)."""
    shutil.copytree(finished_run, tmp_path / "RUN")
    for argv, folder in ((["--resume", str(tmp_path / "RUN")], tmp_path / "RUN"),
                         ([*TINY, "--out", str(tmp_path / "NEW")], tmp_path / "NEW")):
        before = sorted(str(p) for p in tmp_path.rglob("*"))
        code, out, err = run_cli(["train", *argv, "--tensorboard", str(folder / board)],
                                 capsys)
        assert code == 2 and err.count("\n") == 1 and "--tensorboard" in err, err
        assert f"is {board.split('/')[0]} of the run folder" in err, err
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # no folder made


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


@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2"}, "RANK is not set, but WORLD_SIZE=2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be in 1..65536"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 must be in 0..1 (WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 must be in 0..1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' must be an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2 must be in 0..1 (LOCAL_WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "99999"}, "MASTER_PORT=99999 must be in"),
    ({"WORLD_SIZE": str(10**9), "RANK": "0"}, "WORLD_SIZE=1000000000 must be in 1..65536"),
    ({"WORLD_SIZE": "7" * 50_000}, "WORLD_SIZE is an integer of 50,000 digits: it must be in "
                                   "1..65536"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "no-such-host.invalid",
      "MASTER_PORT": "29500"}, "MASTER_ADDR='no-such-host.invalid' cannot be resolved"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
      "LABKIT_RENDEZVOUS_TIMEOUT": "0"}, "LABKIT_RENDEZVOUS_TIMEOUT=0 must be in 1..86400"),
    ({"LABKIT_DEBUG": "maybe"}, "LABKIT_DEBUG='maybe' must be one of"),
    ({"LABKIT_GIT_COMMIT": "<script>"}, "LABKIT_GIT_COMMIT='<script>' must be a commit"),
    ({"LABKIT_GIT_COMMIT": "abc"}, "must be a commit: 7 to 40 hex digits"),
])
def test_the_environment_is_checked_like_the_flags(tmp_path, monkeypatch, capsys, env, needle):
    """torchrun's and labkit's variables, each named in one line, exit 2, before any
    rendezvous or any file: a rank outside the world never waits forever."""
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                 "MASTER_ADDR", "LABKIT_RENDEZVOUS_TIMEOUT"):
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


# ---------------------------------------------------------------- a file a command cannot use


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
    ("ladder_cpu_quick.json", "NaN sps", "field 'ladder.0.sps' is nan; labkit writes a figure"),
])
def test_report_names_the_file_it_cannot_use(tmp_path, capsys, name, text, needle):
    """Every results file is checked at the door (issue 23, class 2): one line naming the file
    and what is wrong, exit 2, and RESULTS.md left as it was."""
    folder = _results_copy(tmp_path)
    if text is None:  # the file's meta, and nothing else of what its kind holds
        meta = json.loads((folder / name).read_text())["meta"]
        text = json.dumps({"meta": meta})
    elif text == "NaN sps":  # JSON's NaN literal where labkit writes null ("nanx" was printed)
        data = json.loads((folder / name).read_text())
        data["ladder"][0]["sps"] = float("nan")
        text = json.dumps(data)
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
    ([], "has no iteration logged yet"),
    (["[1, 2]"], "line 1 is not a record"),
])
def test_plot_runs_names_the_metrics_it_cannot_plot(tmp_path, capsys, lines, needle):
    run = _metrics_run(tmp_path, lines)
    code, _, err = run_cli(["plot-runs", str(run), "--out", str(tmp_path / "p.png")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run / 'metrics.jsonl'} {needle}" in err, err
    assert not (tmp_path / "p.png").exists()


def test_plot_runs_leaves_out_the_line_a_killed_run_was_writing(tmp_path, capsys):
    run = _metrics_run(tmp_path, [GOOD])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 128, "wall_s": 2.0, "mean_re')  # cut short: no newline ends it
    code, out, _ = run_cli(["plot-runs", str(run), "--out", str(tmp_path / "p.png")], capsys)
    assert code == 0 and (tmp_path / "p.png").exists()


def test_a_whole_last_line_that_is_no_record_is_damage_not_a_torn_write(tmp_path, capsys):
    """A last line a newline ends was written whole: a bad one (JSON nested past what Python
    parses, say) is refused by resume and by plot-runs, naming the file and line, never
    dropped as if a killed run had been writing it."""
    from tests.test_files import DEEP

    run = tmp_path / "run"
    assert main(["train", *TINY, "--stop-after", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    lines = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(lines + DEEP + "\n")
    for argv in (["train", "--resume", str(run), "--no-progress"],
                 ["plot-runs", str(run), "--out", str(tmp_path / "p.png")]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert str(run / "metrics.jsonl") in err and "line 2" in err, err


def test_plot_runs_plots_a_real_run_whose_first_iterations_ended_no_episode(finished_run,
                                                                          tmp_path, capsys):
    """mean_return is null until an episode ends: such records are part of the run, with no
    point to draw (the validation of the last pass refused them: every short run failed)."""
    first = json.loads((finished_run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["mean_return"] is None  # the fixture's first iteration ends no episode
    out = tmp_path / "p.png"
    code, _, err = run_cli(["plot-runs", str(finished_run), "--out", str(out)], capsys)
    assert code == 0 and out.exists(), err


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_deleted_working_folder_is_said_in_one_line(tmp_path):
    """V-cwd-deleted: torch's MKL said "Cannot load libtorch_cpu.so" at import."""
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(f"cd {gone} && rmdir {gone} && {sys.executable} -m labkit train "
                       "--device cpu --total-steps 64", shell=True, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr == ("error: the current folder was deleted: cd to a "
                                              "folder that exists, then run labkit again\n")
