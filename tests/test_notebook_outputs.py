"""The stored chapters against the current code: what nbval cannot see.

nbval compares a stored output with a fresh one, so a check that fails in both (a compared
``False``) passes it, and a source listing under ``NBVAL_IGNORE_OUTPUT`` may be stale forever.
These tests read the stored notebooks themselves."""
import html
import importlib
import json
import re
from pathlib import Path

import pytest

from labkit.book.show import diff, source

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9]*.ipynb"))
#: The header that ``labkit.book.show.source`` puts above a listing (also inside side_by_side's
#: HTML ``<pre>``), and the two lines that head a ``show.diff``.
_HEADER = re.compile(r"^(?:<pre[^>]*>)?# (labkit/\S+\.py): (\S+)$", re.M)
_DIFF = re.compile(r"^--- (labkit/\S+\.py): (\S+)\n\+\+\+ (labkit/\S+\.py): (\S+)$", re.M)
#: A cell whose compared output says False as its lesson says so in a comment.
ON_PURPOSE = "False on purpose"


def _outputs(cell: dict) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        for text in (out.get("text"), data.get("text/plain"), data.get("text/html")):
            if text:
                texts.append("".join(text))
    return texts


def _cells(path: Path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            yield i, "".join(cell["source"]), _outputs(cell)


def _resolve(path: str, qualname: str):
    obj = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _listings(text: str) -> list[tuple[str, str, str]]:
    """(path, qualname, the listing as stored) for each ``source(...)`` in an output."""
    if "<pre" in text:  # side_by_side: one listing per <pre>
        blocks = [html.unescape(b) for b in re.findall(r"<pre[^>]*>(.*?)</pre>", text, re.S)]
    else:
        starts = [m.start() for m in _HEADER.finditer(text)] + [len(text)]
        blocks = [text[a:b] for a, b in zip(starts, starts[1:])]
    found = []
    for block in blocks:
        m = _HEADER.match(block)
        if m:
            found.append((m[1], m[2], block))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_compared_output_is_a_failed_check(path):
    """A compared check raises when it fails (``labkit.book.show.check``); a stored ``False``
    in a compared output is a check that failed when recorded and fails again every run
    unseen, unless the cell says that False is its lesson."""
    bad = []
    for i, src, texts in _cells(path):
        if "NBVAL_IGNORE_OUTPUT" in src or ON_PURPOSE in src:
            continue
        for text in texts:
            bad += [f"c{i}: {line.strip()[:120]}" for line in text.splitlines()
                    if re.search(r"\bFalse\b", line)]
    assert not bad, f"{path.name}: compared outputs that say False: {bad}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_stored_source_listing_is_the_current_source(path):
    """Every listing a chapter printed with ``show.source``, ``show.side_by_side`` or
    ``show.diff`` (compared by nbval or not) is labkit's source today; a listing cut short
    must be the start of it."""
    stale = []
    for i, _, texts in _cells(path):
        for text in texts:
            for file, name, stored in _listings(text):
                obj = _resolve(file, name)
                current, brief = _norm(source(obj)), _norm(source(obj, brief=True))
                shown = _norm(stored)
                if not (current.startswith(shown) or shown.startswith(current)
                        or shown.startswith(brief)):
                    stale.append(f"c{i}: {file}: {name}")
            for m in _DIFF.finditer(text):
                current = _norm(diff(_resolve(m[1], m[2]), _resolve(m[3], m[4])))
                if not _norm(text[m.start():]).startswith(current):
                    stale.append(f"c{i}: diff {m[2]} -> {m[4]}")
    assert not stale, f"{path.name}: stale source listings: {stale}"


def test_the_guards_catch_what_they_guard(tmp_path):
    """A stored False and a stale listing are found (the guards can fail)."""
    from labkit.timing import amdahl_sps

    listing = source(amdahl_sps)
    stale = listing.replace("Amdahl", "Amdal")
    assert _listings(stale)[0][1] == "amdahl_sps"
    assert not _norm(listing).startswith(_norm(stale))
    assert _listings(f"<table><tr><td><pre style='x'>{html.escape(listing)}</pre></td>")[0][2] \
        == listing
    cell = {"cell_type": "code", "source": ["print('ok:', False)\n"],
            "outputs": [{"output_type": "stream", "text": ["ok: False\n"]}]}
    nb = tmp_path / "99_x.ipynb"
    nb.write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(AssertionError, match="compared outputs that say False"):
        test_no_compared_output_is_a_failed_check(nb)
