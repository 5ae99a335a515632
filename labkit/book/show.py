"""What the chapters show: labkit's own source (never a copy), what changed between two
stages, and host reads laid out for reading."""
from __future__ import annotations

import ast
import difflib
import html
import inspect
import re
import textwrap
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..measure.syncmeter import parse_site, source_line
from ..measure.tables import MISSING
from ..stages import Stage
from . import expects

_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$|<ipython-input-")


def _target(obj: Any) -> Any:
    """What to read the source of: a class, a function, or the class of a component object."""
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return obj
    return type(obj)


def source(obj: Any, brief: bool = False) -> str:
    """The source of ``obj`` (a class, function, method, or component object), headed by
    where it lives: ``# labkit/rollout.py: DeviceCollector``. ``brief``: only its signature
    and docstring, and how many lines follow (for a helper whose body is not the lesson)."""
    target = _target(obj)
    module = inspect.getmodule(target)
    path = (module.__name__.replace(".", "/") + ".py") if module else "?"
    text = inspect.getsource(target)
    if brief:
        lines = text.splitlines()
        tree = ast.parse(textwrap.dedent(text)).body[0]
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) \
            and isinstance(tree.body[0].value, ast.Constant) else None
        end = doc.end_lineno if doc is not None else tree.body[0].lineno - 1
        if end < len(lines):
            body = next(ln for ln in lines[end:] if ln.strip())
            indent = " " * (len(body) - len(body.lstrip()))
            text = "\n".join([*lines[:end], f"{indent}...  # {len(lines) - end} more lines in "
                                             f"{path}"]) + "\n"
    return f"# {path}: {target.__qualname__}\n" + text


def provenance(device: Any, bench: Any = None) -> str:
    """The line a chapter's measured outputs carry: the device, its threads, torch, labkit's
    commit and the date (``device.run_metadata``, the block every results file holds). With a
    ``labkit.config.BenchConfig``, then how each stage row is timed (wrapped at 92 columns)."""
    from ..device import run_metadata

    meta = run_metadata(device)
    line = (f"measured on {meta['device_name']} ({meta['device']}, {meta['torch_threads']} "
            f"threads), torch {meta['torch']}, labkit {meta['labkit']} at commit "
            f"{meta['git_commit']}, {meta['date'][:10]}")
    if bench is not None:
        method = (f"method: each stage is built and runs one iteration off the clock "
                  f"(compiles, captures, warms caches; its effects undone), then "
                  f"{bench.iterations} rounds of one plain and one phase-marked iteration, "
                  f"interleaved with the other stages in the table; env steps/s are the min, "
                  f"median and max over the plain ones, the phases come from the marked ones")
        line += "\n" + textwrap.fill(method, 92, subsequent_indent="  ")
    return line


def diff(before: Any, after: Any, context: int = 2) -> str:
    """A unified diff of two objects' sources: what one component changes against another."""
    a, b = source(before).splitlines(), source(after).splitlines()
    return "\n".join(difflib.unified_diff(a, b, a[0][2:], b[0][2:], n=context, lineterm=""))


def side_by_side(before: Any, after: Any):
    """Two sources in two columns (HTML in a notebook; GitHub renders it too)."""
    from IPython.display import HTML

    # monospace named (a page's stylesheet may give <pre> a proportional font), and each
    # column scrolls on its own rather than pushing the page wider
    cell = ("<td style='vertical-align:top;text-align:left;width:50%;max-width:50%'>"
            "<pre style='font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"
            "\"Liberation Mono\",\"DejaVu Sans Mono\",monospace;font-size:12px;"
            "overflow-x:auto;white-space:pre'>{}</pre></td>")
    cols = "".join(cell.format(html.escape(source(x))) for x in (before, after))
    return HTML(f"<table style='table-layout:fixed;width:100%'><tr>{cols}</tr></table>")


