"""make record / labkit report: one record writes every promised file with one commit; parts
recorded one by one merge into what one run writes and keep their rows when interrupted; the
plan fits each GPU command in its budget; the README's results section is the report
generator's output, byte for byte."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.app import cli
from labkit.app.plan import PART_BUDGET_MIN, commands, estimates, format_plan, plan
from labkit.app.record import record
from labkit.app.report import README_BEGIN, README_END, readme_section, results_markdown
from labkit.app.results import RecordError

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, cpu):
    out = tmp_path_factory.mktemp("results")
    said = []
    seconds = record(cpu, "tiny", out,
                     parts=("ladder", "scaling", "bench_env", "learning", "report"),
                     notebooks="none", allow_dirty=True, stages=["batched_ops", "async_logging"],
                     say=said.append)
    return out, seconds, said


@pytest.mark.slow
def test_record_writes_every_promised_file_with_one_commit(recorded):
    out, seconds, said = recorded
    assert list(seconds) == ["ladder-3", "ladder-4", "scaling-8", "bench_env", "learning",
                             "report"]
    for name in ("ladder_cpu_tiny.json", "bench_env_cpu_tiny.json", "learning_cpu_tiny.json",
                 "RESULTS.md", "learning_cpu_tiny.png", "ladder_cpu_tiny_ladder.png",
                 "ladder_cpu_tiny_phases.png", "ladder_cpu_tiny_scaling.png"):
        assert (out / name).stat().st_size > 0, name
        assert any(line.endswith(name) for line in said), name
    metas = [json.loads((out / n).read_text())["meta"] for n in
             ("ladder_cpu_tiny.json", "bench_env_cpu_tiny.json", "learning_cpu_tiny.json")]
    assert len({m["git_commit"] for m in metas}) == 1 and metas[0]["git_commit"] != "unknown"
    assert {m["device"] for m in metas} == {"cpu"} and all(m["profile"] == "tiny" for m in metas)
    learning = json.loads((out / "learning_cpu_tiny.json").read_text())
    assert learning["oracle"] > 10 * learning["random"]
    curve = learning["stages"]["async_logging"]["curve"]
    assert [p["steps"] for p in curve] == [512 * (i + 1) for i in range(8)]
    assert all(p["wall_s"] > 0 for p in curve)


@pytest.mark.slow
def test_the_report_is_generated_from_the_json(recorded):
    out, _, _ = recorded
    text = (out / "RESULTS.md").read_text()
    assert text == results_markdown(out)
    assert "No GPU result is recorded yet" in text
    ladder = json.loads((out / "ladder_cpu_tiny.json").read_text())
    row = ladder["ladder"][0]
    assert f"| 3 | batched_ops | 8 | {row['sps']:,.0f} |" in text


def test_the_readme_shows_the_report_byte_for_byte():
    text = (ROOT / "README.md").read_text()
    section = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0]
    assert section == "\n" + readme_section(ROOT / "results")


def test_record_refuses_modified_code(monkeypatch, tmp_path, cpu):
    import labkit.app.record
    monkeypatch.setattr(labkit.app.record, "_dirty_code", lambda: ["labkit/stages.py"])
    with pytest.raises(RecordError, match="labkit/stages.py"):
        record(cpu, "tiny", tmp_path, parts=("report",))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RecordError, match=r"parts \(--parts\) must be among"):
        record(cpu, "tiny", tmp_path, parts=("everything",), allow_dirty=True)


# ---------------------------------------------------------------- parts

TWO = ["batched_ops", "async_logging"]


def _shape(result: dict) -> tuple:
    """What must be the same however a ladder file was recorded: its keys, its rows by
    (section, stage, N), and each row's keys."""
    rows = {(section, r["stage"], r["n_envs"]): tuple(sorted(r))
            for section in ("ladder", "scaling") for r in result[section]}
    return tuple(sorted(result)), rows


def _record(out, parts, **kwargs):
    return record(torch.device("cpu"), "tiny", out, parts=parts, notebooks="none",
                  allow_dirty=True, stages=TWO, say=lambda line: None, **kwargs)


