"""make record / labkit report: one record writes every promised file with one commit, and the
README's results section is the report generator's output, byte for byte."""
import json
from pathlib import Path

import pytest
import torch

from labkit.record import (
    README_BEGIN,
    README_END,
    RecordError,
    readme_section,
    record,
    results_markdown,
)

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    said = []
    seconds = record(torch.device("cpu"), "tiny", out,
                     parts=("ladder", "bench_env", "learning", "report"), notebooks="none",
                     allow_dirty=True, stages=["batched_ops", "async_logging"],
                     say=said.append)
    return out, seconds, said


def test_record_writes_every_promised_file_with_one_commit(recorded):
    out, seconds, said = recorded
    assert list(seconds) == ["ladder", "bench_env", "learning", "report"]
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


def test_record_refuses_modified_code(monkeypatch, tmp_path):
    import labkit.record
    monkeypatch.setattr(labkit.record, "_dirty_code", lambda: ["labkit/stages.py"])
    with pytest.raises(RecordError, match="labkit/stages.py"):
        record(torch.device("cpu"), "tiny", tmp_path, parts=("report",))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RecordError, match="parts must be among"):
        record(torch.device("cpu"), "tiny", tmp_path, parts=("everything",), allow_dirty=True)
