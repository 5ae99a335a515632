import json

import pytest

from labkit.app.cli import main


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
