"""What the doctor reports: a :class:`~labkit.doctor.kinds.Finding` per regression (kind,
where, evidence, cost, the chapter with the fix) and the :class:`Report` of one diagnosis, for
people and as JSON; :func:`compare_times` sets a diagnosis' timed iterations against another's
(a plant's against the clean stage's) with a verdict that says when the difference is within
the noise."""
from __future__ import annotations

import re
import statistics
import textwrap
from dataclasses import asdict, dataclass, field

from ..measure.noise import spread
from .kinds import KINDS, Finding

#: Width of the text report: a finding's summary and fix wrap there.
WIDTH = 100


@dataclass
class Report:
    """What ``diagnose`` found on one pipeline. ``format()`` is for people, ``to_dict()`` for
    programs; ``kinds`` lists the finding kinds. ``graphs_off``: the stage's CUDA graphs were
    replaced by the eager steps they replay (:func:`without_graphs`).

    ``host_reads``: every read of tensor data on the host in the metered iteration, by
    ``per_step`` (rollout), ``per_update`` and ``by_kind`` (the totals), ``accepted`` (the
    deliberate device reads the stage is meant to make), and the split: ``device`` (reads of
    device tensors: a sync each on a GPU, the only reads a ``device_read`` finding is about) and
    ``host_scalar`` (tensors that live on the CPU in a GPU run too, such as a non-fused Adam's
    step counters: Python time, no wait for the GPU), each with ``per_step``, ``per_update``
    and ``by_kind``. ``iteration_s_samples``: the seconds of each timed iteration;
    ``iteration_s`` is their median."""

    stage: str
    device: str
    n_envs: int
    n_steps: int
    iterations: int
    status: str = "ok"
    graphs_off: bool = False
    findings: list[Finding] = field(default_factory=list)
    iteration_s: float | None = None
    iteration_s_samples: list[float] = field(default_factory=list)
    phase_ms: dict = field(default_factory=dict)
    host_reads: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return sorted({f.kind for f in self.findings}, key=list(KINDS).index)

    to_dict = asdict

    def format(self, evidence: int = 6) -> str:
        """The report for people: a head, the read counts, then each finding with at most
        ``evidence`` lines of evidence (the JSON has all of it)."""
        head = f"labkit doctor: {self.stage} on {self.device}, N={self.n_envs} x T={self.n_steps}"
        if self.status != "ok":
            return f"{head}: {self.status}"
        if self.graphs_off:
            head += ", without its CUDA graphs (each replays the eager step run here)"
        lines = [head]
        if self.iteration_s:
            timed = f"{self.iterations} timed iterations: median {1e3 * self.iteration_s:.1f} ms"
            if self.iteration_s_samples:
                timed += (f", min {1e3 * min(self.iteration_s_samples):.1f}, "
                          f"max {1e3 * max(self.iteration_s_samples):.1f}")
            lines.append(timed)
        lines += [*self._read_lines(), *self.notes]
        if not self.findings:
            lines.append("no findings: the stage does only what it is meant to")
            return "\n".join(lines)
        n = len(self.findings)
        lines.append(f"{n} finding{'s' if n > 1 else ''}:")
        for i, f in enumerate(self.findings, 1):
            lines.append("")
            lines += _wrap(f"{i}. [{f.kind}] {f.where}: {f.summary}", "   ")
            lines += [f"     {line}" for line in _evidence_lines(f)[:evidence]]
            lines += _wrap(f"   cost: {_cost_text(f.cost)}", "     ")
            lines += _wrap(f"   fix: {f.fix}", "     ")
            notebook, section = re.match(r"(\d\d_\w+)(.*)", f.chapter).groups()
            lines.append(f"   read: notebooks/{notebook}.ipynb{section}")
        return "\n".join(lines)

    __str__ = format

    def _read_lines(self) -> list[str]:
        reads = self.host_reads
        if not reads:
            return []
        device = reads.get("device", reads)  # a report without the split: its totals
        accepted = ", ".join(f"{n} at {s}" for s, n in reads.get("accepted", {}).items())
        lines = _wrap(f"device reads (a sync each on a GPU): {device['per_step']:g} per rollout "
                      f"step, {device['per_update']} per update"
                      + (f" (deliberate, accepted: {accepted})" if accepted else ""), "  ")
        scalar = reads.get("host_scalar", {})
        if scalar.get("per_step") or scalar.get("per_update"):
            lines += _wrap(f"host-scalar reads (CPU tensors in a GPU run too, no GPU wait): "
                           f"{scalar['per_step']:g} per rollout step, {scalar['per_update']} "
                           "per update", "  ")
        return lines


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [text]