@pytest.mark.slow
def test_parts_recorded_one_by_one_merge_into_what_one_run_writes(tmp_path):
    whole, split, apart = tmp_path / "whole", tmp_path / "split", tmp_path / "apart"
    _record(whole, "ladder,scaling", run="one")
    for part in ("ladder-3", "ladder-4", "scaling-8"):  # three commands, one run
        _record(split, part, run="same")
    _record(apart, "ladder-3")  # two commands, each its own run
    _record(apart, "scaling,ladder-4")
    name = "ladder_cpu_tiny.json"
    a, b, c = (json.loads((d / name).read_text()) for d in (whole, split, apart))
    assert _shape(a) == _shape(b) == _shape(c)
    assert [(r["stage"], r["n_envs"]) for r in a["ladder"]] == [(3, 8), (4, 8)]
    assert [(r["stage"], r["n_envs"]) for r in a["scaling"]] == [(3, 8), (4, 8)]
    assert set(a["runs"]) == {"one"} and set(b["runs"]) == {"same"} and len(c["runs"]) == 2
    assert b["runs"]["same"]["parts"] == ["ladder-3", "ladder-4", "scaling-8"]
    # ratios divide rows of one run only
    for result in (a, b):
        assert result["ladder"][1]["x_vs_prev"] == pytest.approx(
            result["ladder"][1]["sps"] / result["ladder"][0]["sps"])
    assert c["ladder"][1]["x_vs_prev"] is None
    assert "come from 2 runs" in results_markdown(apart)
    # a part recorded again replaces its rows and keeps the others
    _record(split, "ladder-4", run="again")
    d = json.loads((split / name).read_text())
    assert [r["run"] for r in d["ladder"]] == ["same", "again"] and _shape(d) == _shape(b)
    # a run none of whose rows is left is no longer listed
    _record(apart, "ladder,scaling", run="last")
    e = json.loads((apart / name).read_text())
    assert set(e["runs"]) == {"last"} and "come from" not in results_markdown(apart)
    log = json.loads((split / "record_log_cpu_tiny.json").read_text())["parts"]
    assert {k: v["status"] for k, v in log.items()} == dict.fromkeys(
        ("ladder-3", "ladder-4", "scaling-8"), "done")
    assert log["ladder-4"]["run"] == "again" and log["ladder-4"]["seconds"] > 0


@pytest.mark.slow
def test_an_interrupted_batch_keeps_the_rows_of_the_batches_that_finished(tmp_path,
                                                                          monkeypatch):
    """The ladder parts of one command are one batch, timed together in interleaved rounds:
    a stop in it keeps what earlier commands (or batches) wrote, and the batch runs again."""
    import labkit.measure.bench

    measure = labkit.measure.bench.measure_stages

    def stopped_at_stage_4(stages, *args, **kwargs):
        if any(s.index == 4 for s in stages):
            raise KeyboardInterrupt
        return measure(stages, *args, **kwargs)

    _record(tmp_path, "scaling", run="cut")
    swept = json.loads((tmp_path / "ladder_cpu_tiny.json").read_text())["scaling"]
    monkeypatch.setattr(labkit.measure.bench, "measure_stages", stopped_at_stage_4)
    with pytest.raises(KeyboardInterrupt):
        _record(tmp_path, "ladder-3,ladder-4", run="cut")
    result = json.loads((tmp_path / "ladder_cpu_tiny.json").read_text())
    assert result["ladder"] == [] and result["scaling"] == swept and swept[0]["sps"] > 0
    assert result["runs"]["cut"]["interrupted"] == {"signal": "SIGINT",
                                                    "part": "ladder-3,ladder-4"}
    log = json.loads((tmp_path / "record_log_cpu_tiny.json").read_text())["parts"]
    assert [log[p]["status"] for p in ("scaling-8", "ladder-3", "ladder-4")] == [
        "done", "interrupted", "interrupted"]
    # the batch, recorded again, completes the file with its stages interleaved
    monkeypatch.setattr(labkit.measure.bench, "measure_stages", measure)
    _record(tmp_path, "ladder-3,ladder-4", run="cut")
    result = json.loads((tmp_path / "ladder_cpu_tiny.json").read_text())
    assert [r["stage"] for r in result["ladder"]] == [3, 4]
    assert [r["interleaved"] for r in result["ladder"]] == [2, 2]
    assert result["scaling"] == swept


