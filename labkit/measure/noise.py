"""When a timing cannot be trusted, and how many CPU threads to time with.

A shared machine slows a timed loop in ways its own numbers do not show. What the kernel says
about each timed iteration does: ``/proc/self/task/*/schedstat`` holds, per thread, the
nanoseconds it ran and the nanoseconds it was runnable but waited for a CPU (the run-queue
wait). Summed over the process's threads around a timed loop, the wait says how much of that
loop the process was ready to run and could not. Where ``/proc`` is absent (macOS, Windows),
CPU time against wall time (``os.times``) stands in, and the row says which source it used.

``verdict`` turns a row's figures into reasons it is noisy: samples spread beyond a bound, a
stage faster than its own compute ceiling, phase-marked and plain iterations apart beyond a
bound, the process waiting for a CPU beyond a bound. ``choose_threads`` picks torch's intra-op
thread count for the CPU so that a busy neighbour cannot make every parallel op wait for it.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

#: Bounds of the verdict: a row past any of them is marked noisy.
SPREAD_BOUND = 0.25      # interquartile range of the timed iterations / their median
WAIT_BOUND = 0.10        # run-queue wait / wall time of the timed iterations (see below)
CEILING_BOUND = 1.0      # iteration time / compute ceiling's time (a stage cannot beat its work)
AB_BOUND = 0.25          # |marked / plain - 1|

# The wait bound sits above what a stage's own threads cause: on a quiet 2-core machine, an
# async logger's thread beside torch's 2 intra-op threads waited up to 7.5% of the wall time;
# beside one busy process, 2 intra-op threads waited 69-78% (issue 28's measurements).

ADVICE = ("close what else is running (a browser, a build, another benchmark), or give the "
          "harness fewer threads (--threads 1), then run it again; compare only rows not "
          "marked noisy")


def _task_stats() -> dict[str, tuple[int, int]] | None:
    """{thread id: (ns on a CPU, ns runnable but waiting)} for this process, None without
    ``/proc``."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    stats = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                ran, waited = f.read().split()[:2]
        except (OSError, ValueError):
            continue  # the thread ended between the listing and the read
        stats[tid] = (int(ran), int(waited))
    return stats or None


@dataclass
class Wait:
    """Run-queue wait around a block: ``with Wait() as w: ...``; then ``w.share`` is the
    wait (summed over threads) over the block's wall time, and ``w.source`` says how it was
    measured: "schedstat", or "cpu_time" (1 - CPU time / wall time of the main thread's
    process, a coarser stand-in that also counts time blocked on I/O)."""

    seconds: float = 0.0
    wall_s: float = 0.0
    source: str = "schedstat"

    def __enter__(self) -> Wait:
        self._tasks = _task_stats()
        self.source = "schedstat" if self._tasks is not None else "cpu_time"
        self._cpu = sum(os.times()[:2])
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        if self._tasks is not None:
            now = _task_stats() or {}
            # A thread born inside the block counts from 0; one that ended is lost (rare).
            self.seconds = sum(w - self._tasks.get(tid, (0, 0))[1]
                               for tid, (_, w) in now.items()) / 1e9
        else:
            cpu = sum(os.times()[:2]) - self._cpu
            self.seconds = max(0.0, self.wall_s - cpu)

    @property
    def share(self) -> float:
        return self.seconds / self.wall_s if self.wall_s > 0 else 0.0


