"""Every chapter's "Copy this" runs alone, as a reader pasting it into a new file would run it:
extracted from the notebook, in a fresh interpreter, in an empty folder, with ``import labkit``
blocked (labkit is installed editable, so the block is a meta-path hook) and no notebook
state. What it prints must end with what the chapter stored for the cells whose output nbval
compares, so the snippet's own verdict line is checked, not only that it ran."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
_HEADING = re.compile(r"^#+\s*Copy this\b", re.MULTILINE)
_NEXT = re.compile(r"^#+\s", re.MULTILINE)

#: Snippets that do not run alone yet, with the first error a reader meets (issue 41): the
#: test fails when one of them runs, so that it leaves this list.
KNOWN_FAILING: dict[str, str] = {}
#: Snippets whose subject is a labkit tool (the meter around the reader's own loop): they run
#: with labkit importable, still alone (no notebook state), and without it say so and run.
LABKIT_TOOLS = {"12_watch_your_own_loop": "labkit is not installed"}

_BOOT = """
import importlib.abc, runpy, sys


class NoLabkit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "labkit" or name.startswith("labkit."):
            raise ImportError(f"No module named {name!r} (a Copy this snippet runs without it)")
        return None


sys.meta_path.insert(0, NoLabkit())
sys.path = [p for p in sys.path if p not in ("", ROOT)]
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def snippet(path: Path) -> tuple[str, list[dict]]:
    """The code cells of ``path``'s "Copy this" section (after the heading, up to the next
    heading) joined, and the cells themselves; ("", []) where the chapter has none."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and _HEADING.search(text):
            after = text[_HEADING.search(text).end():]
            if _NEXT.search(after):  # the section ends inside this cell
                return "", []
            code = []
            for nxt in cells[i + 1:]:
                if nxt["cell_type"] == "markdown" and _NEXT.search("".join(nxt["source"])):
                    break
                if nxt["cell_type"] == "code":
                    code.append(nxt)
            return "\n\n".join("".join(c["source"]) for c in code), code
    return "", []


def stored_text(cells: list[dict]) -> tuple[str, bool] | None:
    """What the chapter stored as the printed output of the cells after the last one whose
    output nbval ignores, and whether that is every cell (None if one of them shows something
    other than text)."""
    parts, whole = [], True
    for cell in cells:
        if "NBVAL_IGNORE_OUTPUT" in "".join(cell["source"]):
            parts, whole = [], False
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") != "stream" or out.get("name") != "stdout":
                return None
            parts.append("".join(out["text"]))
    return "".join(parts), whole


def run_alone(code: str, folder: Path, labkit: bool = False) -> subprocess.CompletedProcess:
    (folder / "snippet.py").write_text(code, encoding="utf-8")
    boot = _BOOT.replace("ROOT", repr(str(ROOT)))
    if labkit:  # no block: labkit is installed (editable) in this environment
        boot = boot.replace("sys.meta_path.insert(0, NoLabkit())", "")
    return subprocess.run([sys.executable, "-c", boot, "snippet.py"], cwd=folder,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_copy_this_runs_alone(path, tmp_path):
    code, cells = snippet(path)
    assert code.strip(), f"{path.name} has no Copy this section with code"
    if path.stem in LABKIT_TOOLS:
        alone = run_alone(code, tmp_path)  # labkit blocked: it says so and runs
        assert alone.returncode == 0 and LABKIT_TOOLS[path.stem] in alone.stdout, alone.stderr
    done = run_alone(code, tmp_path, labkit=path.stem in LABKIT_TOOLS)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    if path.stem in KNOWN_FAILING:
        assert done.returncode != 0 and KNOWN_FAILING[path.stem] in last, (
            f"{path.name}'s snippet now gets past {KNOWN_FAILING[path.stem]!r} "
            f"({last or 'it runs'}): update KNOWN_FAILING")
        return
    assert done.returncode == 0, f"{path.name}: {last}\n{done.stderr[-2000:]}"
    stored = stored_text(cells)
    if stored is not None:  # the compared cells' lines end what it prints
        expected, whole = stored
        ok = done.stdout == expected if whole else done.stdout.endswith(expected)
        assert ok, f"{path.name} printed\n{done.stdout}\nnot\n{expected}"


@pytest.mark.slow
def test_the_block_works(tmp_path):
    """The hook really keeps labkit out (it is installed editable in this venv)."""
    done = run_alone("import labkit\n", tmp_path)
    assert done.returncode != 0 and "a Copy this snippet runs without it" in done.stderr


def _read_counter(code: str) -> str | None:
    """The ``ReadCounter`` class a snippet defines, as text (None if it defines none)."""
    found = re.search(r"^class ReadCounter:\n(?:(?:    .*)?\n)+", code + "\n", re.MULTILINE)
    return found.group().rstrip() if found else None


def test_every_read_counter_is_chapter_01s():
    """One labkit-free read counter serves every snippet: each copy is chapter 01's."""
    original = _read_counter(snippet(ROOT / "notebooks" / "01_the_python_loop.ipynb")[0])
    assert original and "__index__" in original
    copies = {p.stem: _read_counter(snippet(p)[0]) for p in NOTEBOOKS}
    embedded = {name: c for name, c in copies.items() if c is not None}
    assert len(embedded) >= 2, embedded.keys()
    assert all(c == original for c in embedded.values()), [
        name for name, c in embedded.items() if c != original]


