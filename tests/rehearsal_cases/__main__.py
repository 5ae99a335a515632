"""Run every case through ``labkit.rehearse`` and print the counts by class.

    python -m tests.rehearsal_cases                 # the table
    python -m tests.rehearsal_cases -v              # and every case that does not agree
    python -m tests.rehearsal_cases --write-known   # rewrite known.py from this run
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: python tests/rehearsal_cases/__main__.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "rehearsal_cases"

from . import CASES  # noqa: E402
from .check import OUTCOMES, Result, run, table  # noqa: E402

KNOWN_FILE = Path(__file__).with_name("known.py")
#: The counts on the tool before issue 37 changed it (commit cea476e), kept in known.py.
BEFORE = ("Before: 2026-11-25, torch 2.13.0+cpu, the tool unchanged (commit cea476e):",
          "231 cases: 76 agree, 84 miss, 6 wrong_line, 19 vague, 22 false_alarm, 24 crash.")


def _counts(results: list[Result]) -> str:
    n = Counter(r.outcome for r in results)
    return ", ".join(f"{n[o]} {o}" for o in OUTCOMES)


def known_source(results: list[Result], inside: list[Result], date: str) -> str:
    """known.py's text: every case that does not agree, with the run's date and counts; then
    the same for the cases built inside ``with rehearsal():``."""
    counts = _counts(results)
    lines = [
        '"""Every case whose outcome on the tool as it is does not ``agree``',
        "(tests/test_rehearsal_cases.py holds each to it until the tool is fixed, then asks for",
        'its line to be removed)."""',
        *[f"# {line}" for line in BEFORE],
        f"# Now: generated {date} with torch {torch.__version__} by",
        "# `python -m tests.rehearsal_cases --write-known`:",
        f"# {len(results)} cases: {counts}.",
        "",
        "KNOWN: dict[str, str] = {",
    ]
    lines += [f"    {json.dumps(r.case.id)}: {json.dumps(r.outcome)},"
              for r in sorted(results, key=lambda r: r.case.id) if r.outcome != "agree"]
    lines += ["}", "", "# Built inside `with rehearsal():`, which then knows the host tensors the "
              "factory makes:", f"# {len(inside)} cases: {_counts(inside)}.",
              "KNOWN_INSIDE: dict[str, str] = {"]
    lines += [f"    {json.dumps(r.case.id)}: {json.dumps(r.outcome)},"
              for r in sorted(inside, key=lambda r: r.case.id) if r.outcome != "agree"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rehearsal_cases",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every case that does not agree, with what the tool said")
    parser.add_argument("--write-known", action="store_true",
                        help="rewrite known.py with this run's outcomes")
    parser.add_argument("--date", default=datetime.date.today().isoformat(),
                        help="the date written into known.py (default: today)")
    args = parser.parse_args(argv)
    results = [run(c) for c in CASES]
    inside = [run(c, inside=True) for c in CASES]
    print(table(results))
    print(f"\nbuilt inside `with rehearsal():`: {_counts(inside)}")
    if args.verbose:
        for r in results + [r for r in inside if r.outcome != "agree"]:
            if r.outcome != "agree":
                detail = r.detail.replace("\n", " | ")
                print(f"{r.outcome:<11} {r.case.id}: {detail[:300]}")
    if args.write_known:
        KNOWN_FILE.write_text(known_source(results, inside, args.date))
        print(f"wrote {KNOWN_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