def changed_slots(before: Stage, after: Stage) -> dict[str, tuple[Any, Any]]:
    """The slots ``after`` fills differently from ``before``: {slot: (old part, new part)}."""
    old, new = before.components(), after.components()
    return {k: (old[k], new[k]) for k in new if old[k] != new[k]}


def describe(part: Any) -> str:
    """A component's short name: a class or function name, or an executor's repr."""
    if inspect.isclass(part) or inspect.isroutine(part):
        return part.__name__
    return repr(part)


@expects("a non-empty list of stages (labkit.stages.STAGES, or some of them)")
def stage_table(stages: list[Stage], width: int = 92) -> str:
    """The ladder as its components: the first stage names the component in every slot, each
    later one only the slots it fills differently from the stage before (its lesson); lines
    wrapped at ``width`` characters, so that a page never has to break a name."""
    stages[0].components()  # nothing to show: said by @expects
    lines = [f"{'stage':<18}{'slot component (the first stage: every slot; then what changes)'}"]
    before = None
    for s in stages:
        parts = s.components()
        items = [f"{k} {describe(v)}" for k, v in parts.items()
                 if before is None or before[k] != v] or ["(no slot changes)"]
        line = f"{s.index} {s.name:<16}"
        for i, item in enumerate(items):
            piece = item if i == 0 else f"; {item}"
            if i and len(line) + len(piece) + 1 > width:  # + the ";" that ends it
                lines.append(line + ";")
                line, piece = " " * 18, item
            line += piece
        lines.append(line)
        before = parts
    return "\n".join(lines)


