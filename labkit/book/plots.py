"""Figures of a ladder result: ladder bars (log axis), phase bars, scaling lines, learning
curves."""
from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

from ..files import read_jsonl, save_figure
from . import expects


def _plt():
    import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg by itself
    return plt


def _title(result: dict) -> str:
    m = result["meta"]
    return f"{m['device_name']} · torch {m['torch']} · {m.get('profile') or ''}".strip(" ·")


def _range(rows: list[dict]) -> list[list[float]]:
    """Error bars from each row's min / median / max rate (none where a row has no spread)."""
    lows, highs = [], []
    for r in rows:
        lo, mid, hi = r.get("sps_spread") or (math.nan,) * 3
        lows.append(mid - lo)
        highs.append(hi - mid)
    return [lows, highs]


@expects("a ladder result (what `python -m labkit ladder` writes): 'meta' and at least one "
         "row in 'ladder'")
def ladder_bars(result: dict, ax=None):
    """Env steps/s per stage on a log axis, each bar with the min-max range of its timed
    iterations (orange: marked noisy); skipped stages are labelled, not drawn."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    rows = result["ladder"]
    names = [f"{r['stage']} {r['name']}" for r in rows]
    values = [r["sps"] if r.get("status") == "ok" else 0 for r in rows]
    noisy = [bool(r.get("noisy")) for r in rows]
    ax.bar(range(len(rows)), [v or math.nan for v in values],
           color=["tab:orange" if n else "tab:blue" for n in noisy],
           yerr=_range(rows), capsize=3, ecolor="black")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax.set_ylabel("env steps / s (PPO iteration)")
    ax.set_title(f"The ladder, N={rows[0]['n_envs']} — {_title(result)}")
    tops = []
    for i, r in enumerate(rows):
        if r.get("status") == "ok":
            top = max(r.get("sps_spread") or [r["sps"]])  # above the error bar, not on it
            tops.append(top)
            ax.annotate(f"{r['sps']:,.0f}" + (" noisy" if r.get("noisy") else ""),
                        (i, top), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
        else:  # "skipped: needs CUDA" or "error: ...", up the empty slot, inside the axes
            label = textwrap.shorten(r["status"], 40, placeholder=" …")
            ax.annotate(label, (i, 0.04), xycoords=("data", "axes fraction"), rotation=90,
                        ha="center", va="bottom", fontsize=8, color="gray")
    if tops:  # headroom for the labels on the log axis
        low, _ = ax.get_ylim()
        ax.set_ylim(low, max(tops) * 1.35)
    ax.set_xlim(-0.6, len(rows) - 0.4)  # room for a last stage that has no bar
    ax.figure.tight_layout()
    return ax


@expects("a ladder result with a scaling sweep: 'meta' and rows in 'scaling'")
def scaling_lines(result: dict, ax=None):
    """Env steps/s against N for each stage of the scaling sweep (log-log), with each point's
    min-max range; a ring marks a noisy point."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    by_stage: dict[str, list] = {}
    for r in result["scaling"]:
        if r.get("status") == "ok":
            by_stage.setdefault(f"{r['stage']} {r['name']}", []).append(r)
    for name, rows in by_stage.items():
        rows = sorted(rows, key=lambda r: r["n_envs"])
        xs, ys = [r["n_envs"] for r in rows], [r["sps"] for r in rows]
        line = ax.errorbar(xs, ys, yerr=_range(rows), marker="o", capsize=3, label=name)
        bad = [(x, y) for x, y, r in zip(xs, ys, rows) if r.get("noisy")]
        if bad:  # a hollow ring round each noisy point
            ax.scatter(*zip(*bad), s=120, facecolors="none", edgecolors=line[0].get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (parallel envs)")
    ax.set_ylabel("env steps / s")
    ax.set_title(f"Scaling — {_title(result)}", fontsize=9)
    if by_stage:
        ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


@expects("{name: curve}, each curve a list of points with 'steps', 'wall_s' and "
         "'mean_return'")
def learning_curves(curves: dict[str, list[dict]], axes=None, oracle: float | None = None,
                    random: float | None = None):
    """Mean episode return against env steps and against wall time, one line per run, with
    the scripted oracle's and a random policy's returns as reference lines."""
    plt = _plt()
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, curve in curves.items():
        points = [p for p in curve if isinstance(p["mean_return"], (int, float))
                  and p["mean_return"] == p["mean_return"]]  # no episode ended: no point
        if not points:
            continue
        axes[0].plot([p["steps"] for p in points], [p["mean_return"] for p in points],
                     marker=".", label=name)
        axes[1].plot([p["wall_s"] for p in points], [p["mean_return"] for p in points],
                     marker=".", label=name)
    for ax, xlabel in zip(axes, ("env steps", "wall time (s)")):
        if oracle is not None:
            ax.axhline(oracle, color="gray", ls="--", lw=1, label="scripted oracle")
        if random is not None:
            ax.axhline(random, color="gray", ls=":", lw=1, label="random policy")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean episode return")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    axes[0].figure.tight_layout()
    return axes


#: What a run's records can hold (a run logs a non-finite number as null): steps and seconds
#: from 0, returns bounded by an episode's length (a reward of -1, 0 or +1 per step).
_RUN_RANGE = {"step": (0, 1e15), "wall_s": (0, 1e10), "mean_return": (-1e9, 1e9)}


def run_curve(run_dir: str | Path) -> list[dict]:
    """Learning-curve points (steps, wall_s, mean_return) of a ``train`` run's metrics.jsonl.
    A line that is not a record with those numbers raises ValueError naming the file, the line
    and the field; a torn last line (the run was killed mid-write: no newline ends it) is left
    out."""
    path = Path(run_dir) / "metrics.jsonl"
    points = []
    for i, r in read_jsonl(path):  # the line a killed run was writing left out
        if not isinstance(r, dict):
            raise ValueError(f"{path} line {i} is not a record")
        for key in ("step", "wall_s", "mean_return"):
            value = r.get(key, "missing")
            if key == "mean_return" and value is None:
                continue  # no episode ended in that iteration: a record with no point
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path} line {i} has no number {key!r} (a run of an older "
                                 "labkit, or another file)")
            low, high = _RUN_RANGE[key]
            if not low <= value <= high:  # inf and NaN too: a run logs non-finite as null
                raise ValueError(f"{path} line {i} has {key} = {value:g}, outside the "
                                 f"{low:g}..{high:g} a run logs (the file was edited, or is "
                                 "another's)")
        points.append({"steps": r["step"], "wall_s": r["wall_s"],
                       "mean_return": r["mean_return"], "iteration": r.get("iteration")})
    if not points:
        raise ValueError(f"{path} has no iteration logged yet")
    return points


