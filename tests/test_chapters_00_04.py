"""Helpers chapters 00-04 use: call sites named alike everywhere, before/after tables,
Amdahl's bound from a phase breakdown, time per iteration over N."""
from collections import Counter

import pytest
import torch

from labkit.book.show import group_sites, rows_table
from labkit.measure.syncmeter import SyncMeter
from labkit.timing import PHASES, amdahl_sps


def _two_reads_per_element(x: torch.Tensor) -> int:
    kept = 0
    for v in x:
        if v > 0:  # a read: __bool__
            kept += int(v)  # a read: __int__
    return kept


def test_group_sites_names_cells_and_drops_lines_and_torch_frames():
    sites = Counter({
        "/tmp/ipykernel_4242/1234567.py:7 (f)": 3,
        "/tmp/ipykernel_4242/1234567.py:9 (f)": 2,
        "labkit/ppo.py:213 (minibatch_step) via torch/optim/optimizer.py:95": 160,
        "<unknown>": 1,
    })
    assert group_sites(sites) == Counter({"<cell> (f)": 5, "labkit/ppo.py (minibatch_step)": 160,
                                          "<unknown>": 1})
    assert group_sites(sites, lines=True) == Counter({
        "<cell>:7 (f)": 3, "<cell>:9 (f)": 2, "labkit/ppo.py:213 (minibatch_step)": 160,
        "<unknown>": 1})


def test_group_sites_counts_a_real_meter_exactly():
    x = torch.tensor([3, -1, 2, 0, 5])
    with SyncMeter(call_sites=True) as m:
        assert _two_reads_per_element(x) == 10
    assert m.counts == Counter({"__bool__": 5, "__int__": 3})
    assert group_sites(m.sites) == Counter(
        {"tests/test_chapters_00_04.py (_two_reads_per_element)": 8})


def _row(stage, n, t, spread, phases, status="ok"):
    return {"stage": stage, "name": f"s{stage}", "n_envs": n, "n_steps": t, "status": status,
            "iteration_s_spread": spread, "frac_of_ceiling": 0.5, "phase_ms": phases,
            "device_reads_rollout_per_step": 2.5, "device_reads_update": 6,
            "host_scalar_reads_per_iter": 160}


def test_rows_table_gives_sps_min_median_max_from_the_iteration_spread():
    rows = [_row(0, 4, 25, [0.5, 1.0, 2.0], {"env": 1.0, "update": 3.0}),
            _row(8, 4, 25, None, {}, status="skipped: needs CUDA")]
    lines = rows_table(rows).splitlines()
    # 100 samples: slowest iteration (2 s) -> 50 sps, median 100, fastest 200
    assert lines[1].split() == ["0", "s0", "4", "25", "50", "100", "200", "50.0%", "2.5", "6",
                                "160"]
    assert lines[2].split() == ["8", "s8", "4", "25", "skipped:", "needs", "CUDA"]
    assert lines[4].split() == ["ms", "per", "iteration", "env", "update"]
    assert lines[5].split() == ["0", "s0", "1.0", "3.0"]


def test_amdahl_bound_removes_the_free_phases_only():
    phases = {"policy": 100.0, "env": 300.0, "io": 50.0, "gae": 50.0, "update": 500.0}
    assert amdahl_sps(phases, 1000, free=()) == pytest.approx(1000)  # 1 s per iteration
    rollout = tuple(k for k in PHASES if k != "update")
    assert amdahl_sps(phases, 1000, free=rollout) == pytest.approx(2000)
    assert amdahl_sps(phases, 1000, free=("update",)) == pytest.approx(2000)
    with pytest.raises(ValueError, match="free must name phases"):
        amdahl_sps(phases, 1000, free=("rollout",))
    with pytest.raises(ValueError, match="nothing is left"):
        amdahl_sps({"update": 5.0}, 1000, free=("update",))


@pytest.mark.slow
def test_time_over_n_draws_iteration_ceiling_and_proportional_lines():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.book.plots import time_over_n

    rows = [{"status": "ok", "n_envs": n, "n_steps": 10, "iteration_s": s, "ceiling_sps": c}
            for n, s, c in ((8, 0.1, 1600), (32, 0.12, 6400), (128, 0.3, 12800))]
    rows.append({"status": "skipped: needs CUDA", "n_envs": 512})
    ax = time_over_n(rows)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["one PPO iteration"].get_ydata()) == pytest.approx([100, 120, 300])
    assert list(lines["model work alone (ceiling)"].get_ydata()) == pytest.approx([50, 50, 100])
    assert list(lines["proportional to N"].get_ydata()) == pytest.approx([100, 400, 1600])
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()