def reads_table(sites: Counter | dict, per: int = 1, top: int = 10) -> str:
    """Host reads by call site (from ``SyncMeter(call_sites=True).sites``), most first,
    divided by ``per`` (e.g. the number of steps) when it is not 1."""
    if not isinstance(sites, dict):
        raise ValueError(f"reads_table: sites must be a dict of call site -> reads "
                         f"(SyncMeter(call_sites=True).sites), got {type(sites).__name__}")
    rows = sorted(sites.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    unit = "reads" if per == 1 else f"reads / {per}"
    lines = [f"{unit:>12}  call site"]
    lines += [f"{count / per:>12g}  {site}" for site, count in rows]
    return "\n".join(lines)


def _file(path: str) -> str:
    """A call site's file, with a notebook cell's (``/tmp/ipykernel_123/456.py``) as ``<cell>``."""
    return "<cell>" if _CELL.search(path) else path


def group_sites(sites: Counter | dict, lines: bool = False) -> Counter:
    """Host reads by call site, named alike on every machine and run: a notebook cell's file
    (``/tmp/ipykernel_123/456.py``) becomes ``<cell>``, the ``via`` torch frame is dropped and,
    unless ``lines``, so is the line number (``labkit/rollout.py (step)``), so a count that a
    test compares survives edits elsewhere in the file."""
    return _rekey(sites, lambda path, line, func:
                  f"{_file(path)}:{line} ({func})" if lines else f"{_file(path)} ({func})")


def _rekey(sites: Counter | dict, key: Callable[[str, int, str], str]) -> Counter:
    """Sum counts under ``key(path, line, function)`` of each parsed call site."""
    out: Counter = Counter()
    for site, count in sites.items():
        parsed = parse_site(site)
        out[site if parsed is None else key(*parsed[:3])] += count
    return out




def figure(row: dict, key: str, spec: str = "g") -> str:
    """``row[key]`` formatted by ``spec``, or :data:`MISSING` where the row has no such key."""
    value = row.get(key)
    return MISSING if value is None else format(value, spec)


@expects("rows of labkit.measure.bench.measure_stage")
def rows_table(rows: list[dict]) -> str:
    """Rows of ``labkit.measure.bench.measure_stage`` one per line: env steps/s as min / median /
    max over the timed iterations, the share of the compute ceiling, device reads (a sync on a
    GPU) per rollout step and per update, host-scalar reads (CPU tensors on every device) per
    iteration, then milliseconds per iteration in each phase."""
    from ..timing import PHASES

    ok = [r for r in rows if r.get("status") == "ok"]
    keys = [k for k in PHASES if any(k in r["phase_ms"] for r in ok)]
    head = (f"{'stage':<16}{'N':>6}{'T':>5}{'sps min':>10}{'median':>10}{'max':>10}"
            f"{'% ceil':>8}{'syncs/step':>11}{'syncs/upd':>10}{'host/it':>8}")
    lines = [head]
    for r in rows:
        name = f"{r['stage']} {r['name']}"
        if r.get("status") != "ok":
            lines.append(f"{name:<16}{r['n_envs']:>6}{r['n_steps']:>5}  {r['status']}")
            continue
        samples = r["n_envs"] * r["n_steps"]
        fast, mid, slow = r["iteration_s_spread"]
        lines.append(f"{name:<16}{r['n_envs']:>6}{r['n_steps']:>5}{samples / slow:>10,.0f}"
                     f"{samples / mid:>10,.0f}{samples / fast:>10,.0f}"
                     f"{100 * r['frac_of_ceiling']:>7.1f}%"
                     f"{figure(r, 'device_reads_rollout_per_step'):>11}"
                     f"{figure(r, 'device_reads_update'):>10}"
                     f"{figure(r, 'host_scalar_reads_per_iter'):>8}")
    lines += ["", f"{'ms per iteration':<16}" + "".join(f"{k:>9}" for k in keys)]
    for r in ok:
        lines.append(f"{r['stage']} {r['name']:<14}"
                     + "".join(f"{r['phase_ms'].get(k, 0.0):>9.1f}" for k in keys))
    return "\n".join(lines)


def say(*parts: Any, width: int = 96) -> None:
    """``print(*parts)``, each line wrapped at ``width`` columns: a sentence computed from
    measurements can run to hundreds, and the book's page is about 100 wide. A line that starts
    with ``* `` or ``- `` keeps its text indented under the bullet."""
    lines = []
    for line in " ".join(str(p) for p in parts).split("\n"):
        lead = len(line) - len(line.lstrip()) + (2 if line.lstrip()[:2] in ("* ", "- ") else 0)
        lines += textwrap.wrap(line, width, subsequent_indent=" " * lead, break_on_hyphens=False,
                               break_long_words=False) or [""]
    print("\n".join(lines))


def check(claim: str, value: bool | dict) -> None:
    """A compared check in a chapter: print ``claim: value`` (nbval compares the line) and
    raise if it does not hold, so a broken lesson fails the notebook instead of being stored
    as ``False``. ``value`` is a bool, or a dict of bools that must all be true."""
    print(f"{claim}: {value}")
    import numpy as np

    ok = all(value.values()) if isinstance(value, dict) else value
    if not isinstance(ok, (bool, np.bool_)) or not ok:
        raise AssertionError(f"the chapter's check failed: {claim}: {value}")


def recorded_gpu(names: list[str], results: str = "results") -> str:
    """What the recorded GPU ladders in ``results`` (``*.json`` written by ``python -m labkit
    ladder`` on CUDA) say about the stages ``names``, each file with its device, torch, commit
    and how many commits behind this checkout's HEAD it was recorded, each row with its median
    env steps/s, the spread of its timed iterations and the harness's noise flag; for two stages
    recorded at the same N and T, what the chapters' own rule (:func:`labkit.book.claims.versus`)
    says of them. "No GPU run recorded yet" when there is none. A chapter prints this instead of
    quoting numbers."""
    from pathlib import Path

    from ..device import commits_since
    from ..files import read_json
    from .claims import versus

    lines = []
    for path in sorted(Path(results).glob("*.json")):
        try:
            data = read_json(path)
        except (OSError, ValueError):
            continue
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        if meta.get("device") != "cuda" or "ladder" not in data:
            continue
        behind = commits_since(meta.get("git_commit"))
        age = ("commits behind HEAD unknown (no git history here)" if behind is None else
               f"{behind} commit{'s' if behind != 1 else ''} behind HEAD")
        lines += [f"{path.name}: {meta.get('device_name', '?')}, torch {meta.get('torch')}, "
                  f"{meta.get('date')}", f"  commit {meta.get('git_commit')}, {age}"]
        shown = {}
        for i, row in enumerate(data["ladder"] if isinstance(data["ladder"], list) else [None]):
            if not isinstance(row, dict):
                raise ValueError(f"recorded_gpu: {path}: ladder row {i} is not a ladder row (a "
                                 "JSON object); a file of python -m labkit ladder has them")
            if row.get("name") not in names:
                continue
            if row.get("status") != "ok":
                lines.append(f"  {row['stage']} {row['name']:<15} {row.get('status')}")
                continue
            shown[row["name"]] = row
            lines += _gpu_row(row)
        if len(names) == 2 and all(n in shown for n in names):
            a, b = (shown[n] for n in names)
            if (a["n_envs"], a["n_steps"]) == (b["n_envs"], b["n_steps"]):
                lines += textwrap.wrap(versus(a, b, tuple(names)), 96, initial_indent="  => ",
                                       subsequent_indent="     ")
    return "\n".join(lines) if lines else "No GPU run recorded yet"


def _gpu_row(row: dict) -> list[str]:
    """A recorded ladder row in short lines: its median env steps/s with the range of its timed
    iterations, the harness's noise flag and its reasons where it is set, its reads (and every
    CUDA sync, where the row counted them), its phases."""
    spread = row.get("sps_spread") or [row["sps"]] * 3
    phases = ", ".join(f"{k} {v:.1f}" for k, v in row.get("phase_ms", {}).items())
    noise = "; ".join(str(reason) for reason in row.get("noise") or []) or "flagged"
    return [f"  {row['stage']} {row['name']:<15} N={row['n_envs']} T={row['n_steps']}, "
            f"{row.get('precision')}: {row['sps']:,.0f} env steps/s "
            f"({spread[0]:,.0f}-{spread[-1]:,.0f})",
            *([f"      NOISY: {noise}"] if row.get("noisy") else []),
            f"      {figure(row, 'device_reads_per_iter')} device reads (syncs) and "
            f"{figure(row, 'host_scalar_reads_per_iter')} host-scalar reads per iteration",
            *([f"      {row['cuda_syncs_per_iter']:,} CUDA syncs per iteration in all (pageable "
               "copies included)"] if row.get("cuda_syncs_per_iter") is not None else []),
            f"      ms per iteration: {phases}"]


def reads_by_line(sites: Counter | dict) -> Counter:
    """Host reads keyed by the line of code that made them (from ``SyncMeter(call_sites=True)
    .sites``): ``labkit/envs/torch_loop.py (step): if cell != WALL:``. The line's text rather
    than its number, so a compared count reads well and survives edits elsewhere in the file;
    a notebook cell's file becomes ``<cell>``."""
    return _rekey(sites, lambda path, line, func:
                  f"{_file(path)} ({func}): {source_line(path, line) or f'line {line}'}")


def reads_by_file(sites: Counter | dict, per: int = 1) -> dict[str, float]:
    """Host reads (``SyncMeter(call_sites=True).sites``) by the file that made them, divided by
    ``per``: ``{"labkit/logging.py": 1.0, ...}``, most first. Line numbers, function names and
    the ``via`` torch frame are dropped, so a count that a notebook compares survives edits."""
    out: Counter = Counter()
    for site, count in sites.items():
        parsed = parse_site(site)
        out[parsed[0] if parsed else site] += count
    return {path: count / per for path, count in sorted(out.items(), key=lambda kv: -kv[1])}
