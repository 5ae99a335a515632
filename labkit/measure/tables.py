"""Results tables, each defined once: its columns over one kind of row, rendered as fixed-width
text (what the CLI prints), as Markdown (``results/RESULTS.md``, the README) or as HTML in a
box that scrolls sideways (what the chapters display).

A row whose ``status`` is not ``ok`` shows its key columns and then the status, so a stage that
was skipped or failed says why in the same place in both renderings.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .noise import spread


def fmt(value: float | None, spec: str = ",.0f") -> str:
    """``value`` formatted by ``spec``, or ``-`` where there is none."""
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    """``ratio`` as "3.2x", or ``-`` where there is none."""
    return "-" if ratio is None else f"{ratio:.1f}x"


@dataclass(frozen=True)
class Column:
    """One column: a short header for text, a longer one for Markdown, and its cell. A column
    with ``only_with`` is shown where some row that ran has that key (a CUDA-only figure is
    left out of a CPU table rather than a column of dashes)."""

    head: str
    title: str
    cell: Callable[[dict], str]
    width: int = 8
    left: bool = False
    only_with: str | None = None

    def pad(self, text: str) -> str:
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"


@dataclass(frozen=True)
class Table:
    """Columns over rows; the first ``keys`` columns are shown for rows that did not run."""

    columns: tuple[Column, ...]
    keys: int = 2

    @staticmethod
    def ran(row: dict) -> bool:
        return row.get("status", "ok") == "ok"

    def shown(self, rows: list[dict]) -> tuple[Column, ...]:
        """The columns ``rows`` show: all but those whose ``only_with`` key no row that ran
        has."""
        return tuple(c for c in self.columns if c.only_with is None
                     or any(self.ran(r) and c.only_with in r for r in rows))

    def text(self, rows: Iterable[dict]) -> str:
        """A header, a rule and one line per row, columns separated by a space."""
        rows = list(rows)
        columns = self.shown(rows)
        head = " ".join(c.pad(c.head) for c in columns).rstrip()
        lines = [head, "-" * len(head)]
        for r in rows:
            if self.ran(r):
                cells = [c.pad(c.cell(r)) for c in columns]
            else:
                cells = [c.pad(c.cell(r)) for c in columns[:self.keys]] + [r["status"]]
            lines.append(" ".join(cells).rstrip())
        return "\n".join(lines)

    def markdown(self, rows: Iterable[dict]) -> str:
        """A Markdown table with the long headers."""
        rows = list(rows)
        columns = self.shown(rows)
        n = len(columns)
        lines = ["| " + " | ".join(c.title for c in columns) + " |", "|---" * n + "|"]
        for r in rows:
            if self.ran(r):
                cells = [c.cell(r) for c in columns]
            else:
                cells = ([c.cell(r) for c in columns[:self.keys]] + [r["status"]]
                         + [""] * (n - self.keys - 1))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def html(self, rows: Iterable[dict]) -> str:
        """An HTML table (the short headers, the long ones as tooltips) in a box that scrolls
        sideways on its own: what a chapter displays, so that a page never wraps a row."""
        def cell(tag: str, text: str, column: Column | None = None, span: int = 1) -> str:
            align = "left" if column is None or column.left else "right"
            title = f" title='{html.escape(column.title, quote=True)}'" \
                if tag == "th" and column else ""
            extra = f" colspan='{span}'" if span > 1 else ""
            return (f"<{tag}{title}{extra} style='text-align:{align};white-space:nowrap'>"
                    f"{html.escape(text)}</{tag}>")

        rows = list(rows)
        columns = self.shown(rows)
        head = "".join(cell("th", c.head, c) for c in columns)
        body = []
        for r in rows:
            if self.ran(r):
                cells = "".join(cell("td", c.cell(r), c) for c in columns)
            else:
                cells = "".join(cell("td", c.cell(r), c) for c in columns[:self.keys]) \
                    + cell("td", r["status"], span=len(columns) - self.keys)
            body.append(f"<tr>{cells}</tr>")
        return (f"<div style='overflow-x:auto'><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table></div>")


def _pct(key: str, spec: str = ".1f") -> Callable[[dict], str]:
    return lambda r: fmt(100 * r[key] if r.get(key) is not None else None, spec)


def _spread(r: dict) -> str:
    seconds = r.get("iteration_s_samples")
    return fmt(100 * spread(seconds) if seconds else None, ".0f")


#: What a figure shows in a row recorded before it existed (never 0, never an error).
MISSING = "\u2014"


def _count(key: str, spec: str = "g") -> Callable[[dict], str]:
    return lambda r: MISSING if r.get(key) is None else f"{r[key]:{spec}}"


#: Short names of what runs the model math, for the ladder's "math" column.
_MATH = {"eager": "e", "compiled": "c", "graphed eager": "ge", "graphed compiled": "gc"}


def _math(r: dict) -> str:
    """``e/c``: the rollout's model math eager, the update's compiled (``*``: chosen by timing
    at warmup), ``+mm`` a part whose convolutions run as matmuls; "" for a row recorded
    before the column existed."""
    math = r.get("model_math")
    if not math:
        return ""
    conv = r.get("conv_math") or {}
    chosen = "*" if any(m.get("why") == "timed" for m in [
        *(r.get("executor_choices") or {}).values(), *conv.values()]) else ""
    return "/".join(_MATH.get(math[p], math[p]) + ("+mm" if conv.get(p, {}).get("kept")
                                                     == "matmul" else "")
                    for p in ("rollout", "update")) + chosen


def _noise(r: dict) -> str:
    return "noisy" if r.get("noisy") else ""


_INDEX = Column("#", "#", lambda r: str(r["stage"]), 2)
#: The timed iterations' interquartile range in % of their median, and the row's verdict.
_SPREAD = Column("IQR%", "IQR % of median", _spread, 4)
_NOISE = Column("noise", "noise", _noise, 5, left=True)
_NAME = Column("stage", "stage", lambda r: r["name"], 15, left=True)

#: The ladder: one row per stage at one N (``run_ladder``'s ``result["ladder"]``).
LADDER = Table((
    _INDEX, _NAME,
    Column("N", "N", lambda r: str(r["n_envs"]), 6),
    # shown where a row was timed over fewer steps per env than the others (steps_bound)
    Column("T", "T (steps per env an iteration)", lambda r: str(r["n_steps"]), 4,
           only_with="steps_bound"),
    Column("sps", "env steps/s", lambda r: fmt(r["sps"]), 10),
    _SPREAD,
    Column("x st0", "x stage 0", lambda r: fmt(r.get("x_vs_stage0"), ".1f"), 6),
    Column("x prev", "x prev", lambda r: fmt(r.get("x_vs_prev"), ".2f"), 6),
    Column("syncs/it", "device reads (syncs) / iter", _count("device_reads_per_iter"), 8),
    # what waits on a GPU: every sync CUDA reported, pageable host-to-device copies included
    Column("cuda/it", "CUDA syncs / iter (device reads and pageable copies)",
           _count("cuda_syncs_per_iter"), 7, only_with="cuda_syncs_per_iter"),
    Column("host/it", "host-scalar reads / iter", _count("host_scalar_reads_per_iter"), 7),
    # a replayed CUDA graph's own nodes included (graph_kernels_per_step of them)
    Column("k/step", "kernels (GPU launches and CUDA graph nodes) / rollout step",
           _count("kernels_per_step", ".4g"), 7),
    Column("k/mb", "kernels (GPU launches and CUDA graph nodes) / minibatch step",
           _count("kernels_per_minibatch", ".4g"), 6),
    # what a run spends before its first iteration: the warm-up iteration (compiles, captures)
    # and the timing of the choices a stage that compiles where it pays makes
    Column("set-up s", "set-up s (warm-up iteration and timed choices)",
           lambda r: f"{r['warmup_s'] + r.get('choose_s', 0.0):.2f}", 8),
    Column("ceil sps", "ceiling steps/s", lambda r: fmt(r["ceiling_sps"]), 10),
    Column("% ceil", "% of ceiling", _pct("frac_of_ceiling"), 6),
    # every row's model work over one matmul peak, whatever precision the stage runs in
    Column("% peak", "% of peak", _pct("frac_of_peak", ".2f"), 6),
    Column("upd %pk", "update % of peak", _pct("update_frac_of_peak", ".2f"), 7,
           only_with="update_frac_of_peak"),
    Column("precision", "precision", lambda r: r["precision"], 9, left=True),
    Column("math", "model math (rollout/update)", lambda r: _math(r), 12, left=True),
    _NOISE,
), keys=3)

#: The scaling sweep: one row per stage and N (``result["scaling"]``).
SCALING = Table((
    _INDEX, _NAME,
    Column("N", "N", lambda r: str(r["n_envs"]), 7),
    Column("sps", "env steps/s", lambda r: fmt(r["sps"]), 12),
    _SPREAD,
    Column("% ceil", "% of ceiling", _pct("frac_of_ceiling"), 7),
    _NOISE,
), keys=3)


def phases(keys: Iterable[str], titles: dict[str, str]) -> Table:
    """Milliseconds per iteration in each phase of ``keys``, then the phase marks' overhead
    and the marked-vs-unmarked difference (rows of ``result["ladder"]``)."""
    def ms(key: str) -> Callable[[dict], str]:
        return lambda r: f"{r['phase_ms'].get(key, 0.0):.1f}"

    return Table((
        _INDEX, _NAME,
        *(Column(k, titles[k], ms(k), 9) for k in keys),
        Column("marks", "marks %", _pct("marks_overhead", ".2f"), 7),
        Column("A/B", "marked vs plain %", _pct("marks_ab", "+.1f"), 7),
    ))


#: The env benchmark: one row per implementation and N (``bench_envs``' ``result["rows"]``).
ENVS = Table((
    Column("impl", "implementation", lambda r: r["impl"], 26, left=True),
    Column("n_envs", "N", lambda r: str(r["n_envs"]), 7),
    Column("steps/s", "env steps/s (median)", lambda r: fmt(r["steps_per_s"]), 11),
    Column("min", "min", lambda r: fmt((r.get("steps_per_s_spread") or [None])[0]), 11),
    Column("max", "max", lambda r: fmt((r.get("steps_per_s_spread") or [None])[-1]), 11),
    Column("ops/step", "aten ops / step", lambda r: fmt(r.get("ops_per_step"), "d"), 8),
    Column("compile s", "seconds to compile", lambda r: fmt(r.get("compile_s"), ".1f"), 9),
    Column("vs ForagePy", "vs ForagePy", lambda r: _times(r.get("ratio_vs_py")), 11),
))

#: Learning runs: one row per stage (``record``'s ``learning_*.json``, rows with ``stage``).
LEARNING = Table((
    Column("stage", "stage", lambda r: r["stage"], 15, left=True),
    Column("return", "final mean return", lambda r: fmt(r["final_mean_return"], ".1f"), 8),
    Column("steps", "env steps", lambda r: f"{r['steps']:,}", 10),
    Column("wall s", "wall s", lambda r: f"{r['wall_s']:.0f}", 7),
    Column("sps", "steps/s", lambda r: fmt(r["steps_per_s"]), 9),
), keys=1)