@pytest.mark.slow
def test_a_signal_during_record_keeps_the_rows_and_exits_128_plus_n(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "labkit", "record", "--device", "cpu", "--profile", "tiny",
           "--part", "ladder-3,scaling-8", "--allow-dirty", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    path = out / "ladder_cpu_tiny.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(path.read_text())["ladder"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    result = json.loads(path.read_text())
    assert len(result["ladder"]) == 1 and len(result["scaling"]) < 6
    (run,) = result["runs"].values()
    assert run["interrupted"]["signal"] == "SIGTERM"


def test_the_plan_fits_every_command_in_the_budget(tmp_path, capsys):
    cuda = torch.device("cuda")  # only named: nothing runs
    parts = plan("full")
    text = format_plan(parts, cuda, "full", tmp_path)
    rows = estimates(parts, cuda, "full", tmp_path)
    assert all(minutes is not None for _, minutes, _ in rows)  # every GPU part is estimated
    groups = commands(rows)
    assert [n for names, _ in groups for n in names] == [p.name for p in parts]
    assert all(minutes <= PART_BUDGET_MIN for _, minutes in groups)
    assert "estimate, not measured" in text
    assert f"--part {','.join(groups[0][0])}" in text
    # a part that ran is shown with its measured time instead
    (tmp_path / "record_log_cuda_full.json").write_text(json.dumps({"parts": {"ladder-0": {
        "seconds": 120.0, "status": "done", "date": "2026-11-24T10:00:00+00:00",
        "device_name": "NVIDIA H100"}}}))
    part, minutes, source = estimates(parts, cuda, "full", tmp_path)[0]
    assert (part.name, minutes) == ("ladder-0", 2.0) and "measured 2026-11-24" in source
    # a part cut short took at least that long: it goes alone, whatever the estimate said
    (tmp_path / "record_log_cuda_full.json").write_text(json.dumps({"parts": {"ladder-0": {
        "seconds": 120.0, "status": "interrupted", "date": "2026-11-24T10:00:00+00:00",
        "device_name": "NVIDIA H100"}}}))
    rows = estimates(parts, cuda, "full", tmp_path)
    part, minutes, source = rows[0]
    assert minutes == PART_BUDGET_MIN and "cut short after 2.0 min" in source
    assert commands(rows)[0][0] == ["ladder-0"]
    # the CLI prints it and runs nothing
    assert cli.main(["record", "--device", "cpu", "--plan", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("record plan: cpu, profile quick") and "ladder-8" in out
    assert not (tmp_path / "ladder_cpu_quick.json").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--part", ""], "parts (--parts) must name at least one part"),
    (["--part", "ladder-9"], "parts (--parts) must be among"),
    (["--run", "a b"], "--run must be 1-64 letters"),
])
def test_record_usage_errors_exit_2(tmp_path, capsys, argv, needle):
    try:
        code = cli.main(["record", "--device", "cpu", "--out", str(tmp_path), *argv])
    except SystemExit as stop:  # argparse's refusals (a flag's type)
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_run_id_is_refused_on_another_machine(tmp_path):
    _record(tmp_path, "ladder-3", run="r1")
    path = tmp_path / "ladder_cpu_tiny.json"
    data = json.loads(path.read_text())
    data["runs"]["r1"]["meta"]["torch"] = "1.0.0"
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match="--run r1 was recorded with"):
        _record(tmp_path, "ladder-4", run="r1")


