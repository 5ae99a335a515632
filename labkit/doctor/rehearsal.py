"""A CUDA-graph capture rehearsal on the CPU: graph code runs unchanged, with a graph's semantics.

Almost no machine that works on labkit has a GPU, yet stage 8's Python logic (static inputs,
state updated in place, the tensor learning rate, the restore after warm-up, the registered
generator) must not break unnoticed. Inside ``with rehearsal():`` the few ``torch.cuda`` calls
that graph code makes (``CUDAGraph``, ``graph``, ``Stream``, ``stream``, ``current_stream``,
``synchronize``, ``is_current_stream_capturing``) are stood in for on the CPU, so that
``labkit.capture.CapturedStep``, stage 8, the recipe's graph step and a reader's own capture
code run as they are, with these semantics:

* **capture records and does not really run**: a ``TorchDispatchMode`` records every aten op
  the captured code runs; when the capture ends, every write it made to a tensor that existed
  before is undone, every generator it advanced is put back, and every tensor it made is
  filled with NaN (integers with their largest value): on a GPU they hold garbage until the
  first replay;
* **replay re-runs only the recorded ops**, into the very tensors made at capture (a graph's
  static addresses), with no Python: Python in the captured function runs at warm-up and at
  capture only. A registered generator advances at each replay (philox offsets on a GPU). A
  CUDA generator that is not registered makes a real capture raise ("Attempt to increase
  offset for a CUDA generator not in capture mode"); a lenient rehearsal replays the same
  numbers from it every time, so that what depends on it shows;
* **what a capture cannot do is a problem**, with the call site: a host read (whatever
  ``labkit.measure.syncmeter`` counts, ``.to("cpu")`` included, since every tensor stands for a
  device tensor), an op torch tags as data-dependent, of dynamic output shape or unsafe in a
  CUDA graph, ``torch.tensor(...)`` built inside the capture (a host-to-device copy), a
  tensor made without ``device=`` (a host tensor on a GPU) mixed into an op with device
  tensors, and a generator that is used without being registered (torch registers the
  default one itself).
  ``rehearsal(strict=True)`` raises :class:`CaptureError` at the end of a capture that has
  any, as a real capture would have failed; ``strict=False`` collects them in ``problems``.

Compiled functions run eagerly inside (``torch.compiler.set_stance("force_eager")``): a dispatch
mode and ``fullgraph=True`` compiled code do not mix. So a rehearsed stage 8 equals stage 7 run
eagerly bit for bit, and compiled stage 7 within the tolerance the tests state. Stages that need
CUDA or bf16 are built on the CPU inside: the rehearsal runs fp32 and a non-capturable fused
Adam where a GPU runs bf16 and a capturable one.

Host tensors are found by where a tensor comes from, not by its device (on the CPU every
tensor is a host tensor): a ``TorchFunctionMode`` notes each tensor the capture makes with a
constructor given no ``device=`` (torch's list of them, the one ``set_default_device`` uses),
the recorder follows it through the ops that take only such tensors, and an op that mixes one
(not a 0-d scalar, which CUDA accepts) with device tensors is the problem, at the op's line and
the tensor's. A second pass under ``FakeTensorMode`` with every existing tensor faked onto
``cuda`` was tried first and rejected: on CPU-only torch 2.13 autograd through a fake CUDA
tensor aborts the process (no CUDA device guard); faking onto ``meta`` instead wrote a fake
gradient into the real parameter's ``.grad``, ops with a generator do not run under it, and
code that keeps a device in Python (an env's ``self.device``) refuses the faked tensors.

What a rehearsal cannot show: compiled kernels inside a real capture; cuDNN and cuBLAS
workspace allocation on the capture stream; stream ordering, and CUDA calls from other threads;
philox offsets across replays; the graph memory pool; collectives inside a captured step;
torch's own checks at capture. And it never measures speed: stage 8's timing on a CPU stays
``skipped: needs CUDA`` in the ladder.

``rehearse(fn, *args)`` does what a careful reader does with ``torch.cuda.graph`` (warm-up calls,
a capture, replays) and returns a :class:`Report`; ``rehearse_stage`` and ``python -m labkit
rehearse --stage NAME`` do it for a ladder stage, against the same stage without its graphs.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ..measure.syncmeter import SyncMeter, call_site, wraps_method

_TAGS = {torch.Tag.data_dependent_output: "data_dependent",
         torch.Tag.dynamic_output_shape: "dynamic_shape"}
if hasattr(torch.Tag, "cudagraph_unsafe"):
    _TAGS[torch.Tag.cudagraph_unsafe] = "cudagraph_unsafe"
_EXPLAIN = {
    "host_read": "reads tensor data on the host: a capture cannot wait for a result",
    "data_dependent": "an op whose result the host must read (torch tags it "
                      "data_dependent_output)",
    "dynamic_shape": "an op whose output shape depends on the data (dynamic_output_shape): a "
                     "graph's shapes are fixed at capture",
    "cudagraph_unsafe": "an op torch tags as unsafe inside a CUDA graph",
    "host_tensor": "torch.tensor(...) inside the capture: a host-to-device copy of Python "
                   "data, baked in at capture (make it once, outside, and update it in place)",
    "host_mix": "a tensor made without device= is a host tensor on a GPU, and an op mixing it "
                "with device tensors raises there (give it device=, e.g. device=x.device)",
    "unregistered_generator": "a generator the graph does not know: a real capture raises "
                              "(register it: graph.register_generator_state)",
    "shape": "the capture's inputs or outputs differ in shape from the warm-up call's",
    "not_static": "an output that is not a tensor made by the graph: replays do not update it",
}
#: Tagged dynamic_output_shape for boolean masks only: with integer indices the output has
#: the indices' shape.
_INDEXING = {"index", "_unsafe_index"}
#: Allocations: a replay keeps the buffer a capture made, so they are not re-run.
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
#: Ops that may take a host tensor beside device tensors: copies between devices.
_CROSS_DEVICE = {"copy_", "_to_copy", "lift_fresh", "_copy_from"}


def _constructors() -> set:
    """torch's functions that take ``device=`` and make a tensor (those that
    ``torch.set_default_device`` redirects); a short list where torch's is not there."""
    try:
        from torch.utils._device import _device_constructors
        return set(_device_constructors())
    except ImportError:  # pragma: no cover - a torch without it
        return {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.rand,
                torch.randn, torch.randint, torch.tensor, torch.as_tensor, torch.linspace,
                torch.eye, torch.scalar_tensor}


