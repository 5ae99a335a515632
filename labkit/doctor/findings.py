"""How the doctor judges what it measured: which component a call site belongs to, what each
finding costs, and the chapter that teaches its fix, derived from the ladder (the rung that
replaces the component); :func:`without_graphs` is the clean stage it judges against."""
from __future__ import annotations

import inspect
import re
import statistics
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from .. import capture, policy, ppo, precision, stages, timing, update
from ..config import RunConfig
from ..envs import ForagePyList, ForageTorchLoop
from ..executors import Compiled, CompiledIfFaster
from ..measure.syncmeter import parse_site, short_path, source_line
from ..rollout import HostBatchedCollector, PerEnvCollector
from ..stages import STAGES, Pipeline, Stage, without_graphs
from .kinds import KINDS, Finding
from .meters import TORCH_DIR, Measurements
from .report import rate

MEASURE_FIRST = "00_measure_first"


def _component_class(part: Any) -> type:
    """The class a slot's value is (the value itself for class slots)."""
    return part if inspect.isclass(part) else type(part)


def _ladder_fixes() -> tuple[dict[type, str], dict[str, str]]:
    """Where the ladder (its rungs without graphs, what the doctor judges against) replaces
    each component: the chapter of the first rung after the last one holding it (by the
    component's class); and for each slot, the chapter of the last rung that changes it (a
    component the ladder never holds, a plant, is fixed there)."""
    ladder = [s for s in STAGES if without_graphs(s) is s]
    by_component: dict[type, str] = {}
    by_slot: dict[str, str] = {}
    for prev, stage in zip(ladder, ladder[1:]):
        for slot, part in stage.components().items():
            old = prev.components()[slot]
            # stage 7 keeps stage 5's compile only where it pays: still chapter 06's lesson
            refined = type(old) is Compiled and isinstance(part, CompiledIfFaster)
            if part != old and not refined:
                by_component[_component_class(old)] = stage.chapter
                by_slot[slot] = stage.chapter
    return by_component, by_slot


# How each fix is done: by component class (most specific), else by slot; the chapter that
# teaches it comes from the ladder (_ladder_fixes), or is named where the ladder has none.
_COMPONENT_HOW: dict[type, str] = {
    PerEnvCollector: "one batched forward for all envs, actions sampled on the device",
    ForagePyList: "vectorized envs",
    HostBatchedCollector: "keep the env on the device: no per-step transfers",
    ForageTorchLoop: "one vectorized env step (torch.where, gathers) instead of per-env "
                     "Python conditionals on device tensors",
}


_SLOT_HOW = {
    "env": "a vectorized env step on the device, no per-env Python",
    "collector": "keep the step's tensors on the device",
    "logger": "log device tensors as they are; a background thread reads them (AsyncLogger)",
    "metrics": "fixed-size accumulators on the device, read once per update "
               "(DeviceEpisodeStats)",
    "optimizer": "Adam(fused=True) with a device-tensor LR and a sync-free grad clip "
                 "(FusedAdam)",
    "precision": "bf16 autocast where the device has it (labkit.precision.Amp)",
    "model": "no Python branches on tensor values in the model: each variant implements one "
             "interface (labkit.policy's value heads), so compiled code runs straight through",
    "rollout_executor": "compile the policy, warm up off the clock",
    "update_executor": "compile the loss, warm up off the clock",
    "pipeline": "measure the loop itself: the sync meter, the phases",
    "user code": "measure your own code: the sync meter, the profiler",
}


#: Slots no rung changes: the model is the same network on every rung (chapter 06 is where
#: its code must compile); the loop and the reader's code are measured first.
_UNCHANGED_SLOT_CHAPTER = {"model": "06_compile_and_warm_up", "pipeline": MEASURE_FIRST,
                           "user code": MEASURE_FIRST}


_FINITE_CHECK = ("10_the_regression_hunt",
                 "keep finite-ness checks behind a debug switch (labkit.debug: zero kernels and "
                 "zero host reads when off)")