@pytest.mark.slow
def test_chapter_05s_logger_takes_numbers_and_never_hangs_on_a_dead_writer(tmp_path):
    """What a review reproduced in 05's snippet: a Python number logged, a tensor that needs
    grad logged (its value, not its graph), and a sink that fails while the queue is full:
    log() raises instead of blocking forever, and close() says why."""
    code, _ = snippet(ROOT / "notebooks" / "05_log_off_the_hot_path.ipynb")
    test = code[:code.index("path = Path(tempfile.mkdtemp())")] + """
ok = BackgroundLogger(Path(sys.argv[1]) / "ok.jsonl", max_queue=2)
w = torch.ones(1, requires_grad=True)
for step in range(5):
    ok.log(step, loss=(w * 2).sum(), lr=3e-4)
ok.close()
print(open(Path(sys.argv[1]) / "ok.jsonl").readline().strip())
dead = BackgroundLogger(Path(sys.argv[1]) / "dead.jsonl", max_queue=2)
dead.file.close()  # the sink fails at its first write
try:
    for step in range(100):
        dead.log(step, loss=torch.tensor(1.0))
except RuntimeError as err:
    print("log raised:", err)
"""
    (tmp_path / "snippet.py").write_text("import sys\n" + test, encoding="utf-8")
    done = subprocess.run([sys.executable, "snippet.py", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == '{"step": 0, "loss": 2.0, "lr": 0.0003}', lines
    assert lines[1].startswith("log raised: the logger's writer failed: ValueError"), lines


def test_chapter_09s_capture_helper_captures_and_replays_in_a_rehearsal(tmp_path):
    """09's GraphStep with its capture path forced, inside labkit's rehearsal (which stands in
    for torch.cuda's graph API on the CPU, not for ``torch.cuda.is_available``): one capture,
    the generator registered, a replay per call into the capture's tensors, outputs cloned, and
    the same values as the step run eagerly. The snippet runs first as written (eagerly here),
    without labkit; the test then imports labkit."""
    code, _ = snippet(ROOT / "notebooks" / "09_cuda_graphs.ipynb")
    scope: dict = {"__name__": "snippet"}
    exec(compile(code, "snippet.py", "exec"), scope)  # noqa: S102 - the chapter's own code
    from labkit.doctor.rehearsal import rehearsal

    step, x, gen = scope["step"], scope["x"], scope["gen"]
    with rehearsal() as rehearsed:  # strict: a capture with any problem raises
        graphed = scope["GraphStep"](step, generator=gen, capture=True)
        first = graphed(x)
        kept = [t.clone() for t in first]
        second = graphed(2 * x)
    assert graphed.attempts == 1 and graphed.capture and graphed.graph is not None
    assert len(rehearsed.graphs) == 1 and rehearsed.graphs[0].replays == 2
    assert rehearsed.graphs[0].generators == [gen] and not rehearsed.problems
    assert all(torch.equal(a, b) for a, b in zip(first, kept))  # cloned, not overwritten
    assert not torch.equal(first[1], second[1])  # the registered generator drew afresh
    assert torch.equal(second[0], step(2 * x)[0])
    # a capture that fails (a host read, refused by the strict rehearsal) is tried once
    once = scope["GraphStep"](scope["reads_the_host"], capture=True)
    with rehearsal(), pytest.warns(UserWarning, match="capture failed"):
        results = [once(x) for _ in range(5)]
    assert once.attempts == 1 and not once.capture
    assert all(torch.equal(r, x / x.abs().max()) for r in results)


@pytest.mark.parametrize("amx, avx512_bf16, features", [
    (True, False, ""), (False, True, ""), (False, False, "fp asimd bf16"),
    (False, False, "fp asimd sve"), (False, False, ""),
])
def test_chapter_08s_bf16_rule_is_labkits(monkeypatch, tmp_path, amx, avx512_bf16, features):
    """The snippet's ``native_bf16`` and the recipe's ``has_bf16`` decide as labkit's ``amp``
    does on a CPU, each instruction flag forced both ways (all three read Arm's bf16 from
    /proc/cpuinfo, here a file of the test's)."""
    import types

    import labkit.device
    from tests.test_recipe import recipe

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nFeatures\t: {features}\n")

    def at_cpuinfo(path):
        return Path(cpuinfo) if str(path) == "/proc/cpuinfo" else Path(path)

    source, _ = snippet(ROOT / "notebooks" / "08_fused_optimizers_and_amp.ipynb")
    start = source.index("def native_bf16")
    scope = {"torch": torch, "pathlib": types.SimpleNamespace(Path=at_cpuinfo)}
    exec(source[start:source.index("\n\n\n", start)], scope)  # the function alone
    monkeypatch.setattr(recipe, "Path", at_cpuinfo)
    monkeypatch.setattr(labkit.device, "open", raising=False,
                        value=lambda path, *a, **k: open(at_cpuinfo(path), *a, **k))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(labkit.device.platform, "machine",
                        lambda: "aarch64" if features else "x86_64")
    cpu = torch.device("cpu")
    expected = amx or avx512_bf16 or "bf16" in features.split()
    assert labkit.device.has_bf16(cpu) == expected
    assert bool(scope["native_bf16"](cpu)) == expected
    assert bool(recipe.has_bf16(cpu)) == expected