def test_a_tree_without_git_names_its_commit(monkeypatch, cpu):
    from labkit.device import git_commit, run_metadata

    monkeypatch.setenv("LABKIT_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert git_commit() == "0123456"
    meta = run_metadata(cpu)
    assert meta["git_commit"] == "0123456"
    assert meta["git_commit_source"].startswith("LABKIT_GIT_COMMIT (the tree was not checked")
    monkeypatch.setenv("LABKIT_GIT_COMMIT", "")
    assert run_metadata(cpu)["git_commit_source"] == "git"


def test_one_row_model_renders_text_and_markdown_alike():
    """Each results table is defined once (labkit.measure.tables): its text and Markdown
    renderings show the same cells, and a row that did not run shows its keys and its status."""
    from labkit.measure import tables

    ok = {"stage": 3, "name": "batched_ops", "n_envs": 32, "sps": 5047.2, "x_vs_stage0": 2.94,
          "x_vs_prev": None, "host_reads_per_iter": 294, "warmup_s": 0.4, "ceiling_sps": 8974.0,
          "frac_of_ceiling": 0.562, "frac_of_peak": None, "precision": "fp32", "status": "ok"}
    skipped = {"stage": 8, "name": "cuda_graphs", "n_envs": 32, "status": "skipped: needs CUDA"}
    text = tables.LADDER.text([ok, skipped]).splitlines()
    md = tables.LADDER.markdown([ok, skipped]).splitlines()
    # a row without a spread, a verdict, the device / host-scalar split or the kernel counts
    # (an older record): a dash where a figure was never measured, never 0
    cells = ["3", "batched_ops", "32", "5,047", "-", "2.9", "-", "\u2014", "\u2014", "\u2014",
             "\u2014", "0.40", "8,974", "56.2", "-", "fp32"]
    assert text[2].split() == cells
    assert [c.strip() for c in md[2].strip("|").split("|")] == [*cells, "", ""]  # math, noise
    assert text[3].split() == ["8", "cuda_graphs", "32", "skipped:", "needs", "CUDA"]
    assert md[3].startswith("| 8 | cuda_graphs | 32 | skipped: needs CUDA |")
    # a CPU table leaves out the CUDA syncs column (no row has the figure), a table of rows at
    # one T its T column (no row was bounded to fewer steps), and rows that predate the
    # update's share of peak that column
    assert md[3].count("|") == md[0].count("|") == len(tables.LADDER.columns) - 2
    assert "cuda/it" not in text[0] and "CUDA syncs" not in md[0]
    assert text[0].split()[:4] == ["#", "stage", "N", "sps"]
    assert len(text[0]) == len(text[1])  # the rule is as wide as the header
    # a GPU row shows every sync CUDA reported beside its device reads (pageable copies wait)
    gpu = {**ok, "device_reads_per_iter": 392, "cuda_syncs_per_iter": 1035}
    head, _, row = tables.LADDER.text([gpu, skipped]).splitlines()[:3]
    assert head.split()[9:11] == ["syncs/it", "cuda/it"] and row.split()[7:9] == ["392", "1035"]
    md = tables.LADDER.markdown([gpu]).splitlines()
    assert md[0].count("|") == len(tables.LADDER.columns) - 1 and "| 392 | 1035 |" in md[2]
    page = tables.LADDER.html([ok, skipped])  # what a chapter displays: the same cells
    import html as html_module
    import re
    rows = [[html_module.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", tr)]
            for tr in re.findall(r"<tr>(.*?)</tr>", page)[1:]]
    assert rows == [[*cells, "", ""], ["8", "cuda_graphs", "32", "skipped: needs CUDA"]]
    assert page.startswith("<div style='overflow-x:auto'>")


@pytest.mark.parametrize("part", [pytest.param("learning", marks=pytest.mark.slow),
                                  "bench_env"])
def test_a_signal_in_a_learning_or_bench_env_part_exits_128_plus_n(tmp_path, monkeypatch,
                                                                   capsys, part):
    """C-record-SIGTERM: a SIGTERM while the learning part trains its second stage keeps the
    first stage's curve; while bench_env times its rounds, no half-run file is recorded."""
    import labkit.app.train
    import labkit.measure.envbench

    owner, name, call = ((labkit.app.train, "build_pipeline", 2) if part == "learning" else
                         (labkit.measure.envbench, "timed", 2))
    real, calls = getattr(owner, name), []

    def signal_then_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, signal_then_call)
    out = tmp_path / "results"
    code = cli.main(["record", "--device", "cpu", "--profile", "tiny", "--notebooks", "none",
                     "--parts", part, "--allow-dirty", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM and "interrupted by SIGTERM" in err, err
    assert "Traceback" not in err
    log = json.loads((out / "record_log_cpu_tiny.json").read_text())["parts"]
    assert log[part]["status"] == "interrupted"
    if part == "learning":
        result = json.loads((out / "learning_cpu_tiny.json").read_text())
        assert list(result["stages"]) == ["numpy_vec"]
    else:
        assert not (out / "bench_env_cpu_tiny.json").exists()


def _widget_notebook() -> dict:
    """A stored notebook as nbclient leaves it: a tqdm bar (an HBox of label, bar and counts,
    its text fallback the first frame) and a form, and the widget state in the metadata."""
    def model(name, **state):
        return {"model_name": name, "model_module": "@jupyter-widgets/controls",
                "model_module_version": "2.0.0", "state": state}

    state = {"bar": model("HBoxModel", children=["IPY_MODEL_a", "IPY_MODEL_b", "IPY_MODEL_c"]),
             "a": model("HTMLModel", value="ladder:\u2007100%"),
             "b": model("FloatProgressModel", value=9.0, max=9.0),
             "c": model("HTMLModel", value="\u20079/9\u2007[00:34&lt;00:00]"),
             "form": model("VBoxModel", children=[])}

    def view(model_id, text):
        return {"output_type": "display_data", "metadata": {}, "data": {
            "application/vnd.jupyter.widget-view+json": {"model_id": model_id,
                                                         "version_major": 2},
            "text/plain": text}}

    return {"metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {
                "state": state, "version_major": 2}}},
            "cells": [{"cell_type": "code", "outputs": [view("bar", "ladder: 0stage [00:00]"),
                                                        view("form", "controls: open it")]}]}


