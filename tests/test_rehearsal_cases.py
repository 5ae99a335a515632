"""Issue 37's case set held against ``labkit.rehearse``: every case must agree with its real-capture
verdict, except those in ``rehearsal_cases/known.py``, which must keep exactly their recorded
outcome until the tool is fixed (then the entry goes). Plus the rules of the set itself: over
100 cases, a source for each, one ``# HAZARD`` line for each hazard, unique ids, three variants
or more (a spelling, a method, a helper) for every example the issue quotes, 40 clean cases or
more.

The cases package sits beside this file (``tests`` is not a package): it is imported as
``rehearsal_cases``; the counts come from ``python -m tests.rehearsal_cases`` at the repo root.
"""
from __future__ import annotations

import inspect
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import rehearsal_cases as rc  # noqa: E402
from rehearsal_cases import check  # noqa: E402
from rehearsal_cases.known import KNOWN, KNOWN_INSIDE  # noqa: E402

_BY_ID = {c.id: c for c in rc.CASES}


@pytest.mark.skipif(torch.cuda.is_available(), reason="KNOWN holds the outcomes on a CPU-only "
                    "torch; where CUDA is there, the cases build CUDA tensors and a real "
                    "capture is the check")
@pytest.mark.parametrize("case", rc.CASES, ids=lambda c: c.id)
def test_case_outcome(case: rc.Case) -> None:
    result = check.run(case)
    known = KNOWN.get(case.id)
    said = f"the tool said: {result.detail}"
    if known is None:
        assert result.outcome == "agree", (
            f"{case.id} ({case.issue_class}, expected {case.expect}): {result.outcome}; {said}")
    elif result.outcome == "agree":
        pytest.fail(f"{case.id} now agrees: remove it from KNOWN "
                    "(tests/rehearsal_cases/known.py)")
    else:
        assert result.outcome == known, (
            f"{case.id}: KNOWN says {known}, the outcome is now {result.outcome}; {said}")


#: The classes where building a case inside the rehearsal changes what the rehearsal knows
#: (the host tensors a step keeps, an optimizer's state, what a silent failure hides): their
#: inside variant runs in the fast tier; every other class's repeats its outside verdict, and
#: runs in the slow tier (CI).
INSIDE_MATTERS = ("host_memory", "optimizer", "silent")


@pytest.mark.skipif(torch.cuda.is_available(), reason="KNOWN_INSIDE holds CPU-only outcomes")
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=() if c.issue_class in INSIDE_MATTERS else pytest.mark.slow)
    for c in rc.CASES])
def test_case_outcome_built_inside_a_rehearsal(case: rc.Case) -> None:
    """Built inside ``with rehearsal():``, the rehearsal knows the host tensors a step keeps
    (a CPU step counter made with the model), so those hazards are found too."""
    result = check.run(case, inside=True)
    known = KNOWN_INSIDE.get(case.id)
    if known is None:
        assert result.outcome == "agree", f"{case.id}: {result.outcome}; {result.detail}"
    elif result.outcome == "agree":
        pytest.fail(f"{case.id} now agrees inside a rehearsal: remove it from KNOWN_INSIDE")
    else:
        assert result.outcome == known, f"{case.id}: {result.outcome}; {result.detail}"


def test_the_set_is_large_and_ids_are_unique() -> None:
    ids = [c.id for c in rc.CASES]
    assert len(ids) > 100
    assert len(set(ids)) == len(ids), [i for i, n in Counter(ids).items() if n > 1]


def test_every_case_cites_its_source() -> None:
    for c in rc.CASES:
        assert c.source.strip(), c.id
        assert any(k in c.source for k in ("torch/", "aten/", "c10/", "http",
                                           "results/real_capture_cuda.jsonl")), c.id


@pytest.mark.parametrize("case", rc.CASES, ids=lambda c: c.id)
def test_hazard_marker(case: rc.Case) -> None:
    """A hazard has exactly one ``# HAZARD`` line where its report must point; a capturable
    case has none in its factory and names no hazard function or message words."""
    path, lines = case.marked()
    if case.expect == "capturable":
        assert case.hazard is None and not case.says
        assert lines == [], f"{case.id}: a capturable case with '# HAZARD' at {lines}"
    else:
        assert len(lines) == 1, f"{case.id}: {len(lines)} '# HAZARD' lines in {path}"
        assert case.hazard_site() == (path, lines[0])