_CAPTURE_FIX = ("09_cuda_graphs",
                "a captured step must not read the host, make CPU tensors or run an unfused "
                "optimizer: diagnose the stage without graphs (without_graphs) to find them")


_NO_COST = {"phases": [], "ms_per_iteration": None, "share": None}


#: Which phases of the pipeline's clock a component's work lands in.
_SLOT_PHASES = {
    "env": ("env", "step"), "collector": ("policy", "env", "step"),
    "model": ("policy", "step", "update"), "logger": ("io",), "metrics": ("metrics", "step"),
    "optimizer": ("update",), "precision": ("update",),
    "rollout_executor": ("policy", "graph", "step"), "update_executor": ("update",),
    "pipeline": ("io", "gae"),
    "user code": ("policy", "env", "step", "io", "metrics", "update"),
}


_MODULE_SLOT = {short_path(module.__file__): slot for module, slot in (
    (ppo, "update_executor"), (policy, "model"), (stages, "pipeline"), (capture, "pipeline"),
    (update, "update_executor"), (precision, "precision"), (timing, "pipeline"))}


#: (ops, label) compared with the clean stage for ``excess_ops``.
_EXCESS = ((("clone",), "clones"),
           (("convolution", "matmul"), "model work (convolutions, matrix multiplies)"))


_USER_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _classes(part: Any) -> list:
    """The labkit-or-user classes (or the function) behind a component, most derived first."""
    if inspect.isfunction(part):
        return [part]
    cls = part if inspect.isclass(part) else type(part)
    return [c for c in cls.__mro__ if not c.__module__.startswith(("torch", "builtins"))
            and c is not object]


class Parts:
    """Where each component's code lives, to say which component a call site belongs to."""

    def __init__(self, stage: Stage, agent: torch.nn.Module | None = None) -> None:
        self.parts = {slot: part for slot, part in stage.components().items()}
        self.ranges: list[tuple[str, str, int, int]] = []
        self.files: dict[str, set[str]] = defaultdict(set)
        extra = {"model": [type(agent.value_head)] if agent is not None else []}
        for slot, part in self.parts.items():
            for obj in _classes(part) + extra.get(slot, []):
                try:
                    lines, first = inspect.getsourcelines(obj)
                    path = short_path(inspect.getsourcefile(obj))
                except (OSError, TypeError):
                    continue
                self.ranges.append((slot, path, first, first + len(lines) - 1))
                self.files[path].add(slot)

    def slot_of(self, file: str, line: int, via: str | None) -> str:
        via = via or ""
        if "torch/optim/" in via or "clip_grad" in via:
            return "optimizer"
        if "torch/amp/" in via:
            return "precision"
        hits = [(last - first, slot) for slot, path, first, last in self.ranges
                if path == file and first <= line <= last]
        if hits:
            return min(hits)[1]
        if len(self.files.get(file, ())) == 1:
            return next(iter(self.files[file]))
        return _MODULE_SLOT.get(file, "user code")

    def site_slot(self, site: str) -> str:
        file, line, _, via = parse_site(site) or (site, 0, "", None)
        return self.slot_of(file, line, via)

    def describe(self, slot: str) -> str:
        if slot in self.parts:
            part = self.parts[slot]
            return f"the {slot} ({getattr(part, '__name__', None) or type(part).__name__})"
        return "the pipeline loop" if slot == "pipeline" else "user code"

    def fix(self, slot: str) -> tuple[str, str]:
        for cls in _classes(self.parts[slot]) if slot in self.parts else ():
            if cls in _COMPONENT_FIX:
                return _COMPONENT_FIX[cls]
        return _SLOT_FIX[slot]


def _site_text(site: str) -> str:
    parsed = parse_site(site)
    return source_line(*parsed[:2]) if parsed else ""


