"""The ``ladder`` command (``labkit/app/ladder.py``): every size is checked before the first is
measured, and a stop keeps what finished. Sections 7 and 8 of the reliability issue."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.runs import run_cli


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
