"""Will this step capture into a CUDA graph, and replay what eager calls compute? A rehearsal
on the CPU, for the machines that have no GPU.

Almost no machine that works on labkit has a GPU, yet stage 8's Python logic (static inputs,
state updated in place, the tensor learning rate, the restore after warm-up, the registered
generator) must not break unnoticed, and a reader's own step should be judged before it meets
a GPU. :func:`rehearse` does what a careful reader does with ``torch.cuda.graph`` (warm-up
calls, a capture, replays) inside :class:`~labkit.doctor.graphs_on_cpu.rehearsal`, the CPU
stand-in for ``torch.cuda``'s graph API (how it captures and replays: there and in
:mod:`labkit.doctor.recorder`), and returns a :class:`Report`; :func:`rehearse_stage` and
``python -m labkit rehearse --stage NAME`` do it for a ladder stage, against the same stage
without its graphs.

What it checks, each problem with the line of your code that causes it: a host read (what
``labkit.measure.syncmeter`` counts); an op torch tags as data-dependent, of dynamic output
shape or unsafe in a CUDA graph; an op whose CUDA kernel reads the device on the host
(``labkit.doctor.kernel_syncs``, read from torch's sources at one version); a synchronize
inside the capture; an optimizer stepped inside the capture without ``capturable=True``;
Python or NumPy data made a tensor inside the capture (a 0-d host scalar excepted); a tensor
made without ``device=`` mixed with device tensors; a copy between the device and pageable host
memory; a random op on a generator the graph does not know. And what a capture accepts but
replays differently: a Python value, tensor binding, branch, seed or host random draw that
changes between calls; an op on host tensors only (it runs once, at capture); outputs whose
shapes or Python values differ between the warm-up and the capture.

What it cannot see, so a step outside this list is not judged by it: what a kernel does inside
beyond the ops listed in ``kernel_syncs`` (an unlisted op that syncs inside its CUDA kernel
passes); compiled functions, which run eagerly inside the rehearsal (a ``torch.compile``d step
is judged as its eager ops); cuDNN and cuBLAS workspace allocation on the capture stream; the
graph memory pool; stream ordering, and CUDA calls from other threads; philox offsets across
replays; collectives inside a captured step; host state made before the rehearsal that the step
does not hold itself (see :func:`rehearse`); a NumPy random draw, unless it changes the ops of
the calls compared (NumPy's generators are compiled methods that no Python hook sees). It never
measures speed: stage 8's timing on a
CPU stays ``skipped: needs CUDA`` in the ladder.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..measure.syncmeter import short_path
from .frozen import Tracer, frozen_values
from .graphs_on_cpu import rehearsal
from .kinds import CAUSES, KINDS, Finding
from .origins import disabled_scalers, host_state, python_state
from .recorder import CaptureError
from .standin import REHEARSED, profile_hook_free

__all__ = ["REHEARSED", "CaptureError", "Finding", "Report", "StageReport", "rehearsal",
           "rehearse", "rehearse_stage"]


@dataclass
class Report:
    """What :func:`rehearse` found: ``ok`` when nothing would stop a real capture or make its
    replays differ; ``outputs`` are the captured function's outputs, holding the last replay's
    results; ``replays`` how many ran."""

    problems: list[Finding] = field(default_factory=list)
    outputs: Any = None
    replays: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            return (f"rehearsal: capturable; {self.replays} replay"
                    f"{'s' if self.replays != 1 else ''} ran (on the CPU: no speed measured)")
        return "rehearsal: not capturable as it is\n" + "\n".join(
            f"  {p}" for p in self.problems)


def _paths(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """(where in the output, leaf) for every leaf of a nest of tuples, lists and dicts."""
    if isinstance(value, (list, tuple)):
        return [leaf for k, v in enumerate(value) for leaf in _paths(v, f"{path}[{k}]")]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _paths(v, f"{path}[{k!r}]")]
    return [] if value is None else [(path or "the output", value)]


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        try:
            return (tuple(value.shape), value.dtype)
        except RuntimeError:  # a nested tensor has no single shape
            return ("nested", value.dtype)
    return type(value).__name__


def rehearse(fn: Callable[..., Any], *args: Any, replays: int = 2, warmup: int = 3) -> Report:
    """Rehearse capturing ``fn(*args)`` as a CUDA graph, on the CPU: ``warmup`` calls (they
    really run, as torch's recipe does before a capture), one capture on static copies of the
    tensor arguments, then ``replays`` replays. The report lists, with your ``file:line``,
    what a real capture would refuse and what it would freeze (the module docstring lists
    both); the last two warm-up calls and the capture are compared op by op. Nothing is
    replayed when a real capture would have failed.

    Host tensors are known by where they were made: inside the step; anywhere inside an
    enclosing ``with rehearsal():``; and, for the state ``fn`` holds (its closure, its
    module's or object's attributes, its globals), by the code that made it
    (:mod:`labkit.doctor.origins`). State made elsewhere (passed in through a container, made
    by a factory function in a library) is taken for device tensors unless it was made
    inside a rehearsal: build the step's state inside one to have it all checked::

        with rehearsal():
            model, opt, counter = build()
            report = rehearse(step, batch)
    """
    from ..capture import clone_state

    _check_arguments(fn, replays, warmup)
    report = Report()
    site = f"{getattr(fn, '__qualname__', repr(fn))}"
    with rehearsal(strict=False) as r:
        for tensor, made in host_state(fn):  # a CPU step counter in its closure, say
            if tensor not in r.host:
                r.host[tensor] = made
        r.disabled_scalers |= {id(scaler) for scaler in disabled_scalers(fn)}
        static = clone_state(args)
        try:
            warm, traces, python, drawn = _warm_up(fn, static, warmup)
        except Exception as err:  # noqa: BLE001 - on the CPU, before any capture: said once
            report.problems = [Finding("unsupported", site, (
                f"{KINDS['unsupported'].means}: the step raised in an eager warm-up call on the "
                f"CPU, before any capture (a GPU-only call the rehearsal does not stand in "
                f"for, or the step's own error): {_said(err)}"))]
            return report
        try:
            graph = torch.cuda.CUDAGraph()
            before = python_state(fn)
            with torch.cuda.graph(graph), Tracer(sites=True) as captured, \
                    _returning(fn) as returned:
                out = fn(*static)
                captured.returned(out)
            at_capture = _changed(before, python_state(fn))
            report.problems = list(r.problems)
            report.problems += _output_problems(warm, out, captured, returned[-1:] or [site])
            if not report.problems and warmup > 1:  # the first call may set state up
                report.problems = _frozen(fn, traces, captured, python[-1], at_capture, drawn)
            if report.ok:
                for _ in range(replays):
                    graph.replay()
                report.replays = replays
            report.outputs = out
        except Exception as err:  # noqa: BLE001 - what the rehearsal cannot model, said once
            report.problems = [*r.problems, Finding("unsupported", site, (
                f"{KINDS['unsupported'].means}: {_said(err)}"))]
            report.replays = 0
    return report


def _check_arguments(fn: Any, replays: Any, warmup: Any) -> None:
    if isinstance(replays, bool) or not isinstance(replays, int) or replays < 0:
        raise ValueError(f"replays must be an int >= 0, got {replays!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")


def _warm_up(fn: Callable[..., Any], static: Any, warmup: int) -> tuple[Any, list, list, Any]:
    """``warmup`` calls of the reader's code, eagerly, the last two traced op by op to compare:
    (the last call's output, the traces, the Python state each traced call changed, the host
    random draws of the last)."""
    traces, python = [], []
    for i in range(warmup):
        if i < warmup - 2:
            warm = fn(*static)
            continue
        before = python_state(fn)
        with Tracer(sites=True) as tracer, _drawing(fn) as drawn:
            warm = fn(*static)
            tracer.returned(warm)
        traces.append(tracer)
        python.append(_changed(before, python_state(fn)))
    return warm, traces, python, drawn


def _frozen(fn: Callable[..., Any], traces: list, captured: Tracer, changed: dict,
            at_capture: dict, drawn: Any) -> list[Finding]:
    """What the capture froze: the ops it ran against the last warm-up call's, else the two
    warm-up calls' against each other, else the Python state the last one changed that the
    capture changed too."""
    return (frozen_values(traces[-1], captured)
            or (frozen_values(traces[0], traces[-1]) if len(traces) == 2 else [])
            or _python_frozen({k: v for k, v in changed.items() if k in at_capture}, fn, drawn))


def _said(err: BaseException) -> str:
    """An exception on one line: its type and message (its repr if it has none)."""
    text = " ".join(str(err).split()) or repr(err)
    return f"{type(err).__name__}: {text[:300]}"


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple]:
    return {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}


def _python_frozen(changed: dict[str, tuple], fn: Callable, drawn: list[str]
                   ) -> list[Finding]:
    """Python state that the last eager call and the capture both changed: eager calls go on
    changing it, a replay runs no Python, so it stays where the capture left it (a step
    counter, a list of outputs, a host random generator: then at the line that drew from it).
    State only eager calls change (``if not torch.cuda.is_current_stream_capturing():``) is
    the code's own choice."""
    if not changed:
        return []
    if drawn:
        return [Finding("frozen_value", drawn[0], CAUSES["host_random"])]
    code = getattr(getattr(fn, "forward", fn), "__code__", None) or getattr(
        getattr(getattr(fn, "forward", fn), "__func__", None), "__code__", None)
    where = (f"{short_path(code.co_filename)}:{code.co_firstlineno} ({code.co_name})"
             if code is not None else getattr(fn, "__qualname__", repr(fn)))
    shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in list(changed.items())[:3])
    return [Finding("frozen_value", where, f"{CAUSES['python_state']}: {shown}")]