def is_deliberate(site: str) -> bool:
    """Made by the code itself (not ``via`` a torch frame), on a line whose comment says so."""
    text = _site_text(site)
    return " via " not in site and "#" in text and "deliberate" in text.split("#", 1)[1].lower()


def _cost(slot: str, phase_ms: dict, iteration_ms: float | None) -> dict:
    phases = [p for p in _SLOT_PHASES.get(slot, ()) if p in phase_ms]
    if not phases or not iteration_ms:
        return {"phases": phases, "ms_per_iteration": None, "share": None}
    ms = sum(phase_ms[p] for p in phases)
    return {"phases": phases, "ms_per_iteration": round(ms, 3),
            "share": round(min(ms / iteration_ms, 1.0), 3)}


def _dynamo_reasons(before: dict, parts: Parts) -> tuple[list[str], str]:
    """Dynamo's reasons for the recompiles since ``before``, and the slot of the first
    recompiled function."""
    from torch._dynamo.utils import guard_failures
    out, slot = [], None
    for code, reasons in guard_failures.items():
        for reason in reasons[before.get(code, 0):]:
            file = short_path(code.co_filename)
            slot = slot or parts.slot_of(file, code.co_firstlineno, None)
            out.append(f"{code.co_name} ({file}:{code.co_firstlineno}) recompiled: "
                       + reason.split("\n", 1)[0])
    return out, slot or "update_executor"


def _group_sites(sites_roll: Counter, sites_learn: Counter, n_steps: int, parts: Parts,
                 accept: Callable[[str, int], bool] = lambda site, n: False
                 ) -> tuple[dict, dict]:
    """{slot: [site rows]} for the sites not accepted, and {site: count} accepted."""
    groups: dict[str, list[dict]] = defaultdict(list)
    accepted = {}
    for site in sorted(set(sites_roll) | set(sites_learn)):
        r, u = sites_roll.get(site, 0), sites_learn.get(site, 0)
        if accept(site, r + u):
            accepted[site] = r + u
            continue
        groups[parts.site_slot(site)].append(
            {"site": site, "per_step": round(r / n_steps, 3), "per_update": u})
    for rows in groups.values():
        rows.sort(key=lambda s: -(s["per_step"] * n_steps + s["per_update"]))
    return groups, accepted


#: The doctor's kinds of host tensor, each {meter key: label}.
ALLOCATIONS = {"no_device": {"no_device": "host tensor made by a factory that names no "
                                          "device (or the CPU)"},
               "from_data": {"from_data": "tensor made from Python or NumPy data"},
               "host_to_device": {"host_to_device": "host-to-device copy"}}


def site_findings(kind: str, sites: dict[str, tuple[Counter, Counter]], cfg: RunConfig,
                   parts: Parts, phase_ms: dict, it_ms: float | None,
                   accept: Callable[[str, int], bool] = lambda site, n: False
                   ) -> tuple[list[Finding], dict]:
    """One finding per slot of the call sites in ``sites`` ({what: (rollout sites, learn
    sites)}; ``what`` labels each row when there are several), and the sites accepted. For
    ``device_read`` the sites are the sync meter's ``device_sites``: device reads only."""
    by_slot: dict[str, list[dict]] = defaultdict(list)
    accepted = {}
    for what, (roll, learn) in sites.items():
        groups, ok = _group_sites(roll, learn, cfg.n_steps, parts, accept)
        accepted.update(ok)
        for slot, rows in groups.items():
            by_slot[slot] += rows if kind == "device_read" else [{**row, "what": what}
                                                                 for row in rows]
    findings = []
    for slot, rows in by_slot.items():
        per_step = round(sum(r["per_step"] for r in rows), 3)
        per_update = sum(r["per_update"] for r in rows)
        if kind == "device_read":
            chapter, fix = parts.fix(slot)
            if any(re.search(r"\bis(nan|inf|finite)\b", _site_text(r["site"])) for r in rows):
                chapter, fix = _FINITE_CHECK
            what = []
            if per_step:
                what.append(f"{per_step:g} device read{'s' if per_step != 1 else ''} per "
                            "rollout step")
            if per_update:
                what.append(f"{per_update} per update" if per_step else
                            f"{per_update} device read{'s' if per_update != 1 else ''} per "
                            "update")
            loop = "; a per-element loop: N or more" if per_step >= cfg.n_envs else ""
            summary = ", ".join(what) + f" (a sync each on a GPU{loop})"
        else:
            chapter, fix = "", ""  # the kind's (labkit.doctor.kinds)
            summary = f"{' and '.join(sorted({r['what'] for r in rows}))}: " \
                      f"{rate(per_step, per_update)}"
        findings.append(Finding(
            kind, parts.describe(slot), summary,
            {"per_step": per_step, "per_update": per_update, "sites": rows},
            _cost(slot, phase_ms, it_ms), chapter, fix))
    return findings, accepted