def test_a_stored_widget_keeps_what_it_showed_and_no_widget_state():
    from labkit.app.notebooks import strip_widgets

    nb = strip_widgets(_widget_notebook())
    bar, form = nb["cells"][0]["outputs"]
    assert bar["data"] == {"text/plain": "ladder: 100%|" + "\u2588" * 10 + "| 9/9 [00:34<00:00]"}
    assert form["data"] == {"text/plain": "controls: open it"}
    assert "widgets" not in nb["metadata"]


@pytest.mark.parametrize("path", sorted(
    (Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.ipynb")),
    ids=lambda p: p.stem)
def test_no_stored_notebook_holds_widget_state(path):
    """make record strips it (labkit.app.notebooks.strip_widgets): a stored widget renders blank
    or as its first frame wherever no kernel runs (a static page, GitHub)."""
    text = path.read_text(encoding="utf-8")
    assert "application/vnd.jupyter.widget-view+json" not in text
    assert "application/vnd.jupyter.widget-state+json" not in text


def test_a_print_flushed_in_two_parts_is_stored_as_one_output():
    """The kernel may send a print's text and its newline as two stream outputs (chapter 02
    was stored so, and its page showed a blank output): the recorder keeps one output per run
    of the same stream, the text whole; stderr and other outputs stay apart."""
    from labkit.app.notebooks import merge_streams

    def stream(name, text):
        return {"output_type": "stream", "name": name, "text": text}

    result = {"output_type": "execute_result", "data": {"text/plain": "1"}}
    nb = {"cells": [{"cell_type": "code", "outputs": [
        stream("stdout", ["skipped: needs CUDA"]), stream("stdout", ["\n"]),
        stream("stderr", "a warning\n"), result, stream("stdout", "a\n"),
        stream("stdout", ["b\n", "c\n"])]}, {"cell_type": "markdown"}]}
    outs = merge_streams(nb)["cells"][0]["outputs"]
    assert outs == [stream("stdout", "skipped: needs CUDA\n"), stream("stderr", "a warning\n"),
                    result, stream("stdout", "a\nb\nc\n")]


@pytest.mark.slow
def test_a_notebook_executed_for_a_gpu_copy_leaves_the_chapter_as_ci_compares_it(tmp_path):
    """``record --device cuda --part notebook-NN`` writes chapter NN's GPU copy: executed in
    the chapter's folder (its relative paths as there), written to the copy, stamped with
    the device, its name, torch and the commit; the chapter itself is not touched."""
    import nbformat

    from labkit.app.notebooks import execute_notebook

    chapters = tmp_path / "notebooks"
    chapters.mkdir()
    (chapters / "data.txt").write_text("read from the chapter's folder")
    path = chapters / "07_x.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "print(open('data.txt').read())")])
    nbformat.write(nb, path)
    before = path.read_bytes()
    out = execute_notebook(path, torch.device("cpu"), "abc1234",
                           out=tmp_path / "results" / "chapters_cuda" / path.name)
    assert path.read_bytes() == before and out.parent.name == "chapters_cuda"
    copy = nbformat.read(out, as_version=4)
    assert copy.cells[0].outputs[0]["text"] == "read from the chapter's folder\n"
    stamp = copy.metadata["labkit"]
    assert (stamp["device"], stamp["git_commit"], stamp["torch"]) == ("cpu", "abc1234",
                                                                      torch.__version__)
    assert stamp["device_name"]
