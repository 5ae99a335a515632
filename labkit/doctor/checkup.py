"""``labkit doctor``: run a few iterations under every meter labkit has and report regressions.

``diagnose(stage_or_pipeline)`` warms the pipeline up off the clock, then runs ``iterations``
timed iterations with its phase clock (where the time went: each finding's estimated cost; the
samples stay in the report, so a plant's times can be set against the clean stage's with their
spread, :func:`~labkit.doctor.report.compare_times`); one under the sync meter with call sites
(host reads by ``file:line``, device reads apart from host-scalar reads); and one eagerly
(``force_eager``, so compiled code is seen too) under :class:`labkit.watch`, the meters a reader
points at their own loop, which count by call site what the code made on the host, made from
Python data, copied to the device and cloned, and the model's convolutions and matrix
multiplies; and the kernels each ``optimizer.step()`` would launch on a GPU. What it counts is
the code's own calls: a clone that torch makes inside its own functions or an optimizer is
torch's business, and differs between torch versions. Between iterations it snapshots memory
(live tensors, the tensors each component holds, RSS, CUDA memory); around them it reads
dynamo's counters (graphs compiled after warmup, graph breaks, with dynamo's reasons).

A stage with CUDA graphs (``labkit.executors.Graphed``) is diagnosed :func:`without_graphs`,
and the report's first line says so: a graph replays exactly the ops of the eager step it
captured but hides them from the profiler, and a device read inside it fails the capture.

Findings are judged against what the stage is meant to do, never against zero:

* ``device_read``: a **device read** (a read on the host of a tensor that lives on the device:
  a sync on a GPU), by component. A read on a line marked ``# ... deliberate ...`` that runs at
  most once per iteration is accepted (the device metrics' one ``.tolist()`` per update). A
  host-scalar read (a tensor that lives on the CPU in a GPU run too: a non-fused Adam's step
  counters) waits for no GPU: it is counted in the report, never a finding.
* ``no_device``: a tensor factory in labkit or user code that names no device, or the CPU
  (a host tensor on a GPU run; pinned buffers excepted); ``from_data``: a tensor made from
  Python or NumPy data; ``host_to_device``: on CUDA, every host-to-device copy.
* ``memory_growth``: tensors a component holds, or alive at all, growing every iteration.
* ``excess_ops``: more clones or model work (a forward's convolutions and matrix multiplies)
  called from labkit or user code per step or per minibatch than the clean ladder stage of the same
  index calls at the same N and T; or more kernel launches per optimizer step (a
  per-parameter optimizer where the clean stage's is fused).
* ``recompile`` / ``graph_break``: graphs compiled after warmup, graph breaks, or a compiled
  step that fails to compile (``fullgraph=True`` turns a graph break into an error).
* ``precision``: fp32 where the clean stage of the same index uses bf16 or fp16 on this device.
* ``error``: anything else the stage raised under the doctor (a CUDA graph capture error,
  say), with the labkit-or-user frames it came through; the rest is not measured.

Each finding has ``evidence``, a ``cost`` (the time of the phases its component runs in, per
iteration: an upper bound; for launches, the extra launches per update, whose time is a GPU's
and is not claimed) and the ``chapter`` whose notebook teaches the fix.
"""
from __future__ import annotations

import statistics
from collections import Counter

import torch

from ..capture import warmup
from ..config import RunConfig
from ..device import resolve_device, synchronize
from ..distributed import SINGLE
from ..measure.bench import timed_iteration
from ..stages import STAGES, Pipeline, Stage, StageSkipped, get_stage, without_graphs
from .findings import (
    ALLOCATIONS,
    Parts,
    compile_findings,
    error_finding,
    excess_findings,
    is_deliberate,
    launch_findings,
    memory_findings,
    optimizer_kind,
    precision_findings,
    site_findings,
)
from .kinds import KINDS, Finding
from .meters import Measurements, dynamo_state, memory_snapshot, metered, step_launches
from .report import Report
from .watch import watch

#: The sizes the doctor runs at unless given a RunConfig: small, it only counts.
DOCTOR_RUN = dict(n_envs=16, n_steps=16)
#: How the doctor's own configs run a stage that compiles where it pays: compiled, so that
#: what it counts does not depend on a timing taken at warmup; and how every stage it builds
#: runs its convolutions unless the config forces matmul (for the same reason: a config's
#: "auto" would time them at warmup, iterations that also use up dynamo's recompile limit
#: for a model that recompiles).
DOCTOR_COMPILE = "compiled"
DOCTOR_CONV_MATH = "conv2d"


_BASELINES: dict[tuple, tuple[dict, dict]] = {}