def memory_findings(snaps: list[dict], parts: Parts, phase_ms: dict, it_ms: float | None
                     ) -> list[Finding]:
    if len(snaps) < 3:
        return []
    findings = []
    rss = [round(s["rss_mb"], 1) for s in snaps if s["rss_mb"] is not None]
    for key in snaps[0]["held"]:
        counts = [s["held"].get(key, (0, 0))[0] for s in snaps]
        sizes = [s["held"].get(key, (0, 0))[1] for s in snaps]
        deltas = [b - a for a, b in zip(counts, counts[1:])]
        if min(deltas) <= 0:
            continue
        slot, attr = key.split(".", 1)
        chapter, fix = parts.fix(slot)
        per_it = statistics.median(deltas)
        bytes_it = statistics.median(b - a for a, b in zip(sizes, sizes[1:]))
        findings.append(Finding(
            "memory_growth", parts.describe(slot),
            f"`{attr}` holds {per_it:g} more tensors ({bytes_it / 1024:.1f} KiB) after every "
            "iteration, without bound",
            {"attribute": attr, "tensors_per_iteration": per_it,
             "bytes_per_iteration": bytes_it, "held_tensors": counts,
             "live_tensors": [s["live_tensors"] for s in snaps], "rss_mb": rss},
            _cost(slot, phase_ms, it_ms), chapter,
            fix + "; keep a bounded window (a fixed-size buffer, deque(maxlen=...)) or "
                  "aggregates, never every step"))
    live = [s["live_tensors"] for s in snaps]
    if not findings and min(b - a for a, b in zip(live, live[1:])) > 0:
        findings.append(Finding(
            "memory_growth", "an unknown owner",
            f"{statistics.median(b - a for a, b in zip(live, live[1:])):g} more live tensors "
            "after every iteration", {"live_tensors": live, "rss_mb": rss}, _NO_COST,
            "00_measure_first",
            "find who keeps them: gc.get_referrers on a new tensor; bound every buffer"))
    return findings


