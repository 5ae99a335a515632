"""Honest timing: named phases inside an iteration, and the first call apart from the rest.

``PhaseClock.lap(name)`` gives the time since the previous lap to ``name`` (PufferLib's named
timers): a reader sees where an iteration went without a profiler. On a GPU a lap records a
CUDA event, so nothing waits inside the iteration; the events are read after the caller's one
synchronize at the iteration boundary. On the CPU a lap reads ``time.perf_counter``.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from .device import capturing, synchronize

T = TypeVar("T")

#: Phase keys, with what each one holds (in the order of an iteration, but ``step``).
PHASES = {
    "policy": "policy forward + sampling",
    "env": "env step",
    "io": "transfers + logging",
    "metrics": "episode statistics",
    "graph": "rollout step replayed as one CUDA graph",
    "gae": "bootstrap value + GAE",
    "update": "PPO update",
    # last, not in the iteration's order, so that the plots keep each older phase's colour
    "step": "rollout step past the sampling noise as one compiled region (compile_unit=step)",
}


class PhaseClock:
    """Accumulates wall time per named phase while started; a no-op otherwise.

    >>> clock = PhaseClock(torch.device("cpu"))
    >>> clock.start(); work(); clock.lap("work"); ms = clock.stop()   # doctest: +SKIP
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.running = False
        self._marks: list[tuple[str | None, object]] = []

    def _now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.running = True
        self._marks = [(None, self._now())]

    def lap(self, name: str) -> None:
        """The time since the previous lap (or ``start``) belongs to phase ``name``."""
        if not self.running:
            return
        if self.cuda and capturing():
            return  # inside a CUDA graph capture: the replay is timed as a whole
        self._marks.append((name, self._now()))

    @property
    def laps(self) -> int:
        return max(len(self._marks) - 1, 0)

    def stop(self) -> dict[str, float]:
        """Milliseconds per phase since ``start``. On CUDA call it after synchronizing."""
        self.running = False
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            ms = a.elapsed_time(b) if self.cuda else 1e3 * (b - a)
            out[name] = out.get(name, 0.0) + ms
        return out


def timed(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """Seconds of ``fn()`` from a synchronized start to a synchronized end (on a GPU the host
    clock is only honest once the device has finished its queued work), and its result."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def lap_cost_s(device: torch.device, laps: int = 5000) -> float:
    """Measured seconds that one ``PhaseClock.lap`` adds to the timed region on ``device``
    (the events are read later, outside it)."""
    clock = PhaseClock(device)

    def marks() -> None:
        clock.start()
        for _ in range(laps):
            clock.lap("x")

    seconds, _ = timed(marks, device)
    clock.stop()
    return seconds / laps


@dataclass
class Timings:
    """Seconds of the first call and of each later call."""

    first: float
    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> tuple[float, float, float]:
        """(min, median, max) of the later calls."""
        return min(self.runs), self.median, max(self.runs)


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> Timings:
    """Call ``fn`` once (timed apart: compilation, allocator and cache warmup land there), then
    ``repeats`` more times. Each call is timed from a synchronized start to a synchronized end,
    so on a GPU the clock covers the queued work, not just its launch."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times = [timed(fn, device)[0] for _ in range(repeats + 1)]
    return Timings(times[0], times[1:])


def amdahl_sps(phase_ms: dict[str, float], samples: int, free: tuple[str, ...]) -> float:
    """Amdahl's bound: env steps/s if the phases in ``free`` cost nothing and the others took
    what they were measured to take (``samples`` = N*T per iteration). ``phase_ms`` is
    ``measure_stage(...)["phase_ms"]``; every name in ``free`` must be a key of ``PHASES``."""
    unknown = sorted(set(free) - set(PHASES))
    if unknown:
        raise ValueError(f"free must name phases among {', '.join(PHASES)}; got {unknown}")
    left_ms = sum(ms for k, ms in phase_ms.items() if k not in free)
    if left_ms <= 0:
        raise ValueError("nothing is left once the free phases are removed: no finite bound")
    return samples / (1e-3 * left_ms)


def amdahl(row: dict, free: tuple[str, ...]) -> tuple[float, float]:
    """Amdahl's bound and the rate it bounds, both from the same phase-marked iterations of a
    ``measure_stage`` row: for each marked iteration, N*T over its time without the ``free``
    phases, and N*T over its whole time; the medians of each. An iteration's phases are parts
    of it, so each bound is at least its own rate, and so are their medians. (The row's
    headline ``sps`` comes from the unmarked iterations: comparing a bound from the marked ones
    with it mixes two samples.)"""
    samples = row["n_envs"] * row["n_steps"]
    phases, seconds = row.get("phase_ms_samples"), row.get("marked_iteration_s_samples")
    if not phases or not seconds or len(phases) != len(seconds):
        raise ValueError("the row has no phase-marked iterations (phase_ms_samples): measure "
                         "it again with labkit.measure.bench.measure_stage")
    bounds = [amdahl_sps(p, samples, free) for p in phases]
    return statistics.median(bounds), statistics.median(samples / s for s in seconds)


def break_even(sizes: list[int], baseline_s: list[float], candidate_s: list[float]
               ) -> int | None:
    """The smallest size from which ``candidate`` is faster than ``baseline`` at every larger
    size measured (e.g. compiled vs eager update by minibatch size); None if there is none in
    the range. Sizes ascending; one time per size for each."""
    if not (len(sizes) == len(baseline_s) == len(candidate_s)) or list(sizes) != sorted(sizes):
        raise ValueError("sizes must be ascending, with one baseline and one candidate time each")
    found = None
    for size, base, cand in zip(reversed(sizes), reversed(baseline_s), reversed(candidate_s)):
        if cand >= base:
            break
        found = size
    return found