def spread(samples: list[float]) -> float:
    """The interquartile range of ``samples`` over their median: how widely the middle half
    of them disagrees (one stray sample of five moves it little; 0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, mid, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / mid if mid > 0 else 0.0


def verdict(row: dict) -> list[str]:
    """Why ``row`` (a measured ladder or scaling row) cannot be trusted; [] if nothing says so.
    It reads ``iteration_s_samples`` (seconds of the timed iterations), ``frac_of_ceiling``,
    ``marks_ab`` and ``wait_share``; a figure the row lacks is not judged."""
    reasons = []
    apart = spread(row.get("iteration_s_samples") or [])
    if apart > SPREAD_BOUND:
        reasons.append(f"the middle half of the iterations spans {100 * apart:.0f}% of their "
                       f"median (> {100 * SPREAD_BOUND:.0f}%)")
    if row.get("frac_of_ceiling", 0.0) > CEILING_BOUND:
        reasons.append(f"faster than its own compute ceiling "
                       f"({100 * row['frac_of_ceiling']:.0f}% of it)")
    if abs(row.get("marks_ab", 0.0)) > AB_BOUND:
        reasons.append(f"marked and plain iterations {100 * row['marks_ab']:+.0f}% apart "
                       f"(> {100 * AB_BOUND:.0f}%)")
    if row.get("wait_share", 0.0) > WAIT_BOUND:
        reasons.append(f"waited for a CPU {100 * row['wait_share']:.0f}% of its time "
                       f"(> {100 * WAIT_BOUND:.0f}%, {row.get('wait_source', 'schedstat')})")
    return reasons


def judge(row: dict) -> dict:
    """``row`` with ``noisy`` (bool) and ``noise`` (its reasons) set, if it was measured."""
    if row.get("status") == "ok":
        row["noise"] = verdict(row)
        row["noisy"] = bool(row["noise"])
    return row


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def load() -> float | None:
    """The machine's 1-minute load average (runnable tasks), None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def others_running(samples: int = 10, gap_s: float = 0.01) -> int:
    """Other processes' tasks that stay runnable (``procs_running`` of ``/proc/stat`` less
    this process's reading thread, the least seen over ``samples`` reads: a busy neighbour is
    runnable in every read, a kernel worker waking for a moment is not), 0 where unknown."""
    seen = None
    for i in range(samples):
        try:
            with open("/proc/stat", encoding="ascii") as f:
                running = next(int(line.split()[1]) for line in f
                               if line.startswith("procs_running"))
        except (OSError, StopIteration, ValueError):
            return 0
        seen = running - 1 if seen is None else min(seen, running - 1)
        if i + 1 < samples:
            time.sleep(gap_s)
    return max(0, seen or 0)


def choose_threads(device: torch.device, threads: int | None = None) -> dict:
    """Set torch's intra-op thread count for timing on ``device`` and say why.

    On the CPU, with ``threads`` None: the cores no other process is running on right now
    (at least 1). Each parallel op waits for its slowest thread, so one thread that shares a
    core with a busy neighbour slows every op; with a neighbour on one of 2 cores, 2 threads
    made ``ForageTorch.step`` 5x slower than 1 (measured on a 2-core machine; see issue 28).
    On CUDA the host threads matter little and are left as they are. Returns what was set,
    for the JSON: {"threads", "cores", "others_running", "chosen_by"}."""
    n_cores, others = cores(), others_running()
    if threads is not None:
        chosen_by = "--threads"
    elif device.type == "cuda":
        threads, chosen_by = torch.get_num_threads(), "torch's default (CUDA run)"
    else:
        threads = max(1, n_cores - others)
        chosen_by = "free cores" if others else "all cores (no other process running)"
    torch.set_num_threads(threads)
    return {"threads": threads, "cores": n_cores, "others_running": others,
            "chosen_by": chosen_by}


def summary(rows: list[dict], before: float | None, after: float | None, n_cores: int,
            threads: dict | None = None) -> dict:
    """The run's verdict: how many measured rows are noisy, the load around the run, and one
    line to print. ``threads`` (from :func:`choose_threads`) adds that the run had fewer
    threads than cores because other processes kept running: its rows are then comparable
    with runs at that thread count, not with a quiet run on all cores."""
    measured = [r for r in rows if r.get("status") == "ok"]
    noisy = [r for r in measured if r.get("noisy")]
    loaded = [f"{when} {value:.1f}" for when, value in (("before", before), ("after", after))
              if value is not None and value > n_cores]
    line = f"noise: {len(noisy)} of {len(measured)} measured rows noisy"
    if loaded:
        line += f"; load above the {n_cores} cores ({', '.join(loaded)})"
    line += f"; {ADVICE}" if noisy or loaded else "; nothing says these numbers are off"
    if threads and threads.get("chosen_by") == "free cores" and threads["threads"] < n_cores:
        line += (f". Timed with {threads['threads']} thread(s) of {n_cores} because "
                 f"{threads['others_running']} other process(es) kept running: compare these "
                 f"rows with runs at --threads {threads['threads']}, not with a quiet run on all "
                 "cores")
    return {"noisy_rows": len(noisy), "rows": len(measured), "load_before": before,
            "load_after": after, "cores": n_cores, "line": line}
