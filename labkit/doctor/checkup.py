"""``labkit doctor``: run a few iterations under every meter labkit has and report regressions.

``diagnose(stage_or_pipeline)`` warms the pipeline up off the clock, then runs ``iterations``
timed iterations with its phase clock (where the time went: each finding's estimated cost);
one under the sync meter with call sites (host reads by ``file:line``); and one eagerly
(``force_eager``, so compiled code is seen too) under a ``TorchFunctionMode`` that counts, by
call site, tensor factories, host-to-device copies, clones and the model's layers. What it
counts is the code's own calls: a clone that torch makes inside a compiled graph or an
optimizer is torch's business, and differs between torch versions. Between iterations it
snapshots memory (live tensors, the tensors each component holds, RSS, CUDA memory); around
them it reads dynamo's counters (graphs compiled after warmup, graph breaks, with dynamo's
reasons).

A stage with CUDA graphs (``labkit.executors.Graphed``) is diagnosed :func:`without_graphs`,
and the report's first line says so: a graph replays exactly the ops of the eager step it
captured but hides them from the profiler, and a host read inside it fails the capture.

Findings are judged against what the stage is meant to do, never against zero:

* ``host_read``: a read of tensor data on the host, by component. A read on a line marked
  ``# ... deliberate ...`` that runs at most once per iteration is accepted (the device
  metrics' one ``.tolist()`` per update).
* ``cpu_allocation``: a tensor factory in labkit or user code without ``device=`` (on a CPU
  run: a CPU tensor on a GPU) or making a CPU tensor on a CUDA run (pinned buffers excepted),
  and on CUDA every host-to-device copy.
* ``memory_growth``: tensors a component holds, or alive at all, growing every iteration.
* ``excess_ops``: more clones or model work (convolutions, linear layers, matmuls) called
  from labkit or user code per step or per minibatch than the clean ladder stage of the same
  index calls at the same N and T.
* ``recompile`` / ``graph_break``: graphs compiled after warmup, graph breaks, or a compiled
  step that fails to compile (``fullgraph=True`` turns a graph break into an error).
* ``precision``: fp32 where the clean stage of the same index uses bf16 or fp16 on this device.
* ``error``: anything else the stage raised under the doctor (a CUDA graph capture error,
  say), with the labkit-or-user frames it came through; the rest is not measured.

Each finding has ``evidence``, a ``cost`` (the time of the phases its component runs in, per
iteration: an upper bound) and the ``chapter`` whose notebook teaches the fix.
"""
from __future__ import annotations

import gc
import inspect
import os
import re
import statistics
import sys
import traceback
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from .. import capture, policy, ppo, precision, stages, timing, update
from ..capture import warmup
from ..config import RunConfig, check_memory
from ..device import resolve_device, synchronize
from ..distributed import SINGLE
from ..executors import Graphed
from ..measure.bench import timed_iteration
from ..measure.syncmeter import SyncMeter, call_site, parse_site, short_path, source_line
from ..stages import STAGES, Pipeline, Stage, get_stage

KINDS = ("host_read", "cpu_allocation", "memory_growth", "excess_ops", "recompile",
         "graph_break", "precision", "error")

#: The sizes the doctor runs at unless given a RunConfig: small, it only counts.
DOCTOR_RUN = dict(n_envs=16, n_steps=16)

#: The chapter that builds each rung of the ladder: stage i is taught in chapter i + 1.
CHAPTERS = ("01_the_python_loop", "02_vectorize_with_numpy", "03_tensors_on_the_device",
            "04_batch_everything", "05_log_off_the_hot_path", "06_compile_and_warm_up",
            "07_metrics_on_the_device", "08_fused_optimizers_and_amp", "09_cuda_graphs")
MEASURE_FIRST = "00_measure_first"