def excess_findings(watch: tuple[dict, dict], base: tuple[dict, dict], cfg: RunConfig,
                     parts: Parts, phase_ms: dict, it_ms: float | None) -> list[Finding]:
    """``excess_ops``: the watched iteration's clones and model work against the clean
    stage's, per rollout step and per minibatch step."""
    n_steps = cfg.n_steps
    n_mb = cfg.ppo.update_epochs * cfg.ppo.n_minibatches
    findings = []
    for names, label in _EXCESS:
        excess = {}
        for where, mine, clean, unit, per in (("rollout", watch[0], base[0], "per step", n_steps),
                                              ("update", watch[1], base[1], "per minibatch",
                                               n_mb)):
            for op in names:
                a = sum(mine.get(op, Counter()).values())
                b = sum(clean.get(op, Counter()).values())
                if (a - b) / per >= 1 and a >= 1.2 * b:
                    excess[f"{op} {unit} ({where})"] = {"this stage": round(a / per, 2),
                                                        "clean stage": round(b / per, 2)}
        if not excess:
            continue
        groups, _ = _group_sites(sum((watch[0].get(op, Counter()) for op in names), Counter()),
                                 sum((watch[1].get(op, Counter()) for op in names), Counter()),
                                 n_steps, parts)
        rows = sorted((r for rs in groups.values() for r in rs),
                      key=lambda r: -(r["per_step"] * n_steps + r["per_update"]))
        slot = next((s for s, rs in groups.items() if rows and rows[0] in rs), "user code")
        # clones: the chapter that replaces the component, and the clone's fix; model work:
        # the kind's (labkit.doctor.kinds)
        chapter, fix = (parts.fix(slot)[0], KINDS["clone"].fix) if names == ("clone",) else \
            ("", "")
        first = next(iter(excess.items()))
        findings.append(Finding(
            "excess_ops", parts.describe(slot),
            f"more {label} than the clean stage: {first[0]} {first[1]['this stage']:g} "
            f"vs {first[1]['clean stage']:g}",
            {"ops": excess, "sites": rows[:6]}, _cost(slot, phase_ms, it_ms), chapter, fix))
    return findings


