"""What the chapters show: labkit's own source (never a copy), what changed between two
stages, and host reads laid out for reading."""
from __future__ import annotations

import difflib
import html
import inspect
from collections import Counter
from typing import Any

from .stages import Stage


def _target(obj: Any) -> Any:
    """What to read the source of: a class, a function, or the class of a component object."""
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return obj
    return type(obj)


def source(obj: Any) -> str:
    """The source of ``obj`` (a class, function, method, or component object), headed by
    where it lives: ``# labkit/rollout.py: DeviceCollector``."""
    target = _target(obj)
    module = inspect.getmodule(target)
    path = (module.__name__.replace(".", "/") + ".py") if module else "?"
    return f"# {path}: {target.__qualname__}\n" + inspect.getsource(target)


def diff(before: Any, after: Any, context: int = 2) -> str:
    """A unified diff of two objects' sources: what one component changes against another."""
    a, b = source(before).splitlines(), source(after).splitlines()
    return "\n".join(difflib.unified_diff(a, b, a[0][2:], b[0][2:], n=context, lineterm=""))


def side_by_side(before: Any, after: Any):
    """Two sources in two columns (HTML in a notebook; GitHub renders it too)."""
    from IPython.display import HTML

    cell = ("<td style='vertical-align:top;text-align:left'><pre style='font-size:11px'>"
            "{}</pre></td>")
    cols = "".join(cell.format(html.escape(source(x))) for x in (before, after))
    return HTML(f"<table><tr>{cols}</tr></table>")


def changed_slots(before: Stage, after: Stage) -> dict[str, tuple[Any, Any]]:
    """The slots ``after`` fills differently from ``before``: {slot: (old part, new part)}."""
    old, new = before.components(), after.components()
    return {k: (old[k], new[k]) for k in new if old[k] != new[k]}


def describe(part: Any) -> str:
    """A component's short name: a class or function name, or an executor's repr."""
    if inspect.isclass(part) or inspect.isroutine(part):
        return part.__name__
    return repr(part)


def stage_table(stages: list[Stage]) -> str:
    """One line per stage, one column per slot: the ladder as a table of components."""
    slots = list(stages[0].components())
    width = {k: max(len(k), *(len(describe(s.components()[k])) for s in stages)) + 2
             for k in slots}
    lines = [" " * 18 + "".join(f"{k:<{width[k]}}" for k in slots)]
    for s in stages:
        lines.append(f"{s.index} {s.name:<16}" + "".join(
            f"{describe(s.components()[k]):<{width[k]}}" for k in slots))
    return "\n".join(lines)


def reads_table(sites: Counter | dict, per: int = 1, top: int = 10) -> str:
    """Host reads by call site (from ``SyncMeter(call_sites=True).sites``), most first,
    divided by ``per`` (e.g. the number of steps) when it is not 1."""
    rows = sorted(sites.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    unit = "reads" if per == 1 else f"reads / {per}"
    lines = [f"{unit:>12}  call site"]
    lines += [f"{count / per:>12g}  {site}" for site, count in rows]
    return "\n".join(lines)