def test_reads_by_line_keys_each_read_by_its_line_of_code():
    from labkit.book.show import reads_by_line

    x = torch.tensor([3, -1, 2, 0, 5])
    with SyncMeter(call_sites=True) as m:
        _two_reads_per_element(x)
    where = "tests/test_chapters_00_04.py (_two_reads_per_element): "
    assert reads_by_line(m.sites) == Counter({
        where + "if v > 0:  # a read: __bool__": 5,
        where + "kept += int(v)  # a read: __int__": 3})
    assert reads_by_line({"<unknown>": 2, "/nowhere.py:3 (f)": 1}) == Counter(
        {"<unknown>": 2, "/nowhere.py (f): line 3": 1})


def test_amdahl_bound_and_the_rate_it_bounds_come_from_the_same_iterations():
    """The unmarked iterations ran faster than the marked ones here: a bound from the marked
    phases would fall below the headline rate, but never below the marked iterations' own."""
    from labkit.timing import amdahl

    phases = [{"env": 300.0, "update": 600.0}, {"env": 320.0, "update": 640.0},
              {"env": 280.0, "update": 700.0}]
    row = {"n_envs": 10, "n_steps": 100, "sps": 1200.0, "phase_ms_samples": phases,
           "marked_iteration_s_samples": [0.95, 1.0, 1.05]}
    bound, rate = amdahl(row, free=("env",))
    assert bound == pytest.approx(1000 / 0.64) and rate == pytest.approx(1000)
    assert bound >= rate
    assert amdahl_sps({"update": 640.0}, 1000, free=()) < row["sps"] * 1.4
    with pytest.raises(ValueError, match="phase_ms_samples"):
        amdahl({"n_envs": 1, "n_steps": 1}, free=("env",))


def _chapter_function(notebook: str, name: str):
    """The function ``name`` that a chapter defines in one of its cells, on its own: the
    sentences a chapter prints from its data are tested with data where the order flips."""
    import ast
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "notebooks" / notebook
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.parse("".join(cell["source"])).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                namespace: dict = {}
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
                return namespace[name]
    raise LookupError(f"{notebook} defines no {name}")


def test_chapter_00_says_which_layer_won_either_way():
    verdict = _chapter_function("00_measure_first.ipynb", "compile_verdict")
    slower, faster = verdict(0.569e-3, 0.437e-3), verdict(0.3e-3, 0.6e-3)
    assert slower.startswith("compiled is not faster here (1.30x eager's time)")
    assert faster.startswith("compiled is faster here (2.00x eager's speed)")
    assert "overhead (guards, wrapper)" in slower and "overhead (guards, wrapper)" in faster


def test_chapter_00_reads_rising_or_flattening_from_the_sweep():
    verdict = _chapter_function("00_measure_first.ipynb", "scaling_verdict")

    def rows(*sps):
        return [{"status": "ok", "name": "s", "n_envs": n, "sps": v}
                for n, v in zip((16, 64, 256), sps)]

    rising = verdict(rows(4766, 8484, 15175) + [{"status": "skipped: needs CUDA", "name": "g"}])
    assert "s               env steps/s x1.78 to N=64 (N x4), x1.79 to N=256 (N x4): rises " \
           "at every N" in rising
    assert "none flattens in this range" in rising and "none grows as fast as N" in rising
    flat = verdict(rows(4000, 16000, 17000))
    assert "s               env steps/s x4.00 to N=64 (N x4), x1.06 to N=256 (N x4): " \
           "flattens from N=256" in flat
    assert "1 of 1 stages flatten" in flat and "1 step(s) grow as fast as N" in flat


def test_chapter_01_calls_stage_0_overhead_bound_only_when_the_ceiling_says_so():
    verdict = _chapter_function("01_the_python_loop.ipynb", "overhead_verdict")
    low, high = verdict(0.34, 14, 179_808), verdict(0.8, 14, 179_808)
    assert low.startswith("stage 0 reached 34% of its compute ceiling: most of an iteration "
                          "(66%) is not model work. Overhead-bound")
    assert high.startswith("stage 0 reached 80% of its compute ceiling: most of an iteration is "
                           "model work here") and "Overhead-bound" not in high
    assert "each env adds 14 kernels per step for 180 kFLOP" in low and "12.8 kFLOP" in high
