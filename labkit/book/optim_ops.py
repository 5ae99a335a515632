"""What chapters 05-08 count and compare: the kernels an optimizer step launches, and what two
measured rows can tell apart.

:func:`launches_per_step` counts the kernels one ``torch.optim.Adam`` step would launch on a
GPU (:func:`labkit.measure.profiling.launches`), the figure that fused Adam improves.
:func:`versus` and :func:`phase_moved` turn rows of :func:`labkit.measure.bench.measure_stage`
into sentences that claim only what the rows' timed iterations resolve: a difference counts
when the two ranges (fastest to slowest iteration) do not overlap; otherwise it is within this
run's spread. Each sentence is written for either order, so a re-record that flips the order
flips the words.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from ..measure.profiling import launches


def launches_per_step(params: Iterable[torch.Tensor], **flags) -> Counter:
    """The kernels one ``torch.optim.Adam(params, **flags)`` step would launch on a GPU, by op
    name, counted on its second step (the first one creates the optimizer's state). A parameter
    without a gradient gets a gradient of ones. Two Adam steps change the parameters."""
    params = list(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.ones_like(p)
    optimizer = torch.optim.Adam(params, **flags)
    optimizer.step()
    return launches(optimizer.step)


def _span(samples: list[float]) -> tuple[float, float]:
    return min(samples), max(samples)


def _apart(a: tuple[float, float], b: tuple[float, float]) -> int:
    """-1 if every value of ``a`` is below every value of ``b``, 1 if above, 0 if they overlap."""
    return -1 if a[1] < b[0] else 1 if a[0] > b[1] else 0


def _iterations(row: dict) -> list[float]:
    return list(row.get("iteration_s_samples") or row["iteration_s_spread"])


def versus(before: dict, after: dict, names: tuple[str, str] | None = None) -> str:
    """How the row ``after`` compares with the row ``before`` (two ``measure_stage`` rows at the
    same N and T): the ratio of their median env steps/s, and whether their timed iterations
    tell them apart. ``names`` labels them (default: ``stage <index>``)."""
    a_name, b_name = names or (f"stage {before['stage']}", f"stage {after['stage']}")
    samples = after["n_envs"] * after["n_steps"]
    a_sps, b_sps = samples / before["iteration_s"], samples / after["iteration_s"]
    a_span, b_span = _span(_iterations(before)), _span(_iterations(after))
    side = _apart(b_span, a_span)
    if side < 0:
        verdict = (f"every timed iteration of {b_name} was faster than every one of {a_name}: "
                   "a difference beyond this run's spread")
    elif side > 0:
        verdict = (f"every timed iteration of {b_name} was slower than every one of {a_name}: "
                   "a difference beyond this run's spread")
    else:
        verdict = (f"their timed iterations overlap ({b_name} {1e3 * b_span[0]:.0f}-"
                   f"{1e3 * b_span[1]:.0f} ms, {a_name} {1e3 * a_span[0]:.0f}-"
                   f"{1e3 * a_span[1]:.0f} ms): within this run's spread, a difference it "
                   "cannot resolve")
    return (f"{b_name} ran at {b_sps / a_sps:.2f}x {a_name}'s median env steps/s "
            f"({b_sps:,.0f} vs {a_sps:,.0f}); {verdict}")


def phase_moved(before: dict, after: dict, phase: str) -> str:
    """How one phase moved from ``before`` to ``after`` (medians of the phase-marked iterations)
    and whether the two rows' marked iterations tell it apart."""
    def times(row: dict) -> list[float]:
        return [ms.get(phase, 0.0) for ms in row.get("phase_ms_samples") or [row["phase_ms"]]]

    a, b = before["phase_ms"].get(phase, 0.0), after["phase_ms"].get(phase, 0.0)
    side = _apart(_span(times(after)), _span(times(before)))
    verdict = ("the marked iterations overlap: within this run's spread" if side == 0 else
               f"{'shorter' if side < 0 else 'longer'} in every marked iteration: beyond this "
               "run's spread")
    return f"{phase} {a:.1f} -> {b:.1f} ms per iteration ({verdict})"