def _cost_text(cost: dict) -> str:
    if cost.get("ms_per_iteration") is not None:
        return (f"up to {cost['ms_per_iteration']:.1f} ms per iteration "
                f"({'+'.join(cost['phases'])}), {100 * cost['share']:.0f}% of the iteration")
    if cost.get("extra_launches_per_update") is not None:
        return (f"{cost['extra_launches_per_update']:g} more kernel launches per update than "
                "the clean stage: launch overhead on a GPU, not timed here")
    return "not estimated"


def _evidence_lines(f: Finding) -> list[str]:
    ev = f.evidence
    lines = [f"{op}: {n['this stage']:g} vs {n['clean stage']:g} in the clean stage"
             for op, n in ev.get("ops", {}).items()]
    if "launches_by_op" in ev:
        return lines + [f"launches per step by op: {ev['launches_by_op']}"] + [
            f"{s['per_update']:g} optimizer steps per update at {s['site']}"
            for s in ev["sites"]]
    if "sites" in ev:
        return lines + [f"{rate(s['per_step'], s['per_update'])}  {s['site']}"
                        for s in ev["sites"][:6]]
    if "reasons" in ev:
        return ev["reasons"][:4]
    if "user_code" in ev:
        return [ev["explanation"], ("in " if f.kind == "error" else "while tracing ")
                + " -> ".join(ev["user_code"])]
    if "held_tensors" in ev:
        return [f"tensors held by `{ev['attribute']}` at each iteration boundary: "
                + " -> ".join(map(str, ev["held_tensors"])),
                "live tensors: " + " -> ".join(map(str, ev["live_tensors"])),
                "process RSS, MiB: " + " -> ".join(map(str, ev["rss_mb"]))]
    return [f"{k}: {v}" for k, v in ev.items()]


def rate(per_step: float, per_update: float) -> str:
    return ", ".join(x for x in (f"{per_step:g} per step" if per_step else "",
                                 f"{per_update:g} per update" if per_update else "") if x) or "0"


#: What :func:`compare_times` says when two sets of timed iterations overlap.
WITHIN_NOISE = "within noise"


def compare_times(samples: list[float], reference: list[float]) -> dict:
    """``samples`` (seconds of timed iterations, a plant's) against ``reference`` (the clean
    stage's): min, median and max of each, the ratio of the medians, each one's spread
    (:func:`labkit.measure.noise.spread`), and a verdict. The verdict is ``"within noise"``
    when the two ranges [min, max] overlap: then some iteration of one was as fast as some
    iteration of the other, and the ratio of medians says nothing the noise could not. Only
    ranges apart give ``"slower"`` or ``"faster"``. Needs at least one sample on each side."""
    if not samples or not reference:
        raise ValueError("compare_times needs at least one sample on each side")
    lo, hi = min(samples), max(samples)
    ref_lo, ref_hi = min(reference), max(reference)
    if lo > ref_hi:
        verdict = "slower"
    elif hi < ref_lo:
        verdict = "faster"
    else:
        verdict = WITHIN_NOISE
    return {"min": lo, "median": statistics.median(samples), "max": hi,
            "ratio": statistics.median(samples) / statistics.median(reference),
            "spread": spread(samples), "reference_spread": spread(reference),
            "verdict": verdict}


def symptoms(compared: dict[str, dict], device: str) -> str:
    """Sentences about the plants' times from :func:`compare_times` results ({plant: result}):
    which ran slower than the clean stage beyond the noise, which faster, and how many sat
    within it, on ``device`` (words such as "this CPU")."""
    by = {v: [name for name, c in compared.items() if c["verdict"] == v]
          for v in ("slower", "faster", WITHIN_NOISE)}
    n = len(compared)
    out = []
    for verdict in ("slower", "faster"):
        names = by[verdict]
        if names:
            ratios = ", ".join(f"{name} {compared[name]['ratio']:.2f}x" for name in names)
            out.append(f"On {device}, {len(names)} of {n} plants ran {verdict} than the clean "
                       f"stage beyond the noise (every timed iteration apart): {ratios}.")
    if by[WITHIN_NOISE]:
        lead = "The other" if len(by[WITHIN_NOISE]) < n else f"On {device}, all"
        out.append(f"{lead} {len(by[WITHIN_NOISE])} "
                   f"{'is' if len(by[WITHIN_NOISE]) == 1 else 'are'} within noise: their "
                   "timed iterations overlap the clean stage's, so their median ratios say "
                   "nothing here; their counts below still do.")
    return "\n".join(textwrap.fill(s, WIDTH) for s in out)
