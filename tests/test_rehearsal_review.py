"""The reviewer's 62 steps (tests/rehearsal_cases/review_steps.py) against ``labkit.rehearse``:
a capturable step is ``ok``; a hazard is not, and a problem names its ``# HAZARD`` line. One
step is held to its known outcome (KNOWN_REVIEW) until the tool is fixed."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from rehearsal_cases import check, review_steps  # noqa: E402

from labkit import rehearse  # noqa: E402

_MARK = re.compile(r"#\s*HAZARD\s*$")
_LINES = Path(review_steps.__file__).read_text().splitlines()
#: Flagged, but at the line that changes the counter, not at the branch it drives.
KNOWN_REVIEW = {"h23_periodic_target_sync": "wrong_line"}


def _marked(factory) -> list[int]:
    lines, start = inspect.getsourcelines(factory)
    found = [start + i for i, text in enumerate(lines) if _MARK.search(text.rstrip())]
    return found or [i + 1 for i, text in enumerate(_LINES) if _MARK.search(text.rstrip())]


def _outcome(expect: str, factory) -> str:
    with check.fresh_process():
        fn, args = factory()
        report = rehearse(fn, *args)
    if expect == "ok":
        return "agree" if report.ok else "false_alarm"
    if report.ok:
        return "miss"
    targets = _marked(factory)
    named = [re.match(r"(.+?):(\d+)", p.where) for p in report.problems]
    hit = any(m and m[1].endswith("review_steps.py") and int(m[2]) in targets for m in named)
    return "agree" if hit else "wrong_line"


@pytest.mark.skipif(torch.cuda.is_available(), reason="outcomes of a CPU-only torch")
@pytest.mark.parametrize("name, expect, why, factory", review_steps.CASES,
                         ids=[c[0] for c in review_steps.CASES])
def test_review_step(name, expect, why, factory) -> None:
    outcome = _outcome(expect, factory)
    assert outcome == KNOWN_REVIEW.get(name, "agree"), f"{name} ({expect}: {why}): {outcome}"