def _output_problems(warm: Any, out: Any, captured: Tracer, returned: list[str]
                     ) -> list[Finding]:
    """The capture's outputs against the last warm-up call's: a tensor whose shape changed
    (at the line of the op that made it), and a Python value that changed (at the ``return``:
    a replay returns the capture's value again)."""
    before, after = _paths(warm), _paths(out)
    if [k for k, _ in before] != [k for k, _ in after]:
        return [Finding("shape", returned[0], f"{KINDS['shape'].means}: the outputs were "
                                              f"{[k for k, _ in before]}, then "
                                              f"{[k for k, _ in after]}")]
    problems = []
    for (path, w), (_, v) in zip(before, after):
        if isinstance(v, torch.Tensor) and _shape(w) != _shape(v):
            problems.append(Finding("shape", captured.site_of(v) or returned[0], (
                f"{KINDS['shape'].means}: {path} was {_shape(w)[0]}, then {_shape(v)[0]}")))
        elif not isinstance(v, torch.Tensor) and not _same_value(v, w):
            problems.append(Finding("not_static", returned[0], (
                f"{KINDS['not_static'].means}: {path}, a {type(v).__name__}, was {w!r} in the "
                f"call before and {v!r} at capture")))
    return problems


@contextlib.contextmanager
def _drawing(fn: Callable) -> Iterator[list[str]]:
    """The lines of the caller's code where a host random generator that ``fn`` holds was
    drawn from (NumPy's generators are compiled: no profile hook sees their calls), found by
    the generators' state changing between two lines; nothing is traced if it holds none."""
    from .origins import held_generators

    generators = held_generators(fn)
    seen: list[str] = []
    if not generators or sys.gettrace() is not None:  # a debugger or coverage owns the trace
        yield seen
        return
    library = (os.path.dirname(os.__file__), os.path.dirname(torch.__file__),
               os.path.dirname(os.path.dirname(__file__)), os.sep + "numpy" + os.sep)
    last: list = [None, [g.state() for g in generators]]
    previous = sys.gettrace()

    def trace(frame, event, arg):
        if frame.f_code.co_filename.startswith(library) or "numpy" in frame.f_code.co_filename:
            return None
        return local

    def local(frame, event, arg):
        if event in ("line", "return"):
            now = [g.state() for g in generators]
            if now != last[1] and last[0] is not None and not seen:
                seen.append(last[0])
            last[:] = [f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} "
                       f"({frame.f_code.co_name})", now]
        return local

    sys.settrace(trace)
    try:
        yield seen
    finally:
        sys.settrace(previous)