def test_classes_verdicts_and_families_are_known() -> None:
    for c in rc.CASES:
        assert c.issue_class in rc.CLASSES and c.expect in rc.VERDICTS, c.id
        assert c.variant in rc.VARIANTS, c.id
        assert (c.family in rc.QUOTED) == (c.variant != "other"), c.id
    assert {c.issue_class for c in rc.CASES} == set(rc.CLASSES)
    assert {c.family for c in rc.CASES} - {""} == set(rc.QUOTED)


def test_every_quoted_example_has_three_variants() -> None:
    """Another spelling, inside a module's method, inside a helper from another file."""
    for family in rc.QUOTED:
        cases = [c for c in rc.CASES if c.family == family]
        variants = {c.variant for c in cases}
        assert len(cases) >= 3 and {"spelling", "method", "helper"} <= variants, (
            family, sorted(variants))


def test_method_and_helper_variants_live_in_other_files() -> None:
    for c in rc.CASES:
        if c.variant not in ("method", "helper"):
            continue
        where = {"method": "nets.", "helper": "helpers."}[c.variant]
        assert where in inspect.getsource(c.build), c.id
        if c.hazard is not None:
            assert inspect.getsourcefile(c.hazard).endswith(
                f"{where.rstrip('.')}.py"), c.id


def test_enough_clean_cases() -> None:
    clean = [c for c in rc.CASES if c.expect == "capturable"]
    assert len(clean) >= 40, len(clean)


def test_known_names_real_cases_and_outcomes() -> None:
    for case_id, outcome in KNOWN.items():
        assert case_id in _BY_ID, f"KNOWN names {case_id}, which is not a case"
        assert outcome in check.OUTCOMES and outcome != "agree", (case_id, outcome)


#: Steps where the recorded real capture (results/real_capture_cuda.jsonl) is not the expected
#: verdict, and why the expected verdict stands.
REAL_BLIND = {
    "review:h23_periodic_target_sync": "the hazard is a branch taken at the 100th call; the "
                                       "judge replays 3 times",
    "cases:rebound-running_max": "the judge scales each call's inputs up, so each call's own "
                                 "largest |obs| beats the peak carried over, the eager one and "
                                 "the frozen one alike; they part once a call's inputs are "
                                 "smaller than the last's",
}


def _recorded_real() -> tuple[dict, list[dict]]:
    import json
    lines = (Path(__file__).resolve().parent.parent / "results"
             / "real_capture_cuda.jsonl").read_text().splitlines()
    return json.loads(lines[0])["meta"], [json.loads(line) for line in lines[1:]]


def test_expected_verdicts_agree_with_the_recorded_real_captures() -> None:
    """Every step a real capture judged on a GPU (tests/rehearsal_cases/real.py) has that
    verdict as its expected one, but for the steps in REAL_BLIND; a step that raised in an
    eager call there, before any capture, is expected refused. The rehearsal is held to the
    expected verdicts by the tests above, so through them to what CUDA did."""
    from rehearsal_cases import review_steps
    meta, rows = _recorded_real()
    expected = {f"cases:{c.id}": c.expect for c in rc.CASES}
    expected.update({f"review:{name}": "capturable" if e == "ok" else e
                     for name, e, _, _ in review_steps.CASES})
    assert len(rows) == meta["judged"] >= 200
    wrong = []
    for row in rows:
        real = "refused" if row["real"] == "warmup_error" else row["real"]
        if row["key"] in expected and real != expected[row["key"]] \
                and row["key"] not in REAL_BLIND:
            wrong.append(f"{row['key']}: expected {expected[row['key']]}, real {row['real']} "
                         f"({row['detail'][:120]})")
    assert not wrong, "\n".join(wrong)
    assert all(k in expected for k in REAL_BLIND)