def optimizer_kind(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """How an optimizer steps its parameters, in words: fused, multi-tensor or per-parameter
    (``foreach=None`` is torch's choice: multi-tensor on CUDA, per-parameter on the CPU)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    name = type(optimizer).__name__
    if group.get("fused"):
        return f"fused {name}"
    foreach = group.get("foreach")
    if foreach is None:
        foreach = device.type == "cuda"
        return f"multi-tensor {name}, foreach=None" if foreach else \
            f"per-parameter {name}, foreach=None"
    return f"multi-tensor {name}, foreach=True" if foreach else \
        f"per-parameter {name}, foreach=False"


def launch_findings(watch: tuple[dict, dict], base: tuple[dict, dict], parts: Parts,
                    kind: str) -> list[Finding]:
    """``excess_ops`` of the optimizer: kernel launches per ``optimizer.step()`` (what
    :func:`~labkit.doctor.meters.step_launches` counted in the watched update) against the clean
    stage's. On a GPU a per-parameter optimizer costs a launch per op per parameter where a
    fused one launches a few for all of them; the time of a launch is the GPU's and is not
    measured here, so the finding states launches, not a share of the iteration. ``kind`` says
    how the optimizer steps (:func:`optimizer_kind`)."""
    mine, clean = watch[1], base[1]
    steps = sum(mine.get("optimizer_step", Counter()).values())
    clean_steps = sum(clean.get("optimizer_step", Counter()).values())
    if not steps or not clean_steps:
        return []
    a = sum(mine.get("launch", Counter()).values()) / steps
    b = sum(clean.get("launch", Counter()).values()) / clean_steps
    if a - b < 1 or a < 1.2 * b:
        return []
    a, b = round(a, 2), round(b, 2)
    chapter, fix = parts.fix("optimizer")
    shown = mine["launch"].most_common(6)
    rest = sum(mine["launch"].values()) - sum(n for _, n in shown)  # named, so the parts sum
    top = ", ".join([f"{op} {n / steps:g}" for op, n in shown]
                    + ([f"other ops {rest / steps:g}"] if rest else []))
    sites = [{"site": site, "per_step": 0, "per_update": n}
             for site, n in mine["optimizer_step"].most_common()]
    return [Finding(
        "excess_ops", parts.describe("optimizer"),
        f"{a:g} kernel launches per optimizer step vs {b:g} in the clean stage ({kind})",
        {"ops": {"kernel launches per optimizer step": {"this stage": a, "clean stage": b}},
         "launches_by_op": top, "optimizer": kind, "steps_per_update": steps, "sites": sites},
        {"phases": [], "ms_per_iteration": None, "share": None,
         "extra_launches_per_update": round((a - b) * steps)},
        chapter, fix)]


def error_finding(err: Exception, parts: Parts, phase: str) -> Finding:
    """The stage raised while the doctor ran it: a compiled step that dynamo could not trace
    (``fullgraph=True`` makes a graph break, or hitting the recompile limit, an error; the
    reason and the user code it was tracing are in dynamo's message), or anything else (a
    CUDA graph capture error, say: the labkit-or-user frames of the traceback)."""
    from torch._dynamo.exc import TorchDynamoException

    text = str(err)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(err).__name__
    explanation = next((ln.split(":", 1)[1].strip() for ln in lines
                        if ln.startswith("Explanation:")), "")
    if isinstance(err, TorchDynamoException):
        found = [(m["file"], m["line"], m["func"])
                 for m in _USER_FRAME.finditer(text.split("from user code:", 1)[-1])]
        kind = "recompile" if "recompile" in type(err).__name__.lower() else "graph_break"
        summary, fix = f"the compiled code raised in {phase}: {first}", ()
    else:
        found = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)
                 if f.filename != __file__]
        kind, summary = "error", f"the stage raised in {phase}: {type(err).__name__}: {first}"
        fix = _CAPTURE_FIX if "captur" in text.lower() else ()
        explanation = explanation or f"{type(err).__name__}: {first}"
    frames = [f"{short_path(file)}:{line} ({func})" for file, line, func in found
              if not file.startswith(TORCH_DIR)]
    slot = parts.site_slot(frames[-1]) if frames else "update_executor"
    return Finding(kind, parts.describe(slot), summary,
                   {"error": type(err).__name__, "message": first, "explanation": explanation,
                    "user_code": frames}, _NO_COST, *fix)


def compile_findings(m: Measurements, parts: Parts, phase_ms: dict, it_ms: float,
                      iterations: int) -> list[Finding]:
    """Graphs compiled, and graph breaks, after the warmup."""
    findings = []
    if m.new_graphs:
        reasons, slot = _dynamo_reasons(m.reasons_before, parts)
        findings.append(Finding(
            "recompile", parts.describe(slot),
            f"{m.new_graphs} graph{'s' if m.new_graphs > 1 else ''} compiled after warmup, in "
            f"{iterations + 1} iterations",
            {"graphs_after_warmup": m.new_graphs, "reasons": reasons},
            _cost(slot, phase_ms, it_ms)))
    if m.breaks:
        findings.append(Finding(
            "graph_break", "the compiled code",
            f"{sum(m.breaks.values())} graph breaks after warmup",
            {"reasons": [f"{n} x {r}" for r, n in m.breaks.most_common()]},
            _cost("model", phase_ms, it_ms)))
    return findings


def precision_findings(pipe: Pipeline, twin: Stage, parts: Parts, phase_ms: dict,
                        it_ms: float) -> list[Finding]:
    """fp32 where the clean stage runs reduced precision on this device."""
    clean_precision = twin.precision(pipe.device).name
    if pipe.precision.name != "fp32" or clean_precision == "fp32":
        return []
    return [Finding(
        "precision", parts.describe("precision"),
        f"the update runs in fp32; on this device the clean stage runs {clean_precision}",
        {"precision": pipe.precision.name, "clean_stage_precision": clean_precision,
         "device": str(pipe.device)},
        _cost("precision", phase_ms, it_ms), *_SLOT_FIX["precision"])]


_BY_COMPONENT, _BY_SLOT = _ladder_fixes()


# A class the ladder no longer replaces falls back to its slot's fix.
_COMPONENT_FIX = {cls: (_BY_COMPONENT[cls], how) for cls, how in _COMPONENT_HOW.items()
                  if cls in _BY_COMPONENT}


_SLOT_FIX = {slot: (_BY_SLOT.get(slot) or _UNCHANGED_SLOT_CHAPTER[slot], how)
             for slot, how in _SLOT_HOW.items()}