def watched(pipe: Pipeline) -> tuple[dict, dict]:
    """One iteration run eagerly (``force_eager``: compiled code is seen too) under
    :class:`labkit.watch`, the rollout and the learn apart: what each made, moved, cloned and
    computed by call site (``watch``'s ``calls``: ``no_device``, ``from_data``,
    ``host_to_device``, ``clone``, ``convolution``, ``matmul``). The learn's also hold what each
    ``optimizer.step()`` launches (:func:`~labkit.doctor.meters.step_launches`)."""
    with torch.compiler.set_stance("force_eager"):
        with watch(pipe.device) as w_roll:
            batch = pipe.rollout()
        with watch(pipe.device) as w_learn, step_launches(pipe.optimizer) as launched:
            pipe.learn(batch)
    synchronize(pipe.device)
    return dict(w_roll.calls), {**w_learn.calls, **launched}


def _baseline_ops(twin: Stage, cfg: RunConfig, device: torch.device,
                  choices: dict[str, dict], convs: dict[str, dict]) -> tuple[dict, dict]:
    """The watched counts of one rollout and one learn of the clean stage ``twin`` at the same
    sizes, its model math eager or compiled as ``choices`` and its convolutions as ``convs``
    (the diagnosed pipeline's) say (cached per process)."""
    kept = {part: made["kept"] for part, made in choices.items()}
    conv_kept = {part: made["kept"] for part, made in convs.items()}
    key = (twin.name, str(device), repr(cfg.to_dict()), repr(sorted(kept.items())),
           repr(sorted(conv_kept.items())))
    if key not in _BASELINES:
        with Pipeline(twin, cfg, device) as clean:
            clean.math.keep_choices({part: {"kept": kind, "why": "the diagnosed pipeline's"}
                                for part, kind in kept.items() if part in clean.math.choices})
            if conv_kept and clean.math.conv_body is not None:
                clean.math.keep_conv_math({part: {"kept": math, "why": "the diagnosed pipeline's"}
                                      for part, math in conv_kept.items()})
            warmup(clean)
            _BASELINES[key] = watched(clean)
    return _BASELINES[key]


def diagnose(target: Pipeline | Stage | int | str, iterations: int = 5,
             cfg: RunConfig | None = None, device: torch.device | str = "auto",
             baseline: bool = True) -> Report:
    """Diagnose a pipeline, or a stage (built at ``cfg``, default N=16, T=16, on ``device``).

    A pipeline is left in the state it had (its ``state_dict`` is restored); one that replays
    CUDA graphs is diagnosed as a fresh pipeline :func:`without_graphs` that loads its state.
    ``iterations``: timed iterations (at least 2; 5 by default, enough for a min, median and
    max). ``baseline``: compare op counts with the clean ladder stage of the same index (built
    once per process and size); without it there are no ``excess_ops`` findings. A stage it
    builds runs its convolutions as conv2d unless ``cfg`` forces matmul
    (``DOCTOR_CONV_MATH``)."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 2:
        raise ValueError(f"iterations must be an int >= 2, got {iterations!r}")
    if isinstance(target, Pipeline):
        stage, cfg, device = target.stage, target.cfg, target.device
    else:
        stage, device = get_stage(target), resolve_device(device)
        cfg = cfg if cfg is not None else RunConfig(**DOCTOR_RUN, compile=DOCTOR_COMPILE)
        if cfg.conv_math == "auto":  # what it counts must not depend on a warmup's timing
            cfg = cfg.replace(conv_math=DOCTOR_CONV_MATH)
    report = Report(stage.name, str(device), cfg.n_envs, cfg.n_steps, iterations)
    if not isinstance(target, Pipeline):
        try:
            stage.check(device, cfg)
        except StageSkipped as err:
            if err.cause == "memory":  # a size that cannot fit: the caller's error, not a finding
                raise
            report.status = f"skipped: {err.reason}"
            return report
    eager = without_graphs(stage)
    report.graphs_off = eager is not stage
    if isinstance(target, Pipeline) and not report.graphs_off:
        pipe, saved = target, target.state_dict()
    else:
        group = target.group if isinstance(target, Pipeline) else SINGLE
        try:
            pipe, saved = Pipeline(eager, cfg, device, group=group), None
        except Exception as err:  # a component that cannot even be built: a finding too
            report.findings.append(error_finding(err, Parts(eager), "building the pipeline"))
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


def _diagnose(pipe: Pipeline, report: Report, iterations: int, baseline: bool) -> None:
    m = _measure(pipe, report, iterations)
    if m is not None:
        _judge(pipe, m, report, iterations, baseline)


def _measure(pipe: Pipeline, report: Report, iterations: int) -> Measurements | None:
    """Warm up, time ``iterations`` marked iterations, meter one, watch one; None (and the
    error as a finding) if the stage's code raises."""
    from torch._dynamo.exc import TorchDynamoException

    times, phases, snaps = [], [], []
    step = "the warmup"
    try:
        warmup(pipe)
        graphs0, breaks0, reasons0 = dynamo_state()
        snaps.append(memory_snapshot(pipe))
        step = "the timed iterations"
        for _ in range(iterations):
            seconds, ms, _ = timed_iteration(pipe, marked=True)
            times.append(seconds)
            phases.append(ms)
            snaps.append(memory_snapshot(pipe))
        step = "the metered iteration"
        reads = metered(pipe)
        snaps.append(memory_snapshot(pipe))
        graphs1, breaks1, _ = dynamo_state()
        watch = watched(pipe)
        snaps.append(memory_snapshot(pipe))
    except Exception as err:  # a compile or capture error, or any other: a finding
        report.findings.append(error_finding(err, Parts(pipe.stage, pipe.agent), step))
        what = "compiled code" if isinstance(err, TorchDynamoException) else "code"
        report.notes.append(f"stopped in {step}: the stage's {what} raised, so the rest could "
                            "not be measured")
        return None
    return Measurements(times, phases, snaps, reads, watch, graphs1 - graphs0,
                         breaks1 - breaks0, reasons0)


