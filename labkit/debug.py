"""Debug checks: is every tensor finite at the named points of the hot path? Free when off.

labkit checks these points (one line each in its own code):

===============  ==========================================  ==============================
point            what                                        where
===============  ==========================================  ==============================
``observations`` the policy's input                          ``policy.sample_action``
``logits``       the policy's output                         ``policy.sample_action``
``values``       the value head's output                     ``policy.sample_action``
``rewards``      the env's rewards                           ``rollout.Collector._finish_step``
``losses``       each minibatch's loss                       ``ppo.minibatch_step``
``gradients``    every parameter's gradient after backward   ``ppo.minibatch_step``
===============  ==========================================  ==============================

**Off** (the default), a point is one Python call that returns at once: no kernel, no host
read (``tests/test_debug.py`` proves both with the sync meter and the profiler's op counts).
That is the difference from the unconditional ``if torch.isnan(x).any(): raise`` checks that
one field report found costing 73 ms per forward.

**On** (``LABKIT_DEBUG=1`` in the environment, ``debug.enable()``, or ``with debug.enable():``),
each point costs one finite-ness reduction over its tensors and one host read, and the first
non-finite tensor raises :class:`NonFiniteError`. The error names the point and its *step*:
how many times that point had been checked since debug mode was switched on, counting from 0
(an env step for the rollout's points, a minibatch step for the update's).

Compiled code: every point sits *outside* the compiled regions (``torch.compile(fullgraph=True)``
of the policy network and of the PPO loss): ``sample_action`` checks the network's input before
the compiled call and its outputs after it, ``minibatch_step`` checks the loss the compiled
function returned and the gradients after backward. So a check never breaks a graph, on or off,
and compiled stages are checked exactly like eager ones. A check reached while dynamo traces or
while a CUDA graph is being captured is skipped (neither can read the host): debug a graphed
stage (8) by running stage 7, which computes the same steps without graphs. With fp16's
GradScaler, non-finite gradients are expected (the scaler skips those steps), so gradients are
checked only where no scaler runs.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from .device import capturing

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def check_environment() -> None:
    """``$LABKIT_DEBUG`` is a yes or a no (read once, at import; an unknown value is off):
    a ValueError naming it and the allowed values otherwise, for the CLI to say."""
    value = os.environ.get("LABKIT_DEBUG", "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"LABKIT_DEBUG={value[:40]!r} must be one of "
                         f"{', '.join(v for v in _TRUE + _FALSE if v)} (or unset)")


class _State:
    def __init__(self) -> None:
        self.on = os.environ.get("LABKIT_DEBUG", "").strip().lower() in _TRUE
        self.steps: Counter[str] = Counter()


_state = _State()


class NonFiniteError(FloatingPointError):
    """A tensor at a debug point holds NaN or inf; ``point``, ``step``, ``index``, ``count``."""

    def __init__(self, point: str, step: int, message: str, index: tuple[int, ...] = (),
                 count: int = 0) -> None:
        super().__init__(message)
        self.point, self.step, self.index, self.count = point, step, index, count


def enabled() -> bool:
    """Whether the debug checks run."""
    return _state.on


class enable:
    """Switch the checks on (``enable()``) or off (``enable(False)``), counting steps from 0
    again. Works as a call or as a context manager that restores the previous setting:

    >>> with enable():        # doctest: +SKIP
    ...     pipeline.iteration()
    """

    def __init__(self, on: bool = True) -> None:
        self.previous = _state.on
        _state.on = bool(on)
        _state.steps.clear()

    def __enter__(self) -> enable:
        return self

    def __exit__(self, *exc: object) -> None:
        _state.on = self.previous
        _state.steps.clear()


def steps() -> dict[str, int]:
    """How many times each point was checked since debug mode was switched on."""
    return dict(_state.steps)


def _cannot_read_host() -> bool:
    return torch.compiler.is_compiling() or capturing()


def _tensors(value: torch.Tensor | Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if t is not None]


def check(**points: torch.Tensor | Sequence[torch.Tensor | None]) -> None:
    """Raise :class:`NonFiniteError` if a tensor of ``points`` (name=tensor, or name=[tensors])
    holds NaN or inf; a no-op unless debug mode is on."""
    if not _state.on:
        return
    if _cannot_read_host():
        return
    step = {name: _state.steps[name] for name in points}
    _state.steps.update(points.keys())
    flat = [(name, i, t) for name, value in points.items() for i, t in enumerate(_tensors(value))]
    if not flat:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, _, t in flat]).all()
    if finite:  # debug mode's one host read per point
        return
    for name, i, t in flat:
        bad = ~torch.isfinite(t)
        if bad.any():
            index = tuple(int(j) for j in bad.nonzero()[0])
            count = int(bad.sum())
            what = name if len(_tensors(points[name])) == 1 else f"{name}[{i}]"
            raise NonFiniteError(
                name, step[name],
                f"{what} is not finite at step {step[name]} (this point's checks since debug "
                f"mode was switched on, from 0): {count} of {t.numel()} values are NaN or inf, "
                f"the first at index {index} of shape {tuple(t.shape)}", index, count)


def check_grads(params: Iterable[torch.Tensor]) -> None:
    """:func:`check` of every parameter's ``.grad`` as the ``gradients`` point (the list is
    only built when debug mode is on)."""
    if not _state.on:
        return
    check(gradients=[p.grad for p in params])
