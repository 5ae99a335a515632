"""The harness's noise verdict (labkit.measure.noise): synthetic timings, then once for real."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from labkit.measure import noise, tables
from labkit.measure.bench import format_noise

NOISY = [0.10, 0.12, 0.20, 0.21, 0.12]  # middle half: 0.12 to 0.20, 67% of the median 0.12


def _row(samples=(0.10, 0.10, 0.11, 0.10, 0.10), ceiling=0.5, ab=0.02, wait=0.001,
         **extra) -> dict:
    lo, mid, hi = min(samples), sorted(samples)[len(samples) // 2], max(samples)
    return {"status": "ok", "stage": 3, "name": "batched_ops", "n_envs": 32,
            "iteration_s_samples": list(samples), "iteration_s_spread": [lo, mid, hi],
            "sps_spread": [1 / hi, 1 / mid, 1 / lo],
            "frac_of_ceiling": ceiling, "marks_ab": ab, "wait_share": wait,
            "wait_source": "schedstat", **extra}


def test_a_quiet_row_has_no_reason():
    assert noise.verdict(_row()) == []
    assert noise.judge(_row())["noisy"] is False


@pytest.mark.parametrize("row, needle", [
    (_row(NOISY), "the middle half of the iterations spans 67% of their median (> 25%)"),
    (_row([0.10, 0.15, 0.22]), "the middle half of the iterations spans 40% of their median"),
    (_row(ceiling=1.34), "faster than its own compute ceiling (134% of it)"),
    (_row(ab=2.3), "marked and plain iterations +230% apart"),
    (_row(ab=-0.4), "marked and plain iterations -40% apart"),
    (_row(wait=0.27), "waited for a CPU 27% of its time (> 10%, schedstat)"),
])
def test_each_sign_of_noise_marks_the_row(row, needle):
    reasons = noise.verdict(row)
    assert len(reasons) == 1 and reasons[0].startswith(needle), reasons
    assert noise.judge(row)["noisy"] is True


def test_one_stray_iteration_of_five_does_not_make_a_row_noisy():
    assert noise.spread([0.10, 0.10, 0.10, 0.10, 0.30]) == 0.0
    assert noise.verdict(_row([0.10, 0.10, 0.30, 0.10, 0.10])) == []
    assert noise.spread([1.0]) == 0.0 and noise.spread([0.1, 0.3]) == pytest.approx(0.5)


def test_bounds_are_exclusive_and_missing_figures_are_not_judged():
    at_bounds = _row([0.1, 0.1, 0.1, 0.12, 0.12], ceiling=1.0,
                     ab=noise.AB_BOUND, wait=noise.WAIT_BOUND)
    assert noise.verdict(at_bounds) == []
    assert noise.verdict({"status": "ok"}) == []
    skipped = noise.judge({"status": "skipped: needs CUDA"})
    assert "noisy" not in skipped


def test_the_run_verdict_counts_rows_and_reads_the_load():
    rows = [noise.judge(_row()), noise.judge(_row(wait=0.3)), {"status": "skipped: x"}]
    quiet = noise.summary(rows[:1], 0.2, 0.9, 2)
    assert quiet["noisy_rows"] == 0 and "nothing says these numbers are off" in quiet["line"]
    busy = noise.summary(rows, 3.5, 1.0, 2)
    assert (busy["noisy_rows"], busy["rows"]) == (1, 2)
    assert busy["line"].startswith("noise: 1 of 2 measured rows noisy; load above the 2 cores "
                                   "(before 3.5)") and noise.ADVICE in busy["line"]
    fewer = noise.summary(rows[:1], 0.2, 0.9, 2, {"threads": 1, "cores": 2,
                                                  "others_running": 1, "chosen_by": "free cores"})
    assert fewer["line"].endswith("Timed with 1 thread(s) of 2 because 1 other process(es) kept "
                                  "running: compare these rows with runs at --threads 1, not "
                                  "with a quiet run on all cores")
    text = format_noise({"ladder": rows, "scaling": [], "noise": busy})
    assert text.splitlines()[0].startswith("noisy: batched_ops N=32: waited for a CPU 30%")


def test_tables_show_the_spread_and_the_mark():
    row = {**noise.judge(_row(NOISY)), "sps": 8.3, "x_vs_stage0": None,
           "x_vs_prev": None, "host_reads_per_iter": 1, "warmup_s": 0.1, "ceiling_sps": 9.0,
           "precision": "fp32", "model_math": {"rollout": "eager", "update": "compiled"},
           "executor_choices": {"update": {"kept": "compiled", "why": "timed"}}}
    text = tables.LADDER.text([row]).splitlines()
    assert text[0].split()[4] == "IQR%" and text[2].split()[4] == "67"
    assert text[2].split()[-1] == "noisy"
    assert tables.LADDER.markdown([row]).splitlines()[2].endswith("| fp32 | e/c* | noisy |")
    forced = {**row, "executor_choices": {"update": {"kept": "compiled",
                                                     "why": "compile=compiled"}}}
    assert tables.LADDER.markdown([forced]).splitlines()[2].endswith("| fp32 | e/c | noisy |")
    old = {k: v for k, v in row.items() if k not in ("model_math", "executor_choices")}
    assert tables.LADDER.markdown([old]).splitlines()[2].endswith("| fp32 |  | noisy |")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_wait_meter_reads_the_kernel_and_counts_a_sleep_as_no_wait():
    with noise.Wait() as w:
        time.sleep(0.05)
    assert w.source == ("schedstat" if os.path.exists("/proc/self/task") else "cpu_time")
    assert w.wall_s >= 0.05
    if w.source == "schedstat":
        assert w.share < 0.5  # asleep is not runnable: no run-queue wait


def test_threads_choice_is_recorded_and_overridable(cpu):
    saved = torch.get_num_threads()
    try:
        note = noise.choose_threads(cpu, 1)
        assert note["threads"] == torch.get_num_threads() == 1 and note["chosen_by"] == "--threads"
        note = noise.choose_threads(cpu)
        assert 1 <= note["threads"] <= note["cores"] == noise.cores()
        assert note["threads"] == max(1, note["cores"] - note["others_running"])
    finally:
        torch.set_num_threads(saved)


@pytest.mark.slow
def _spin_when_started(seconds: float, started) -> None:
    started.release()
    _spin(seconds)


@pytest.mark.slow
def test_a_planted_busy_neighbour_shows_as_run_queue_wait():
    """For real: as many spinning processes as this process may use cores make a spinning
    thread of ours wait for a CPU, beyond the verdict's bound. (A spawned process imports this
    file, torch with it, before it spins: seconds on a busy 2-core CI machine, where a fixed
    0.3 s wait once read 0 neighbours; each says when it starts.)"""
    if not os.path.exists("/proc/self/task"):
        pytest.skip("needs /proc (Linux)")
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Semaphore(0)
    hogs = [ctx.Process(target=_spin_when_started, args=(3.0, started), daemon=True)
            for _ in range(noise.cores())]
    for h in hogs:
        h.start()
    try:
        for _ in hogs:
            assert started.acquire(timeout=60), "a spinning process did not start in 60 s"
        time.sleep(0.1)
        assert noise.others_running() >= 1
        with noise.Wait() as busy:
            _spin(0.6)
    finally:
        for h in hogs:
            h.terminate()
            h.join()
    assert busy.share > noise.WAIT_BOUND, busy