@dataclass
class Problem:
    """Something a real CUDA graph capture would not allow or not replay: its ``kind``,
    ``where`` it happened (``file:line (function)``) and what."""

    kind: str
    where: str
    what: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.what}"


class CaptureError(RuntimeError):
    """A rehearsed capture found what would make a real one fail or replay wrong."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"the capture could not be a CUDA graph ({len(problems)} problem"
                         f"{'s' if len(problems) > 1 else ''}):\n{lines}")


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    fresh: list[torch.Tensor | None]  # the outputs made at capture, None where one aliases
    runs: bool  # False for pure views and allocations: their outputs stay as captured
    rng_state: tuple[torch.Generator, torch.Tensor] | None = None  # an unregistered generator


def _returns(schema: Any, out: Any) -> list[tuple[Any, Any]]:
    """(schema return, value) for every value an op returned, a list return's elements each
    paired with that return."""
    outs = out if len(schema.returns) > 1 else (out,)
    pairs = []
    for ret, value in zip(schema.returns, outs):
        values = value if isinstance(value, (list, tuple)) else [value]
        pairs += [(ret, v) for v in values]
    return pairs


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two Python generator objects are one generator (a dispatched op gets a new
    wrapper object for it): reseed one, read the other's seed, put the state back."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    state = b.get_state()
    try:
        b.manual_seed(0x5EED_0F_C0DE)
        return a.initial_seed() == 0x5EED_0F_C0DE
    finally:
        b.set_state(state)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Records the ops of one capture, with what is needed to undo it and to replay it."""

    def __init__(self, graph: _Graph, rehearsal: rehearsal) -> None:
        super().__init__()
        self.graph, self.rehearsal = graph, rehearsal
        self.ops: list[_Op] = []
        self.made: set[int] = set()  # storages allocated during the capture
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.fresh: list[torch.Tensor] = []
        self.problems: list[Problem] = []
        self.host = WeakTensorKeyDictionary()  # tensor -> where it was made without a device
        self._remember(torch.default_generator)

    def _remember(self, gen: torch.Generator) -> None:
        self.generators.setdefault(id(gen), (gen, gen.get_state()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function ranges: not part of a graph
            return func(*args, **kwargs)
        schema = func._schema
        values = list(zip(schema.arguments, list(args) + [None] * len(schema.arguments)))
        named = [(a, kwargs[a.name] if a.name in kwargs else v) for a, v in values]
        writes = any(a.alias_info is not None and a.alias_info.is_write for a, _ in named)
        for arg, value in named:
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in _tensors(value):
                    self._save(t)
        self._inspect(func, named)
        host = self._host_inputs(func, named)
        rng_state = self._generator(func, named)
        out = func(*args, **kwargs)
        if host:
            for t in _tensors(out) if not isinstance(out, tuple) else [
                    t for v in out for t in _tensors(v)]:
                self.host[t] = host
        inputs = {_key(t) for _, v in named for t in _tensors(v)}
        fresh: list[torch.Tensor | None] = []
        for ret, value in _returns(schema, out):
            if ret.alias_info is None and isinstance(value, torch.Tensor) \
                    and _key(value) not in inputs:
                self.made.add(_key(value))
                self.fresh.append(value)
                fresh.append(value)
            else:
                fresh.append(None)
        pure_view = not writes and all(r.alias_info is not None for r in schema.returns)
        runs = not pure_view and func.overloadpacket.__name__ not in _ALLOCATIONS
        self.ops.append(_Op(func, args, kwargs, fresh, runs, rng_state))
        return out

    def _save(self, t: torch.Tensor) -> None:
        key = _key(t)
        if key and key not in self.made and key not in self.saved:
            storage = t.untyped_storage()
            self.saved[key] = (storage, storage.clone())

    def _inspect(self, func, named: list) -> None:
        if self.rehearsal.in_read:  # a host read the sync meter counts already
            return
        name = func.overloadpacket.__name__
        if name == "lift_fresh":
            self._problem("host_tensor")
        for tag in func.tags:
            if tag not in _TAGS:
                continue
            if name in _INDEXING and not any(
                    t.dtype in (torch.bool, torch.uint8) for _, v in named[1:]
                    for t in _tensors(v)):
                continue  # integer indices: the shape is the indices' shape, not the data's
            self._problem(_TAGS[tag], f"{_EXPLAIN[_TAGS[tag]]}: {func}")

    def _host_inputs(self, func, named: list) -> str | None:
        """Where the host tensors among an op's inputs were made, if all its inputs are host
        tensors (its outputs are host tensors too); a problem if it mixes one that is not a
        scalar with device tensors."""
        tensors = [t for _, v in named for t in _tensors(v)]
        host = [self.host[t] for t in tensors if t in self.host]
        if not host:
            return None
        if len(host) == len(tensors):
            return host[0]
        mixed = [self.host[t] for t in tensors if t in self.host and t.dim() > 0]
        if mixed and func.overloadpacket.__name__ not in _CROSS_DEVICE \
                and not self.rehearsal.in_read:
            self._problem("host_mix", f"{_EXPLAIN['host_mix']}: {func} mixes the tensor "
                                      f"made at {mixed[0]}")
        return None

    def _problem(self, kind: str, what: str | None = None) -> None:
        self.problems.append(Problem(kind, call_site(internal=(__file__,)),
                                     what or _EXPLAIN[kind]))

    def _generator(self, func, named) -> tuple[torch.Generator, torch.Tensor] | None:
        """Note a random op's generator; for one the graph does not know, the state a replay
        draws from (always the same, as on a GPU)."""
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None
        gens = [v for _, v in named if isinstance(v, torch.Generator)]
        gen = gens[0] if gens else torch.default_generator
        known = next((g for g in (torch.default_generator, *self.graph.generators)
                      if _same_generator(gen, g)), None)
        self._remember(known or gen)
        if known is not None:
            return None
        self._problem("unregistered_generator", f"{_EXPLAIN['unregistered_generator']}: "
                                                f"{func} draws from it")
        return gen, gen.get_state()

    def undo(self) -> None:
        """What a capture leaves: no write, no generator advanced, its tensors garbage."""
        with torch.no_grad():
            for storage, before in self.saved.values():
                storage.copy_(before)
            for gen, state in self.generators.values():
                gen.set_state(state)
            for t in self.fresh:
                if t.is_floating_point() or t.is_complex():
                    t.fill_(math.nan)
                elif t.dtype != torch.bool:
                    t.fill_(torch.iinfo(t.dtype).max)


class _HostMade(TorchFunctionMode):
    """Notes each tensor a capture makes with a constructor given no ``device=``: on a GPU it
    is a host tensor, whatever the CPU rehearsal makes of it."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        while hasattr(func, "labkit_original"):  # torch's method, not labkit's wrapper of it:
            func = func.labkit_original          # one read counts once
        out = func(*args, **kwargs)
        if func in _CONSTRUCTORS and kwargs.get("device") is None \
                and isinstance(out, torch.Tensor):
            self.recorder.host[out] = call_site(internal=(__file__,))
        return out


_CONSTRUCTORS = _constructors()


class _Graph:
    """Stands in for ``torch.cuda.CUDAGraph`` inside a :class:`rehearsal`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.generators: list[torch.Generator] = []
        self.ops: list[_Op] | None = None
        self.replays = 0

    def register_generator_state(self, generator: torch.Generator) -> None:
        self.generators.append(generator)

    def replay(self) -> None:
        """The recorded ops again, no Python: fresh results land in the capture's tensors."""
        if self.ops is None:
            raise RuntimeError("replay() of a graph that was never captured")
        with torch.no_grad():
            for op in self.ops:
                if not op.runs:
                    continue
                if op.rng_state is not None:  # an unregistered generator: the same draw
                    gen, state = op.rng_state
                    now = gen.get_state()
                    gen.set_state(state)
                out = op.func(*op.args, **op.kwargs)
                if op.rng_state is not None:
                    gen.set_state(now)
                for static, (_, value) in zip(op.fresh, _returns(op.func._schema, out)):
                    if static is not None and value is not static:
                        static.copy_(value)
        self.replays += 1

    def reset(self) -> None:
        self.ops = None

    def pool(self) -> tuple[int, int]:
        return (0, id(self))


class _Stream:
    """Stands in for ``torch.cuda.Stream``: one stream, so nothing to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event


class rehearsal:  # noqa: N801 - used like torch's context managers
    """Inside, ``torch.cuda``'s graph API captures and replays on the CPU (see the module
    docstring); ``problems`` collects what every capture inside found, ``graphs`` every graph
    made. ``strict``: raise :class:`CaptureError` at the end of a capture that found any."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.problems: list[Problem] = []
        self.graphs: list[_Graph] = []
        self.capturing = False
        self.in_read = False
        self._stack = contextlib.ExitStack()

    # ------------------------------------------------------------------ torch.cuda's calls

    def _graph_class(self) -> type:
        owner = self

        class CUDAGraph(_Graph):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__()
                owner.graphs.append(self)

        return CUDAGraph

    @contextlib.contextmanager
    def _graph(self, cuda_graph: _Graph, pool: Any = None, stream: Any = None,
               capture_error_mode: str = "global") -> Iterator[None]:
        if self.capturing:
            raise RuntimeError("a capture inside a capture: CUDA graphs do not nest")
        recorder = _Recorder(cuda_graph, self)
        meter = SyncMeter(call_sites=True, cpu_as_device=True)
        self.capturing = True
        try:
            with meter, _HostMade(recorder), recorder:
                yield
        finally:
            self.capturing = False
            recorder.undo()
        reads: dict[str, list] = {}  # by the line in labkit or user code; torch's line kept
        for site, n in meter.sites.items():
            reads.setdefault(site.split(" via ")[0], [site, 0])[1] += n
        found = [Problem("host_read", site, f"{_EXPLAIN['host_read']} ({n}x)")
                 for site, n in reads.values()] + recorder.problems
        found = list({(p.kind, p.where): p for p in found}.values())
        self.problems += found
        cuda_graph.ops = recorder.ops
        if found and self.strict:
            raise CaptureError(found)

    def _stand_ins(self) -> dict[str, Any]:
        return {"CUDAGraph": self._graph_class(), "graph": self._graph, "Stream": _Stream,
                "stream": lambda stream=None: contextlib.nullcontext(),
                "current_stream": lambda device=None: _Stream(),
                "synchronize": lambda device=None: None,
                "is_current_stream_capturing": lambda: self.capturing}

    # ------------------------------------------------------------------ enter / exit

    def __enter__(self) -> rehearsal:
        from ..stages import REQUIREMENTS

        stack = self._stack.__enter__()
        try:
            for name, value in self._stand_ins().items():
                stack.enter_context(_patched(torch.cuda, name, value))
            stack.enter_context(_patched_items(REQUIREMENTS, {
                need: (lambda device: True, reason)
                for need, (_, reason) in REQUIREMENTS.items()}))
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(_read_flag(self))
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> bool | None:
        return self._stack.__exit__(*exc)


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _patched_items(mapping: dict, values: dict) -> Iterator[None]:
    old = dict(mapping)
    mapping.update(values)
    try:
        yield
    finally:
        mapping.clear()
        mapping.update(old)


@contextlib.contextmanager
def _read_flag(owner: rehearsal) -> Iterator[None]:
    """Mark the time spent inside ``Tensor.item`` and kin, so that the dispatch-level check
    leaves the ops of a host read to the sync meter, which names it."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(fn: Callable) -> Callable:
        @wraps_method(fn)
        def read(self, *args, **kwargs):
            outer = owner.in_read
            owner.in_read = True
            try:
                return fn(self, *args, **kwargs)
            finally:
                owner.in_read = outer
        return read

    for n, fn in originals.items():
        setattr(torch.Tensor, n, wrap(fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(torch.Tensor, n, fn)


# ---------------------------------------------------------------------------- for readers


@dataclass
class Report:
    """What :func:`rehearse` found: ``ok`` when nothing would stop a real capture or make its
    replays differ; ``outputs`` are the captured function's outputs, holding the last replay's
    results; ``replays`` how many ran."""

    problems: list[Problem] = field(default_factory=list)
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


def _shapes(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [(tuple(value.shape), value.dtype)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _shapes(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _shapes(v)]
    return [type(value).__name__]


def rehearse(fn: Callable[..., Any], *args: Any, replays: int = 2, warmup: int = 3) -> Report:
    """Rehearse capturing ``fn(*args)`` as a CUDA graph, on the CPU: ``warmup`` calls (they
    really run, as torch's recipe does before a capture), one capture on static copies of the
    tensor arguments, then ``replays`` replays. The report lists, with your ``file:line``,
    host reads, data-dependent ops, unregistered generators, inputs or outputs whose shapes
    differ between the warm-up and the capture, and outputs that are not tensors made by the
    graph. Nothing is replayed when a real capture would have failed."""
    from ..capture import clone_state

    if isinstance(replays, bool) or not isinstance(replays, int) or replays < 0:
        raise ValueError(f"replays must be an int >= 0, got {replays!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    report = Report()
    with rehearsal(strict=False) as r:
        static = clone_state(args)
        for _ in range(warmup):
            warm = fn(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        report.problems = list(r.problems)
        site = f"{getattr(fn, '__qualname__', repr(fn))}"
        if _shapes(warm) != _shapes(out):
            report.problems.append(Problem("shape", site, f"{_EXPLAIN['shape']}: "
                                                          f"{_shapes(warm)} -> {_shapes(out)}"))
        loose = [type(v).__name__ for v in _leaves(out) if not isinstance(v, torch.Tensor)]
        if loose:
            report.problems.append(Problem("not_static", site, f"{_EXPLAIN['not_static']}: "
                                                               f"{', '.join(loose)}"))
        if report.ok:
            for _ in range(replays):
                graph.replay()
            report.replays = replays
    report.outputs = out
    return report


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
                "eager; on the CPU: no speed measured, fp32 and a non-capturable Adam)")


def rehearse_stage(stage: Any, cfg: Any = None, iterations: int = 2) -> StageReport:
    """Rehearse ``stage`` (one with CUDA graphs: stage 8, or a plant of it) on the CPU for
    ``iterations`` iterations, and run the same stage without its graphs, both eagerly: the
    problems its captures found, and whether every rollout, every update's statistics and the
    parameters after each update are bit-identical."""
    from ..config import RunConfig
    from ..stages import Pipeline, get_stage
    from .findings import without_graphs

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
        with Pipeline(s, cfg, "cpu") as p:
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
    return a == b or (a != a and b != b)  # NaN (no episode finished) equals NaN
