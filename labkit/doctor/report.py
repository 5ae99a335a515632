"""What the doctor reports: a :class:`Finding` per regression (kind, where, evidence, cost,
the chapter with the fix) and the :class:`Report` of one diagnosis, for people and as JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("host_read", "cpu_allocation", "memory_growth", "excess_ops", "recompile",
         "graph_break", "precision", "error")


@dataclass
class Finding:
    """One regression: what, where, the evidence, its estimated cost and the chapter to read."""

    kind: str
    where: str
    summary: str
    evidence: dict
    cost: dict
    chapter: str
    fix: str

    to_dict = asdict


@dataclass
class Report:
    """What ``diagnose`` found on one pipeline. ``format()`` is for people, ``to_dict()`` for
    programs; ``kinds`` lists the finding kinds. ``graphs_off``: the stage's CUDA graphs were
    replaced by the eager steps they replay (:func:`without_graphs`)."""

    stage: str
    device: str
    n_envs: int
    n_steps: int
    iterations: int
    status: str = "ok"
    graphs_off: bool = False
    findings: list[Finding] = field(default_factory=list)
    iteration_s: float | None = None
    phase_ms: dict = field(default_factory=dict)
    host_reads: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return sorted({f.kind for f in self.findings}, key=KINDS.index)

    to_dict = asdict

    def format(self) -> str:
        head = f"labkit doctor: {self.stage} on {self.device}, N={self.n_envs} x T={self.n_steps}"
        if self.status != "ok":
            return f"{head}: {self.status}"
        if self.graphs_off:
            head += ", without its CUDA graphs (each replays the eager step run here)"
        lines = [head + (f", {self.iterations} timed iterations (median "
                         f"{1e3 * self.iteration_s:.1f} ms)" if self.iteration_s else "")]
        reads = self.host_reads
        if reads:
            accepted = ", ".join(f"{n} at {s}" for s, n in reads.get("accepted", {}).items())
            lines.append(f"host reads: {reads['per_step']:g} per rollout step, "
                         f"{reads['per_update']} per update"
                         + (f" (deliberate, accepted: {accepted})" if accepted else ""))
        lines += self.notes
        if not self.findings:
            lines.append("no findings: the stage does only what it is meant to")
            return "\n".join(lines)
        n = len(self.findings)
        lines.append(f"{n} finding{'s' if n > 1 else ''}:")
        for i, f in enumerate(self.findings, 1):
            lines.append(f"\n{i}. [{f.kind}] {f.where}: {f.summary}")
            lines += [f"     {line}" for line in _evidence_lines(f)]
            if f.cost.get("ms_per_iteration") is not None:
                lines.append(f"   cost: up to {f.cost['ms_per_iteration']:.1f} ms per iteration "
                             f"({'+'.join(f.cost['phases'])}), "
                             f"{100 * f.cost['share']:.0f}% of the iteration")
            lines.append(f"   fix: {f.fix}")
            lines.append(f"   read: notebooks/{f.chapter}.ipynb")
        return "\n".join(lines)

    __str__ = format


def _evidence_lines(f: Finding) -> list[str]:
    ev = f.evidence
    lines = [f"{op}: {n['this stage']:g} vs {n['clean stage']:g} in the clean stage"
             for op, n in ev.get("ops", {}).items()]
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
