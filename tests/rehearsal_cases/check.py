"""Run one case through ``labkit.rehearse`` and say how its report compares with the expected
real-capture verdict.

Outcomes:

* ``agree``: capturable and ``ok``; or not ``ok`` with a problem at the ``# HAZARD`` line
  (and, where the case names words the message must hold, a message holding them);
* ``miss``: a hazard, and the report says ``ok``;
* ``wrong_line``: not ``ok``, but no problem names the hazard's ``file:line``;
* ``vague``: the right line, but no message there names what the user wrote (``says``);
* ``false_alarm``: a capturable case that the report flags;
* ``crash``: ``rehearse`` raised.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributions import Distribution

from labkit import rehearse
from labkit.doctor.rehearsal import rehearsal

from .registry import CLASSES, Case

OUTCOMES = ("agree", "miss", "wrong_line", "vague", "false_alarm", "crash")
_SITE = re.compile(r"(?P<file>.+?):(?P<line>\d+)(?:\s|$)")


@dataclass
class Result:
    """A case's outcome and what the tool said (its report, or the exception it raised)."""

    case: Case
    outcome: str
    detail: str


def at_site(where: str, path: str, line: int) -> bool:
    """Whether a problem's ``where`` (``file:line (function)``, the file relative to the repo
    root or absolute, maybe followed by ``via ...``) names ``path`` at ``line``."""
    m = _SITE.match(where)
    if m is None or int(m["line"]) != line:
        return False
    named = os.path.normpath(m["file"])
    full = os.path.normpath(os.path.abspath(path))
    return full == os.path.normpath(os.path.abspath(named)) or full.endswith(os.sep + named)


def classify(case: Case, report: Any) -> str:
    """The outcome of a report (``ok`` and ``problems`` with ``kind``, ``where``, ``summary``)."""
    if case.expect == "capturable":
        return "agree" if report.ok else "false_alarm"
    if report.ok:
        return "miss"
    path, line = case.hazard_site()
    here = [p for p in report.problems if at_site(p.where, path, line)]
    if not here:
        return "wrong_line"
    if case.says and not any(all(w.lower() in f"{p.kind} {p.summary}".lower() for w in case.says)
                             for p in here):
        return "vague"
    return "agree"


@contextlib.contextmanager
def fresh_process() -> Iterator[None]:
    """A case's surroundings as in a fresh process: torch's and Python's RNG seeded and put
    back after, warnings and prints kept quiet, and distributions validating their arguments
    (the first torch.compile in a process turns that off for good: torch/_dynamo/eval_frame.py,
    TorchPatcher.patch, Distribution.set_default_validate_args(False))."""
    py_state = random.getstate()
    validate = Distribution._validate_args
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            Distribution.set_default_validate_args(True)
            yield
    finally:
        random.setstate(py_state)
        Distribution.set_default_validate_args(validate)


def run(case: Case, inside: bool = False) -> Result:
    """Build the case and rehearse it in :func:`fresh_process`; an exception from the factory
    is the case's bug and propagates, one from ``rehearse`` is a crash. ``inside``: build it
    inside ``with rehearsal():`` (which then knows the host tensors the factory makes), as the
    rehearsal's docs advise for state kept on the host."""
    with fresh_process(), rehearsal(strict=False) if inside else contextlib.nullcontext():
        fn, args = case.build()
        try:
            report = rehearse(fn, *args)
        except Exception as exc:  # the tool must never raise on a step: the finding
            lines = str(exc).strip().splitlines() or [""]
            return Result(case, "crash", f"{type(exc).__name__}: {lines[0]}")
    return Result(case, classify(case, report), str(report))


def table(results: list[Result]) -> str:
    """Counts by class: cases and each outcome, then the totals."""
    cols = ("cases", *OUTCOMES)
    rows = []
    for name in (*CLASSES, "total"):
        mine = [r for r in results if name in ("total", r.case.issue_class)]
        if not mine:
            continue
        n = Counter(r.outcome for r in mine)
        rows.append((name, len(mine), *(n[o] for o in OUTCOMES)))
    width = max(len(r[0]) for r in rows)
    head = f"{'class':<{width}} " + " ".join(f"{c:>11}" for c in cols)
    body = [f"{r[0]:<{width}} " + " ".join(f"{v:>11}" for v in r[1:]) for r in rows]
    return "\n".join([head, *body])