@contextlib.contextmanager
def _returning(fn: Callable) -> Iterator[list[str]]:
    """The line each ``return`` of ``fn`` (a module's ``forward``, a partial's function) runs
    at, as call sites, collected while inside."""
    target = getattr(fn, "forward", None) or getattr(fn, "func", None) or fn
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    seen: list[str] = []
    previous = sys.getprofile()
    if code is None or not profile_hook_free(previous):  # a profiler owns the hook
        yield seen
        return

    def hook(frame, event, arg):
        if event == "return" and frame.f_code is code:
            seen.append(f"{short_path(code.co_filename)}:{frame.f_lineno} ({code.co_name})")
        if previous is not None:
            previous(frame, event, arg)

    hook.labkit = True  # type: ignore[attr-defined]
    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def _leaves(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


@dataclass
class StageReport(Report):
    """What :func:`rehearse_stage` found: the captures' problems, and whether the rehearsed
    stage computed what the same stage without its graphs computes, bit for bit (``equal``,
    ``differs``: what did not match first)."""

    stage: str = ""
    iterations: int = 0
    equal: bool = False
    differs: str = ""
    graphs: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and self.equal

    def __str__(self) -> str:
        head = f"rehearsal of {self.stage} on the CPU, {self.iterations} iterations"
        if self.problems:
            return f"{head}: not capturable as it is\n" + "\n".join(
                f"  {p}" for p in self.problems)
        if not self.equal:
            return (f"{head}: capturable, but its replays differ from the stage without "
                    f"graphs: {self.differs}")
        return (f"{head}: capturable; {self.graphs} graphs replayed {self.replays} times, "
                "every rollout and update bit-identical to the stage without graphs (both "
                "eager; on the CPU: no speed measured, bf16 only where the CPU has bf16 "
                "instructions)")


def rehearse_stage(stage: Any, cfg: Any = None, iterations: int = 2) -> StageReport:
    """Rehearse ``stage`` (one with CUDA graphs: stage 8, or a plant of it) on the CPU for
    ``iterations`` iterations, and run the same stage without its graphs, both eagerly: the
    problems its captures found, and whether every rollout, every update's statistics and the
    parameters after each update are bit-identical."""
    from ..config import RunConfig
    from ..stages import Pipeline, get_stage, without_graphs

    stage = get_stage(stage)
    cfg = cfg if cfg is not None else RunConfig(n_envs=16, n_steps=16)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an int >= 1, got {iterations!r}")
    eager = without_graphs(stage)
    if eager is stage:
        raise ValueError(f"stage {stage.name} has no CUDA graphs to rehearse; rehearse "
                         "cuda_graphs (8), or a plant of it")

    def run(s: Any) -> list:
        seen = []
        with Pipeline(s, cfg, "cpu", assume=REHEARSED) as p:
            for _ in range(iterations):
                batch = p.rollout()
                rollout = {k: v.clone() for k, v in p.collector.storage.tensors().items()}
                stats = {k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in p.learn(batch).items()}
                seen.append((rollout, stats, [t.detach().clone() for t in p.agent.parameters()]))
        return seen

    with torch.compiler.set_stance("force_eager"):
        reference = run(eager)
    report = StageReport(stage=stage.name, iterations=iterations)
    with rehearsal(strict=False) as r:
        try:
            rehearsed = run(stage)
        finally:
            report.problems = list(r.problems)
            report.graphs = len(r.graphs)
            report.replays = sum(g.replays for g in r.graphs)
    report.differs = _first_difference(reference, rehearsed)
    report.equal = not report.differs
    return report


def _first_difference(reference: list, rehearsed: list) -> str:
    for i, ((ro, st, pa), (ro2, st2, pa2)) in enumerate(zip(reference, rehearsed), 1):
        for key in ro:
            if not torch.equal(ro[key], ro2[key]):
                return f"the rollout's {key} in iteration {i}"
        for key in st:
            if not _same_value(st[key], st2[key]):
                return f"the update's {key} in iteration {i}"
        if not all(torch.equal(a, b) for a, b in zip(pa, pa2)):
            return f"the parameters after iteration {i}"
    return ""


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    try:
        return bool(a == b) or (a != a and b != b)  # NaN (no episode finished) equals NaN
    except (TypeError, ValueError, RuntimeError):
        return a is b