def _judge(pipe: Pipeline, m: Measurements, report: Report, iterations: int,
           baseline: bool) -> None:
    """The report's figures and findings from what was measured, most costly first."""
    parts = Parts(pipe.stage, pipe.agent)
    cfg, device, n_steps = pipe.cfg, pipe.device, pipe.cfg.n_steps
    m_roll, m_learn = m.reads
    it_ms = 1e3 * statistics.median(m.times)
    phase_ms = {k: round(statistics.median(p.get(k, 0.0) for p in m.phases), 3)
                for k in {k for p in m.phases for k in p}}
    report.iteration_s = it_ms / 1e3
    report.iteration_s_samples = [round(t, 6) for t in m.times]
    report.phase_ms = phase_ms
    report.memory = {"live_tensors": [s["live_tensors"] for s in m.snaps],
                     "rss_mb": [round(s["rss_mb"], 1) for s in m.snaps if s["rss_mb"]]}
    if device.type == "cuda":
        report.memory["cuda_mb"] = [round(s["cuda_mb"], 2) for s in m.snaps]

    # A sync is a device read: a host-scalar read (a CPU tensor in a GPU run too) is no finding.
    findings, accepted = site_findings(
        "device_read", {"device read": (m_roll.device_sites, m_learn.device_sites)}, cfg, parts,
        phase_ms, it_ms, accept=lambda site, n: n <= 1 and is_deliberate(site))
    report.host_reads = {
        "per_step": round(m_roll.host_reads / n_steps, 3), "per_update": m_learn.host_reads,
        "by_kind": dict(m_roll.counts + m_learn.counts), "accepted": accepted,
        "device": {"per_step": round(m_roll.device_reads / n_steps, 3),
                   "per_update": m_learn.device_reads,
                   "by_kind": dict(m_roll.device_counts + m_learn.device_counts)},
        "host_scalar": {"per_step": round(m_roll.host_scalar_reads / n_steps, 3),
                        "per_update": m_learn.host_scalar_reads,
                        "by_kind": dict(m_roll.host_scalar_counts + m_learn.host_scalar_counts)}}
    for kind, keys in ALLOCATIONS.items():
        findings += site_findings(
            kind, {label: (m.watch[0].get(key, Counter()), m.watch[1].get(key, Counter()))
                   for key, label in keys.items()}, cfg, parts, phase_ms, it_ms)[0]
    findings += memory_findings(m.snaps, parts, phase_ms, it_ms)
    twin = without_graphs(STAGES[pipe.stage.index])  # the clean stage, judged the same way
    if baseline:
        base = m.watch if pipe.stage == twin else _baseline_ops(twin, cfg, device,
                                                                pipe.math.executor_choices,
                                                                pipe.math.conv_choices)
        findings += excess_findings(m.watch, base, cfg, parts, phase_ms, it_ms)
        findings += launch_findings(m.watch, base, parts,
                                    optimizer_kind(pipe.optimizer, device))
    findings += compile_findings(m, parts, phase_ms, it_ms, iterations)
    findings += precision_findings(pipe, twin, parts, phase_ms, it_ms)

    def order(f: Finding) -> tuple[int, float]:
        ev = f.evidence
        return list(KINDS).index(f.kind), -(ev.get("per_step", 0) * n_steps
                                            + ev.get("per_update", 0))

    report.findings = sorted(findings, key=order)