def history_gaps(points: list[dict]) -> list[str]:
    """The iterations a run's records lack ("1-4", "9"), by the records' ``iteration`` (a run
    logs one per iteration from 1): a history truncated or edited in place, drawn without
    them."""
    numbers = [p["iteration"] for p in points if isinstance(p.get("iteration"), int)]
    gaps, expected = [], 1
    for n in numbers:
        if n > expected:
            gaps.append(f"{expected}-{n - 1}" if n - 1 > expected else f"{expected}")
        expected = max(expected, n + 1)
    return gaps


def save_figures(result: dict, out_dir: str | Path, stem: str) -> list[Path]:
    """Write the ladder, scaling, phases and learning-curve PNGs; return their paths. A figure
    whose section has no row yet (a record's sweep can come before its ladder, or its ladder
    before its sweep) is not drawn."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, section, draw in (
            ("ladder", "ladder", ladder_bars), ("scaling", "scaling", scaling_lines),
            ("phases", "ladder", lambda r: phase_bars(r["ladder"], title=_title(r)))):
        if not result.get(section):
            continue
        ax = draw(result)
        paths.append(out_dir / f"{stem}_{suffix}.png")
        save_figure(ax.figure, paths[-1])
        plt.close(ax.figure)
    curves = {f"{r['stage']} {r['name']}": r["curve"] for r in result.get("ladder", [])
              if r.get("status") == "ok"}
    if curves:
        axes = learning_curves(curves)
        paths.append(out_dir / f"{stem}_learning.png")
        save_figure(axes[0].figure, paths[-1])
        plt.close(axes[0].figure)
    return paths


@expects("rows of measure_stage (each with 'stage', 'name' and 'phase_ms')")
def phase_bars(rows: list[dict], ax=None, title: str | None = None):
    """Stacked bars: milliseconds per iteration in each phase, one bar per measured row."""
    from ..timing import PHASES

    plt = _plt()
    rows = [r for r in rows if r.get("status") == "ok" and r.get("phase_ms")]
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4, 1.1 * len(rows) + 2), 3.5))
    names = [f"{r['stage']} {r['name']}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in PHASES.items():
        values = [r["phase_ms"].get(key, 0.0) for r in rows]
        if not any(v > 0 for v in values):
            continue
        ax.bar(range(len(rows)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax.set_ylabel("ms per iteration")
    ax.set_title(title or "Where an iteration goes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.figure.tight_layout()
    return ax


def time_over_n(rows: list[dict], ax=None, title: str | None = None):
    """Median ms per iteration against N (log-log) for measured rows of one stage, the model
    work alone (the compute ceiling) beside it, and a dashed line proportional to N through
    the smallest N. Flat: overhead-bound (N is nearly free); parallel to the dashed line:
    the hardware is busy, each env costs its share of compute or memory traffic."""
    plt = _plt()
    rows = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["n_envs"])
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ns = [r["n_envs"] for r in rows]
    ms = [1e3 * r["iteration_s"] for r in rows]
    ceiling = [1e3 * r["n_envs"] * r["n_steps"] / r["ceiling_sps"] for r in rows]
    ax.plot(ns, ms, marker="o", label="one PPO iteration")
    ax.plot(ns, ceiling, marker="s", label="model work alone (ceiling)")
    if ns:
        ax.plot(ns, [ms[0] * n / ns[0] for n in ns], ls="--", color="gray",
                label="proportional to N")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (parallel envs)")
    ax.set_ylabel("ms per iteration (median)")
    ax.set_title(title or "Time per iteration over N")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def plot_runs(runs: list[str | Path], out: str | Path, oracle: float | None = None) -> Path:
    """``python -m labkit plot-runs``: the learning curves of ``train`` run folders against
    steps and wall time, written whole to the image ``out`` (its suffix names the format).
    ValueError naming the argument for a folder that holds no run or a format matplotlib does
    not write, before anything is drawn."""
    from ..files import OutputError, check_output_dir, is_dir
    from ..signals import signals_deferred

    plt = _plt()
    for d in runs:
        if not is_dir(d, "runs") or not (Path(d) / "metrics.jsonl").is_file():
            raise ValueError(f"runs: {d} is not a train run folder (no metrics.jsonl in it)")
    out = Path(out)
    check_output_dir(out.parent, "--out's folder")
    if out.is_dir():
        raise OutputError(f"--out: {out} is a folder; it must be a file name free to write")
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if out.suffix[1:].lower() not in formats:
        raise ValueError(f"--out: {out.name} names no image format matplotlib writes; end it "
                         f"in one of {', '.join('.' + f for f in sorted(formats))}")
    curves = {}
    for d in runs:
        points, name = run_curve(d), Path(d).name
        gaps = history_gaps(points)
        if gaps:  # said on the figure and here: a torn curve is never drawn without a word
            print(f"note: {Path(d) / 'metrics.jsonl'} has no record of iteration(s) "
                  f"{', '.join(gaps)}: its history has a gap, drawn without them",
                  file=sys.stderr)
            name += f" (no iteration {', '.join(gaps)})"
        curves[name] = points
    axes = learning_curves(curves, oracle=oracle)
    with signals_deferred():  # an image half written is worse than none
        save_figure(axes[0].figure, out)
    plt.close(axes[0].figure)
    return out


#: Colours of a trace's event categories (C0-C5 are the phases', as in :func:`phase_bars`).
_TRACE_COLOURS = {"cpu_op": "C7", "user_annotation": "C8", "cuda_runtime": "C6",
                  "kernel": "C9", "gpu_memcpy": "tab:brown", "gpu_memset": "tab:brown"}


def _timeline(events: list[dict]) -> tuple[list, dict, list, list]:
    """A trace's top-level events laid out: the threads in row order (the CPU's, then the GPU
    streams), their names, a box (ms, ms, event) per event and a span (phase, ms, ms) per
    labkit phase, in milliseconds from the first phase's start (or the first event's)."""
    from ..measure.profiling import phase_spans, top_level

    outer, phases = top_level(events), phase_spans(events)
    t0 = phases[0][1] if phases else min(float(e["ts"]) for e in outer)
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {(e.get("pid"), e.get("tid")) for e in outer
           if str(e.get("cat", "")).startswith(("kernel", "gpu_"))}
    threads = sorted({(e.get("pid"), e.get("tid")) for e in outer},
                     key=lambda t: (t in gpu, str(t)))
    boxes = [((float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0.0)) / 1e3, e) for e in outer]
    spans = [(p, (s - t0) / 1e3, (end - s) / 1e3) for p, s, end in phases]
    return threads, names, boxes, spans


def _timeline_legend(ax, shown_phases: list[str]) -> dict:
    """One legend entry per event category drawn, then one per phase shown."""
    from matplotlib.patches import Patch

    from ..timing import PHASES

    legend = dict(zip(*reversed(ax.get_legend_handles_labels())))
    for key, phase in enumerate(PHASES):
        if phase in shown_phases:
            legend[f"phase: {phase}"] = Patch(color=f"C{key}")
    return legend


def trace_timeline(trace, ax=None, window: tuple[float, float] | None = None,
                   title: str | None = None):
    """A Chrome trace (its path, or its events from ``profiling.read_trace``) as a timeline,
    for where no trace viewer is at hand: one row per thread (a GPU stream is a thread of its
    own) with a box per top-level event (``profiling.top_level``), coloured by category and
    named where it is wide enough, and a row of labkit's phases (``phase: <name>``) on top.
    Milliseconds from the first phase's start (or the first event's); ``window`` (ms, ms)
    zooms in."""
    from ..measure.profiling import read_trace
    from ..timing import PHASES

    plt = _plt()
    events = read_trace(trace) if isinstance(trace, (str, Path)) else trace
    threads, names, boxes, spans = _timeline(events)
    phases = bool(spans)
    lo, hi = window or (min(x for x, _, _ in boxes), max(x + w for x, w, _ in boxes))
    width = hi - lo

    def shown(x: float, w: float) -> bool:
        return x + w > lo and x < hi

    def label(x: float, w: float, y: float, text: str) -> None:
        left, right = max(x, lo), min(x + w, hi)  # the part inside the window
        room = int(110 * (right - left) / width)  # characters that fit there, roughly
        if room >= 4:
            ax.text((left + right) / 2, y, text[:room], ha="center", va="center", fontsize=7,
                    clip_on=True)

    rows = (["phases"] if phases else []) + [names.get(t) or f"{t[0]} / {t[1]}" for t in threads]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.4))
    for phase, x, w in spans:
        if shown(x, w):
            key = list(PHASES).index(phase) if phase in PHASES else 7
            ax.broken_barh([(x, w)], (-0.4, 0.8), facecolors=f"C{key % 10}", edgecolors="white",
                           linewidth=0.5)
            label(x, w, 0, phase)
    first = bool(phases)
    for row, thread in enumerate(threads, start=first):
        mine = [(x, w, e) for x, w, e in boxes if (e.get("pid"), e.get("tid")) == thread
                and shown(x, w)]
        by_cat: dict[str, list] = {}
        for x, w, e in mine:
            by_cat.setdefault(e.get("cat", "?"), []).append((x, w))
        for cat, bars in sorted(by_cat.items()):
            colour = _TRACE_COLOURS.get(cat, "0.5")
            ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colour, edgecolors=colour,
                           linewidth=0.3, label=cat)
        for x, w, e in mine:
            label(x, w, row, str(e.get("name", "")))
    legend = _timeline_legend(ax, [p for p, x, w in spans if shown(x, w)])
    ax.legend(legend.values(), legend.keys(), fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    ax.set_yticks(range(len(rows)), [textwrap.shorten(r, 28, placeholder="…") for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the phases on top
    ax.set_xlim(lo, hi)
    ax.set_xlabel("ms from the first phase" if phases else "ms from the first event")
    ax.set_title(title or "Trace timeline")
    ax.figure.tight_layout()
    return ax