def _ladder_fixes() -> tuple[dict[str, str], dict[str, str]]:
    """Where the ladder (its rungs without graphs, what the doctor judges against) replaces
    each component: the chapter of the first rung after the last one holding it; and for each
    slot, the chapter of the last rung that changes it (a component the ladder never holds,
    a plant, is fixed there)."""
    ladder = [s for s in STAGES if without_graphs(s) is s]
    by_component: dict[str, str] = {}
    by_slot: dict[str, str] = {}
    for prev, stage in zip(ladder, ladder[1:]):
        for slot, part in stage.components().items():
            old = prev.components()[slot]
            if part != old:
                by_component[getattr(old, "__name__", type(old).__name__)] = \
                    CHAPTERS[stage.index]
                by_slot[slot] = CHAPTERS[stage.index]
    return by_component, by_slot


# How each fix is done: by component class (most specific), else by slot; the chapter that
# teaches it comes from the ladder (_ladder_fixes), or is named where the ladder has none.
_COMPONENT_HOW = {
    "PerEnvCollector": "one batched forward for all envs, actions sampled on the device",
    "ForagePyList": "vectorized envs",
    "HostBatchedCollector": "keep the env on the device: no per-step transfers",
    "ForageTorchLoop": "one vectorized env step (torch.where, gathers) instead of per-env "
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
    "rollout": "compile the policy, warm up off the clock",
    "update": "compile the loss, warm up off the clock",
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
_COMPILE_FIX = ("06_compile_and_warm_up",
                "no Python branches on tensors or on changing Python values in compiled code: "
                "give each variant one interface (labkit.policy's value heads)")
_CAPTURE_FIX = ("09_cuda_graphs",
                "a captured step must not read the host, make CPU tensors or run an unfused "
                "optimizer: diagnose the stage without graphs (without_graphs) to find them")
_ERROR_FIX = ("00_measure_first", "fix the error at the last frame of user_code, then diagnose "
                                  "again")
_CPU_ALLOC_FIX = ("03_tensors_on_the_device",
                  "create tensors on the device: torch.zeros(..., device=x.device), or "
                  "zeros_like / new_zeros of a device tensor, once, outside the loop")
_COPIES_FIX = "update state in place; clone only what a later in-place write would change"
_MODEL_WORK_FIX = ("00_measure_first",
                   "compute shared work once and reuse it (the reference Agent runs its body "
                   "once for both heads); count model ops per step with the profiler")
_NO_COST = {"phases": [], "ms_per_iteration": None, "share": None}

#: Which phases of the pipeline's clock a component's work lands in.
_SLOT_PHASES = {
    "env": ("env",), "collector": ("policy", "env"), "model": ("policy", "update"),
    "logger": ("io",), "metrics": ("metrics",), "optimizer": ("update",),
    "precision": ("update",), "rollout": ("policy", "graph"), "update": ("update",),
    "pipeline": ("io", "gae"), "user code": ("policy", "env", "io", "metrics", "update"),
}
_MODULE_SLOT = {short_path(module.__file__): slot for module, slot in (
    (ppo, "update"), (policy, "model"), (stages, "pipeline"), (capture, "pipeline"),
    (update, "update"), (precision, "precision"), (timing, "pipeline"))}

_FACTORIES = {f"torch.{n}" for n in (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor")}
_MOVES = {"torch.Tensor.to", "torch.Tensor.cuda", "torch.Tensor.copy_"}
_CLONES = {"torch.Tensor.clone", "torch.clone"}
#: Model work by the name the doctor counts it under.
_LAYERS = {"torch.conv2d": "convolution", "torch.nn.functional.conv2d": "convolution",
           "torch._C._nn.linear": "linear", "torch.nn.functional.linear": "linear",
           "torch.matmul": "matmul", "torch.mm": "matmul", "torch.bmm": "matmul",
           "torch.Tensor.__matmul__": "matmul", "torch.Tensor.matmul": "matmul"}
#: (ops, label) compared with the clean stage for ``excess_ops``.
_EXCESS = ((("clone",), "clones"),
           (("convolution", "linear", "matmul"), "model work (convolutions, linear layers, "
                                                 "matmuls)"))
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_USER_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


# ---------------------------------------------------------------------------- the report


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
        return lines + [f"{_rate(s['per_step'], s['per_update'])}  {s['site']}"
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


def _rate(per_step: float, per_update: float) -> str:
    return ", ".join(x for x in (f"{per_step:g} per step" if per_step else "",
                                 f"{per_update:g} per update" if per_update else "") if x) or "0"


# ---------------------------------------------------------------------------- attribution


def _classes(part: Any) -> list:
    """The labkit-or-user classes (or the function) behind a component, most derived first."""
    if inspect.isfunction(part):
        return [part]
    cls = part if inspect.isclass(part) else type(part)
    return [c for c in cls.__mro__ if not c.__module__.startswith(("torch", "builtins"))
            and c is not object]


class _Parts:
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
            if cls.__name__ in _COMPONENT_HOW:
                return _COMPONENT_FIX[cls.__name__]
        return _SLOT_FIX[slot]


def _site_text(site: str) -> str:
    parsed = parse_site(site)
    return source_line(*parsed[:2]) if parsed else ""


def _is_deliberate(site: str) -> bool:
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


# ---------------------------------------------------------------------------- the meters


class _Watch(TorchFunctionMode):
    """Counts, by call site: tensor factories that leave the device out (or, on CUDA, make CPU
    tensors), host-to-device copies, clones made by labkit or user code (not those torch makes
    inside its own functions), and the model's layers and matmuls (under ``convolution``,
    ``linear`` and ``matmul``: a layer's call site is the line that called the module)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.cuda = device.type == "cuda"
        self.counts: dict[str, Counter] = defaultdict(Counter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = resolve_name(func) or ""
        if name in _FACTORIES:
            self._factory(name, args, kwargs, out)
        elif name in _MOVES and self.cuda:
            src, dst = (args[1], args[0]) if name == "torch.Tensor.copy_" else (args[0], out)
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) \
                    and src.device.type == "cpu" and dst.device.type == "cuda":
                self.counts["host_to_device"][call_site(1)] += 1
        elif name in _CLONES:
            site = call_site(1)
            if " via " not in site:  # a clone inside torch's own code is not the code's
                self.counts["clone"][site] += 1
        elif name in _LAYERS:
            self.counts[_LAYERS[name]][call_site(1)] += 1
        return out

    def _factory(self, name: str, args: tuple, kwargs: dict, out: object) -> None:
        caller = sys._getframe(2)
        if caller.f_code.co_filename.startswith(_TORCH_DIR) or kwargs.get("pin_memory"):
            return  # torch's own internals; a pinned buffer is host memory on purpose
        if name in ("torch.tensor", "torch.as_tensor") and args \
                and isinstance(args[0], torch.Tensor):
            return  # keeps its input's device
        site = call_site(2)
        if not self.cuda:
            if "device" not in kwargs:
                self.counts["no_device"][site] += 1
        elif isinstance(out, torch.Tensor):
            if out.device.type == "cpu":
                self.counts["cpu_tensor"][site] += 1
            elif name in ("torch.tensor", "torch.as_tensor"):
                self.counts["host_to_device"][site] += 1  # Python data copied to the GPU


def _watched(pipe: Pipeline) -> tuple[dict, dict]:
    """One iteration run eagerly under :class:`_Watch`: (rollout counts, learn counts)."""
    with torch.compiler.set_stance("force_eager"):
        with _Watch(pipe.device) as w_roll:
            batch = pipe.rollout()
        with _Watch(pipe.device) as w_learn:
            pipe.learn(batch)
    synchronize(pipe.device)
    return w_roll.counts, w_learn.counts


def _metered(pipe: Pipeline) -> tuple[SyncMeter, SyncMeter]:
    """One iteration under the sync meter, with call sites: (rollout meter, learn meter)."""
    with SyncMeter(call_sites=True) as m_roll:
        batch = pipe.rollout()
    synchronize(pipe.device)
    with SyncMeter(call_sites=True) as m_learn:
        pipe.learn(batch)
    synchronize(pipe.device)
    return m_roll, m_learn


_CONTAINERS = (list, tuple, dict, deque, set)


def _held(obj: Any, depth: int = 3, seen: set | None = None) -> tuple[int, int]:
    """(tensors, bytes) reachable from ``obj`` through containers and labkit objects."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth < 0:
        return 0, 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, _CONTAINERS):
        items = list(obj)
    elif type(obj).__module__.startswith("labkit") and hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return 0, 0
    n = b = 0
    for item in items:
        dn, db = _held(item, depth - 1, seen)
        n, b = n + dn, b + db
    return n, b


def _memory(pipe: Pipeline) -> dict:
    """Memory at an iteration boundary: live tensors, those each component attribute holds,
    RSS, CUDA allocated."""
    flush = getattr(pipe.logger, "flush", None)
    if flush:
        flush()
    live = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    parts = {"env": pipe.collector.env, "collector": pipe.collector, "metrics": pipe.metrics,
             "logger": pipe.logger, "model": pipe.agent}
    skip = {id(p) for p in parts.values()} | {id(pipe.collector.clock)}
    held = {f"{slot}.{attr}": _held(value, seen=set(skip))
            for slot, obj in parts.items() for attr, value in vars(obj).items()
            if id(value) not in skip and not attr.startswith("_modules")}
    snap = {"live_tensors": live, "held": held, "rss_mb": _rss_mb()}
    if pipe.device.type == "cuda":
        snap["cuda_mb"] = torch.cuda.memory_allocated(pipe.device) / 2**20
    return snap


def _rss_mb() -> float | None:
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return None
    return psutil.Process().memory_info().rss / 2**20


def _dynamo_state() -> tuple[int, Counter, dict]:
    from torch._dynamo.utils import counters, guard_failures
    return (counters["stats"]["unique_graphs"], Counter(counters["graph_break"]),
            {code: len(reasons) for code, reasons in guard_failures.items()})


def _dynamo_reasons(before: dict, parts: _Parts) -> tuple[list[str], str]:
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
    return out, slot or "update"


# ---------------------------------------------------------------------------- the findings


def _group_sites(sites_roll: Counter, sites_learn: Counter, n_steps: int, parts: _Parts,
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


_ALLOCATIONS = {"no_device": "tensor factory without device=",
                "cpu_tensor": "CPU tensor made on a CUDA run",
                "host_to_device": "host-to-device copy"}


def _site_findings(kind: str, sites: dict[str, tuple[Counter, Counter]], cfg: RunConfig,
                   parts: _Parts, phase_ms: dict, it_ms: float | None,
                   accept: Callable[[str, int], bool] = lambda site, n: False
                   ) -> tuple[list[Finding], dict]:
    """One finding per slot of the call sites in ``sites`` ({what: (rollout sites, learn
    sites)}; ``what`` labels each row when there are several), and the sites accepted."""
    by_slot: dict[str, list[dict]] = defaultdict(list)
    accepted = {}
    for what, (roll, learn) in sites.items():
        groups, ok = _group_sites(roll, learn, cfg.n_steps, parts, accept)
        accepted.update(ok)
        for slot, rows in groups.items():
            by_slot[slot] += [{**row, "what": what} for row in rows] if len(sites) > 1 else rows
    findings = []
    for slot, rows in by_slot.items():
        per_step = round(sum(r["per_step"] for r in rows), 3)
        per_update = sum(r["per_update"] for r in rows)
        if kind == "host_read":
            chapter, fix = parts.fix(slot)
            if any(re.search(r"\bis(nan|inf|finite)\b", _site_text(r["site"])) for r in rows):
                chapter, fix = _FINITE_CHECK
            what = []
            if per_step:
                what.append(f"{per_step:g} host read{'s' if per_step != 1 else ''} per rollout "
                            "step" + (" (a per-element loop: N or more)"
                                      if per_step >= cfg.n_envs else ""))
            if per_update:
                what.append(f"{per_update} per update" if per_step else
                            f"{per_update} host read{'s' if per_update != 1 else ''} per update")
            summary = ", ".join(what)
        else:
            chapter, fix = _CPU_ALLOC_FIX
            summary = f"{' and '.join(sorted({r['what'] for r in rows}))}: " \
                      f"{_rate(per_step, per_update)}"
        findings.append(Finding(
            kind, parts.describe(slot), summary,
            {"per_step": per_step, "per_update": per_update, "sites": rows},
            _cost(slot, phase_ms, it_ms), chapter, fix))
    return findings, accepted


def _memory_findings(snaps: list[dict], parts: _Parts, phase_ms: dict, it_ms: float | None
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


def _excess_findings(watch: tuple[dict, dict], base: tuple[dict, dict], cfg: RunConfig,
                     parts: _Parts, phase_ms: dict, it_ms: float | None) -> list[Finding]:
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
        if names == ("clone",):
            chapter, fix = parts.fix(slot)[0], _COPIES_FIX
        else:
            chapter, fix = _MODEL_WORK_FIX
        first = next(iter(excess.items()))
        findings.append(Finding(
            "excess_ops", parts.describe(slot),
            f"more {label} than the clean stage: {first[0]} {first[1]['this stage']:g} "
            f"vs {first[1]['clean stage']:g}",
            {"ops": excess, "sites": rows[:6]}, _cost(slot, phase_ms, it_ms), chapter, fix))
    return findings


_BASELINES: dict[tuple, tuple[dict, dict]] = {}


def _baseline_ops(twin: Stage, cfg: RunConfig, device: torch.device) -> tuple[dict, dict]:
    """The watched counts of one rollout and one learn of the clean stage ``twin`` at the same
    sizes (cached per process)."""
    key = (twin.name, str(device), repr(cfg.to_dict()))
    if key not in _BASELINES:
        with Pipeline(twin, cfg, device) as clean:
            warmup(clean)
            _BASELINES[key] = _watched(clean)
    return _BASELINES[key]


def _error_finding(err: Exception, parts: _Parts, phase: str) -> Finding:
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
        summary, fix = f"the compiled code raised in {phase}: {first}", _COMPILE_FIX
    else:
        found = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)
                 if f.filename != __file__]
        kind, summary = "error", f"the stage raised in {phase}: {type(err).__name__}: {first}"
        fix = _CAPTURE_FIX if "captur" in text.lower() else _ERROR_FIX
        explanation = explanation or f"{type(err).__name__}: {first}"
    frames = [f"{short_path(file)}:{line} ({func})" for file, line, func in found
              if not file.startswith(_TORCH_DIR)]
    slot = parts.site_slot(frames[-1]) if frames else "update"
    return Finding(kind, parts.describe(slot), summary,
                   {"error": type(err).__name__, "message": first, "explanation": explanation,
                    "user_code": frames}, _NO_COST, *fix)


# ---------------------------------------------------------------------------- diagnose


def without_graphs(stage: Stage) -> Stage:
    """``stage`` with each :class:`~labkit.executors.Graphed` executor replaced by its ``base``
    (``stage`` itself if it has none): a CUDA graph replays exactly the ops of the eager step
    it captured, so this runs the same work, with every op, read and tensor visible."""
    swaps = {slot: ex.base for slot, ex in (("rollout", stage.rollout), ("update", stage.update))
             if isinstance(ex, Graphed)}
    return replace(stage, **swaps) if swaps else stage


def diagnose(target: Pipeline | Stage | int | str, iterations: int = 2,
             cfg: RunConfig | None = None, device: torch.device | str = "auto",
             baseline: bool = True) -> Report:
    """Diagnose a pipeline, or a stage (built at ``cfg``, default N=16, T=16, on ``device``).

    A pipeline is left in the state it had (its ``state_dict`` is restored); one that replays
    CUDA graphs is diagnosed as a fresh pipeline :func:`without_graphs` that loads its state.
    ``baseline``: compare op counts with the clean ladder stage of the same index (built once
    per process and size); without it there are no ``excess_ops`` findings."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 2:
        raise ValueError(f"iterations must be an int >= 2, got {iterations!r}")
    if isinstance(target, Pipeline):
        stage, cfg, device = target.stage, target.cfg, target.device
    else:
        stage, device = get_stage(target), resolve_device(device)
        cfg = cfg if cfg is not None else RunConfig(**DOCTOR_RUN)
    report = Report(stage.name, str(device), cfg.n_envs, cfg.n_steps, iterations)
    reason = None if isinstance(target, Pipeline) else stage.skip_reason(device)
    if reason:
        report.status = f"skipped: {reason}"
        return report
    eager = without_graphs(stage)
    report.graphs_off = eager is not stage
    if isinstance(target, Pipeline) and not report.graphs_off:
        pipe, saved = target, target.state_dict()
    else:
        check_memory(cfg, device)  # a size that cannot fit is the caller's error, not a finding
        group = target.group if isinstance(target, Pipeline) else SINGLE
        try:
            pipe, saved = Pipeline(eager, cfg, device, group=group), None
        except Exception as err:  # a component that cannot even be built: a finding too
            report.findings.append(_error_finding(err, _Parts(eager), "building the pipeline"))
            report.notes.append("stopped while building the pipeline: a component raised, so "
                                "nothing could be measured")
            return report
        if isinstance(target, Pipeline):
            pipe.load_state_dict(target.state_dict())
    try:
        _diagnose(pipe, report, iterations, baseline)
    finally:
        if saved is None:
            pipe.close()
        else:
            pipe.load_state_dict(saved)
    return report


@dataclass
class _Measurements:
    """What one diagnosis measured: the timed iterations' seconds and phases, memory after
    each step, the metered iteration's host reads (rollout, learn), the function watch, and
    dynamo's counts before and after."""

    times: list[float]
    phases: list[dict]
    snaps: list[dict]
    reads: tuple[SyncMeter, SyncMeter]
    watch: tuple[dict, dict]
    new_graphs: int
    breaks: Counter
    reasons_before: dict


def _diagnose(pipe: Pipeline, report: Report, iterations: int, baseline: bool) -> None:
    m = _measure(pipe, report, iterations)
    if m is not None:
        _judge(pipe, m, report, iterations, baseline)


def _measure(pipe: Pipeline, report: Report, iterations: int) -> _Measurements | None:
    """Warm up, time ``iterations`` marked iterations, meter one, watch one; None (and the
    error as a finding) if the stage's code raises."""
    from torch._dynamo.exc import TorchDynamoException

    times, phases, snaps = [], [], []
    step = "the warmup"
    try:
        warmup(pipe)
        graphs0, breaks0, reasons0 = _dynamo_state()
        snaps.append(_memory(pipe))
        step = "the timed iterations"
        for _ in range(iterations):
            seconds, ms, _ = timed_iteration(pipe, marked=True)
            times.append(seconds)
            phases.append(ms)
            snaps.append(_memory(pipe))
        step = "the metered iteration"
        reads = _metered(pipe)
        snaps.append(_memory(pipe))
        graphs1, breaks1, _ = _dynamo_state()
        watch = _watched(pipe)
        snaps.append(_memory(pipe))
    except Exception as err:  # a compile or capture error, or any other: a finding
        report.findings.append(_error_finding(err, _Parts(pipe.stage, pipe.agent), step))
        what = "compiled code" if isinstance(err, TorchDynamoException) else "code"
        report.notes.append(f"stopped in {step}: the stage's {what} raised, so the rest could "
                            "not be measured")
        return None
    return _Measurements(times, phases, snaps, reads, watch, graphs1 - graphs0,
                         breaks1 - breaks0, reasons0)


def _judge(pipe: Pipeline, m: _Measurements, report: Report, iterations: int,
           baseline: bool) -> None:
    """The report's figures and findings from what was measured, most costly first."""
    parts = _Parts(pipe.stage, pipe.agent)
    cfg, device, n_steps = pipe.cfg, pipe.device, pipe.cfg.n_steps
    m_roll, m_learn = m.reads
    it_ms = 1e3 * statistics.median(m.times)
    phase_ms = {k: round(statistics.median(p.get(k, 0.0) for p in m.phases), 3)
                for k in {k for p in m.phases for k in p}}
    report.iteration_s = it_ms / 1e3
    report.phase_ms = phase_ms
    report.memory = {"live_tensors": [s["live_tensors"] for s in m.snaps],
                     "rss_mb": [round(s["rss_mb"], 1) for s in m.snaps if s["rss_mb"]]}
    if device.type == "cuda":
        report.memory["cuda_mb"] = [round(s["cuda_mb"], 2) for s in m.snaps]

    findings, accepted = _site_findings(
        "host_read", {"host read": (m_roll.sites, m_learn.sites)}, cfg, parts, phase_ms, it_ms,
        accept=lambda site, n: n <= 1 and _is_deliberate(site))
    report.host_reads = {"per_step": round(m_roll.host_reads / n_steps, 3),
                         "per_update": m_learn.host_reads,
                         "by_kind": dict(m_roll.counts + m_learn.counts), "accepted": accepted}
    findings += _site_findings(
        "cpu_allocation", {label: (m.watch[0].get(key, Counter()), m.watch[1].get(key, Counter()))
                           for key, label in _ALLOCATIONS.items()},
        cfg, parts, phase_ms, it_ms)[0]
    findings += _memory_findings(m.snaps, parts, phase_ms, it_ms)
    twin = without_graphs(STAGES[pipe.stage.index])  # the clean stage, judged the same way
    if baseline:
        base = m.watch if pipe.stage == twin else _baseline_ops(twin, cfg, device)
        findings += _excess_findings(m.watch, base, cfg, parts, phase_ms, it_ms)
    findings += _compile_findings(m, parts, phase_ms, it_ms, iterations)
    findings += _precision_findings(pipe, twin, parts, phase_ms, it_ms)

    def order(f: Finding) -> tuple[int, float]:
        ev = f.evidence
        return KINDS.index(f.kind), -(ev.get("per_step", 0) * n_steps + ev.get("per_update", 0))

    report.findings = sorted(findings, key=order)


def _compile_findings(m: _Measurements, parts: _Parts, phase_ms: dict, it_ms: float,
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
            _cost(slot, phase_ms, it_ms), *_COMPILE_FIX))
    if m.breaks:
        findings.append(Finding(
            "graph_break", "the compiled code",
            f"{sum(m.breaks.values())} graph breaks after warmup",
            {"reasons": [f"{n} x {r}" for r, n in m.breaks.most_common()]},
            _cost("model", phase_ms, it_ms), *_COMPILE_FIX))
    return findings


def _precision_findings(pipe: Pipeline, twin: Stage, parts: _Parts, phase_ms: dict,
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
_COMPONENT_FIX = {name: (_BY_COMPONENT[name], how) for name, how in _COMPONENT_HOW.items()}
_SLOT_FIX = {slot: (_BY_SLOT.get(slot) or _UNCHANGED_SLOT_CHAPTER[slot], how)
             for slot, how in _SLOT_HOW.items()}
