"""The CPU stand-in for ``torch.cuda``'s graph API that :mod:`labkit.doctor.rehearsal` runs
graph code in: graph code runs unchanged, with a graph's semantics.

Inside ``with rehearsal():`` the few ``torch.cuda`` calls that graph code makes (``CUDAGraph``,
``graph``, ``Stream``, ``stream``, ``current_stream``, ``synchronize``,
``is_current_stream_capturing``) are stood in for on the CPU, and so are torch's capture
health check of an optimizer's ``step()`` and the devices a ``capturable=True`` optimizer
accepts (the CPU among them), so that ``labkit.capture.CapturedStep``, stage 8, the recipe's
graph step and a reader's own capture code run as they are, with these semantics:

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
CUDA or bf16 are built on the CPU inside (``stages.assuming(REHEARSED)``): the rehearsal runs
in the CPU's precision (bf16 where it has bf16 instructions, fp32 elsewhere, where a GPU runs
bf16), and a ``capturable=True`` optimizer as on a GPU (torch's capture
health check of ``step()`` and its list of capturable devices are stood in for).

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
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ..measure.hostflow import frame_call_device
from ..measure.syncmeter import (
    SyncMeter,
    call_site,
    parse_site,
    short_path,
    source_line,
    stands_in,
    target_device,
    wraps_method,
)
from ..stages import assuming
from .kernel_syncs import checks_on_cpu_only, in_kernel_sync
from .kinds import KINDS, Finding

stands_in(__file__)  # a problem's line is the caller's, never a stand-in's

_TAGS = {torch.Tag.data_dependent_output: "data_dependent",
         torch.Tag.dynamic_output_shape: "dynamic_shape"}
if hasattr(torch.Tag, "cudagraph_unsafe"):
    _TAGS[torch.Tag.cudagraph_unsafe] = "cudagraph_unsafe"
#: Why a finding of a kind (:data:`~labkit.doctor.kinds.KINDS`) happened, where the kind has
#: several causes; ``pageable`` is a host-to-device copy"s.
CAUSES = {
    "item": "reads a tensor's value on the host, as .item() does (a 0-d tensor used as an "
            "index or a Python number is read so): a capture cannot wait for it; index with "
            "index_select, gather or torch.where instead",
    "mask": "a boolean mask as an index (x[mask], x[mask] = values) finds its True entries "
            "with nonzero, whose count the host reads; use torch.where(mask, values, x) or "
            "x.masked_fill_(mask, value) (a Python number, or a 0-d host scalar, as the value "
            "takes that path)",
    "host_random": "a number drawn from a host random generator (random, numpy.random) inside "
                   "the capture is drawn once, at capture: every replay reuses it (draw on the "
                   "device with a torch.Generator the graph registers)",
    "scaler": "GradScaler.step(optimizer) reads found_inf on the host (.item()) before it steps "
              "an optimizer that is not fused: a capture cannot wait for it (use a fused "
              "optimizer, which takes the scale and found_inf on the device)",
    "python_state": "the step changes Python state (eager calls move it on; a replay runs no "
                    "Python, so it stays where the capture left it)",
    "frozen_branch": "the capture ran other ops than the eager call before it (Python control "
                     "flow that changes between calls): every replay repeats the capture's",
    "pageable": "a host tensor copied to the device inside the capture: a copy from pageable "
                "host memory, which a capture cannot record (copy it once, outside, into a "
                "device tensor, and update that in place)",
}
#: Tagged dynamic_output_shape for boolean masks only: with integer indices the output has
#: the indices' shape.
_INDEXING = {"index", "_unsafe_index"}
#: In-place ops that change a tensor's shape or strides, not its data.
_META_INPLACE = {"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
                 "as_strided_", "resize_", "resize_as_", "detach_"}
#: Writes through an index (``x[i] = v``, ``index_put``).
_INDEX_PUTS = {"index_put_", "index_put", "_index_put_impl_"}
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


class CaptureError(RuntimeError):
    """A rehearsed capture found what would make a real one fail or replay wrong."""

    def __init__(self, problems: list[Finding]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"the capture could not be a CUDA graph ({len(problems)} problem"
                         f"{'s' if len(problems) > 1 else ''}):\n{lines}")


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    fresh: list[tuple | None]  # (output made at capture, its shape, strides, offset); None
    # where one aliases an input
    runs: bool  # False for pure views and allocations: their outputs stay as captured
    rng_state: tuple[torch.Generator, torch.Tensor] | None = None  # an unregistered generator
    modes: tuple[bool, bool] = (False, False)  # grad and inference mode at capture
    shapes: dict[int, tuple] | None = None  # id(tensor argument) -> its shape, strides, offset


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


def dense_storage(t: torch.Tensor) -> bool:
    """A tensor with one plain storage (not sparse, not nested)."""
    return t.layout == torch.strided and not t.is_nested


def _as_made(t: torch.Tensor, *made: Any) -> torch.Tensor:
    """``t`` with the shape, strides and offset ``made`` it had when the capture made it (a
    later in-place ``squeeze_``/``transpose_`` changed its view of the same memory, not the
    memory)."""
    if not made or (tuple(t.shape), t.stride(), t.storage_offset()) == made:
        return t
    return torch.as_strided(t, *made)


def _as_captured(value: Any, shapes: dict[int, tuple] | None) -> Any:
    """``value`` (an op's argument) with each tensor seen as it was at capture (see
    :func:`_as_made`)."""
    if isinstance(value, torch.Tensor):
        made = (shapes or {}).get(id(value))
        return value if made is None else _as_made(value, *made)
    if isinstance(value, (list, tuple)):
        return type(value)(_as_captured(v, shapes) for v in value)
    return value


def storage_key(t: torch.Tensor) -> int:
    """The memory a tensor lives in: its storage's address; for a sparse or nested tensor,
    which has no single storage, the tensor itself."""
    return t.untyped_storage().data_ptr() if dense_storage(t) else id(t)


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
        self.problems: list[Finding] = []
        self.host = rehearsal.host  # tensor -> where it was made on the host
        self.constructing: list[tuple[str, bool]] = []  # (constructor, given a device) calls
        self.cpu_only_checks = 0  # inside a call whose host reads are the CPU's own checks
        self.lifts = WeakTensorKeyDictionary()  # Python numbers and data made tensors
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
        if host and writes and not self.rehearsal.in_read and any(
                storage_key(t) not in self.made for a, v in named
                if a.alias_info is not None and a.alias_info.is_write for t in _tensors(v)):
            self._problem("host_op", f"{KINDS['host_op'].means}: {func} writes the tensor made at "
                                     f"{host}")
        rng_state = self._generator(func, named)
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == "lift_fresh" and isinstance(out, torch.Tensor):
            self.lifts[out] = True
        if host:
            for t in _tensors(out) if not isinstance(out, tuple) else [
                    t for v in out for t in _tensors(v)]:
                self.host[t] = host
        inputs = {storage_key(t) for _, v in named for t in _tensors(v)}
        fresh: list[tuple | None] = []
        for ret, value in _returns(schema, out):
            if ret.alias_info is None and isinstance(value, torch.Tensor) \
                    and storage_key(value) not in inputs:
                self.made.add(storage_key(value))
                self.fresh.append(value)
                fresh.append((value, *((tuple(value.shape), value.stride(),
                                        value.storage_offset()) if dense_storage(value) else ())))
            else:
                fresh.append(None)
        pure_view = not writes and all(r.alias_info is not None for r in schema.returns)
        # a CPU op runs once, at capture: the graph holds only device work; a view made in
        # place (squeeze_, transpose_) changes the tensor's shape, not its memory: done once
        name = func.overloadpacket.__name__
        runs = not pure_view and name not in _ALLOCATIONS and name not in _META_INPLACE \
            and not host
        self.ops.append(_Op(func, args, kwargs, fresh, runs, rng_state,
                            (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
                            {id(t): (tuple(t.shape), t.stride(), t.storage_offset())
                             for _, v in named for t in _tensors(v) if dense_storage(t)}))
        return out

    def _save(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key and key not in self.made and key not in self.saved:
            target = t.untyped_storage() if dense_storage(t) else t
            self.saved[key] = (target, target.clone())

    def _inspect(self, func, named: list) -> None:
        if self.rehearsal.in_read or self.cpu_only_checks:  # the meter counts it already, or
            return                                         # a check CUDA makes on the device
        name = func.overloadpacket.__name__
        by_name = {a.name: v for a, v in named}
        if name == "lift_fresh":
            self._lifted(by_name.get("self"))
        if name in _INDEX_PUTS and self._masked_put(named):
            self._problem("dynamic_shape", f"{CAUSES['mask']}: {func}")
        synced = in_kernel_sync(name, by_name)
        if synced:
            self._problem("kernel_sync", f"{synced}: {func}")
        for tag in func.tags:
            if tag not in _TAGS:
                continue
            if name in _INDEXING and not any(
                    t.dtype in (torch.bool, torch.uint8) for _, v in named[1:]
                    for t in _tensors(v)):
                continue  # integer indices: the shape is the indices' shape, not the data's
            if name == "repeat_interleave" and by_name.get("output_size") is not None:
                continue  # output_size: torch's documented way to skip the sync
            kind = _TAGS[tag]
            said = ("item" if name == "_local_scalar_dense" else
                    "mask" if name in _INDEXING else kind)
            self._problem(kind, f"{CAUSES[said] if said in CAUSES else KINDS[kind].means}: {func}")

    def _masked_put(self, named: list) -> bool:
        """``x[mask] = value``: a boolean index syncs on CUDA unless it is the one index and
        the value one element on the host (a Python number: torch's masked_fill path)."""
        indices = [t for t in _tensors(named[1][1]) if t is not None] if len(named) > 1 else []
        if not any(t.dtype in (torch.bool, torch.uint8) for t in indices):
            return False
        value = named[2][1] if len(named) > 2 else None
        host_scalar = isinstance(value, torch.Tensor) and value.numel() == 1 and (
            value in self.host or value in self.lifts)
        return not (len(indices) == 1 and host_scalar)

    def _lifted(self, value: Any) -> None:
        """Python data made a tensor inside the capture: a 0-d host scalar (``x * 0.5``'s
        ``torch.tensor(0.5)``, ``y[mask] = 0.0``) is legal in a CUDA op, its value baked in;
        anything else is a host-to-device copy, named by the call that made it."""
        made, on_device = self.constructing[-1] if self.constructing else ("", False)
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not on_device:
            return
        what = f"{made}(...)" if made else _maker_in_source(call_site(internal=(__file__,)))
        self._problem("host_tensor", f"{what} {KINDS['host_tensor'].means}")

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
        name = func.overloadpacket.__name__
        target = named[0][1] if named else None
        source = named[1][1] if len(named) > 1 else None
        if name in ("copy_", "_copy_from") and isinstance(target, torch.Tensor) \
                and target in self.host and not self.rehearsal.in_read \
                and not (target in self.rehearsal.pinned and _non_blocking(named)) \
                and not (isinstance(source, torch.Tensor) and (source in self.host
                                                               or source in self.lifts)):
            self._problem("host_copy", f"{KINDS['host_copy'].means} (made at {self.host[target]})")
            return None
        mixed = [self.host[t] for t in tensors if t in self.host and t.dim() > 0]
        if mixed and name not in _CROSS_DEVICE and not self.rehearsal.in_read:
            self._problem("host_mix", f"{KINDS['host_mix'].means}: {func} mixes the tensor "
                                      f"made at {mixed[0]}")
        return None

    def _problem(self, kind: str, what: str | None = None) -> None:
        self.problems.append(Finding(kind, call_site(internal=(__file__,)),
                                     what or KINDS[kind].means))

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
        self._problem("unregistered_generator", f"{KINDS['unregistered_generator'].means}: "
                                                f"{func} draws from it")
        return gen, gen.get_state()

    def undo(self) -> None:
        """What a capture leaves: no write, no generator advanced, its tensors garbage."""
        with torch.no_grad():
            for target, before in self.saved.values():
                target.copy_(before)
            for gen, state in self.generators.values():
                gen.set_state(state)
            for t in self.fresh:  # an inference_mode step's tensors in that mode
                if not dense_storage(t):
                    t = t._values() if t.layout == torch.sparse_coo else None
                    if t is None:  # a nested tensor's buffers: left as the capture made them
                        continue
                with torch.inference_mode(t.is_inference()), torch.no_grad():
                    if t.is_floating_point() or t.is_complex():
                        t.fill_(math.nan)
                    elif t.dtype != torch.bool:
                        t.fill_(torch.iinfo(t.dtype).max)


def _non_blocking(named: list) -> bool:
    """Whether a ``copy_``'s named arguments ask for a non-blocking copy (into pinned host
    memory that is an async copy a capture records; a blocking one waits for the device)."""
    return any(arg.name == "non_blocking" and value is True for arg, value in named)


def _made_on_host(func: Any, args: tuple, kwargs: dict, caller: Any) -> tuple[bool, bool]:
    """(whether ``func`` makes a tensor from nothing or from data, whether on a GPU that tensor
    would be a host tensor): a constructor or ``*_like`` given ``device=`` the CPU named in
    the code (``caller``'s source says so), or given no device and no tensor to take one from
    (``sparse_coo_tensor(i, v)`` and ``empty_like(x)`` take their inputs' device,
    ``x.new_tensor`` x's)."""
    fname = getattr(func, "__name__", "")
    made = func in _CONSTRUCTORS or fname in _FROM_DATA or (
        fname.endswith("_like") and kwargs.get("device") is not None)
    if not made:
        return False, False
    if kwargs.get("device") is not None:
        return True, frame_call_device(caller) == "cpu"
    return True, not fname.startswith("new_") and not any(
        isinstance(a, torch.Tensor) for a in args)


def _moved_to_host(func: Any, args: tuple, kwargs: dict, caller: Any) -> bool | None:
    """For a call that moves a tensor (``.to``, ``.cpu()``, ``.cuda()``): whether the result
    is a host tensor on a GPU (``.cpu()``, ``.to("cpu")`` named in the code; ``.to(device)``
    with a variable is the device, ``.to(dtype)`` stays where it was); None for other calls."""
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True
    if name == "cuda":
        return False
    if name != "to" or not args or not isinstance(args[0], torch.Tensor):
        return None
    if target_device(args[1:], kwargs) is None:
        return args[0] in _ACTIVE[-1].host if _ACTIVE else None
    return frame_call_device(caller) == "cpu"


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
        recorder = self.recorder
        cpu_only = checks_on_cpu_only(func, args, kwargs)
        made, host = _made_on_host(func, args, kwargs, sys._getframe(1))
        moved = _moved_to_host(func, args, kwargs, sys._getframe(1))
        if moved is False and args[0] in recorder.host and not recorder.rehearsal.in_read:
            recorder._problem("host_copy", f"{CAUSES['pageable']} (made at "
                                           f"{recorder.host[args[0]]})")
        if made:
            recorder.constructing.append((_name(func), not host))
        recorder.cpu_only_checks += cpu_only
        try:
            out = func(*args, **kwargs)
        finally:
            recorder.cpu_only_checks -= cpu_only
            if made:
                recorder.constructing.pop()
        if moved is False and isinstance(out, torch.Tensor):
            recorder.host.pop(out, None)  # on the device now (on a CPU, maybe the input itself)
        if host and isinstance(out, torch.Tensor):
            recorder.host[out] = call_site(internal=(__file__,))
            if getattr(func, "__name__", "") in _FROM_DATA and func not in _CONSTRUCTORS \
                    and not self.recorder.rehearsal.in_read:
                # torch.from_numpy: no op of torch's makes it, so the dispatch level never
                # sees it; the data still has to reach the device
                recorder._problem("host_tensor", f"{_name(func)}(...) "
                                                 f"{KINDS['host_tensor'].means}")
        return out


def _maker_in_source(site: str) -> str:
    """How the line at ``site`` makes a tensor of Python or NumPy data, by its text (for the
    message only), or a plain description."""
    parsed = parse_site(site)
    line = source_line(parsed[0], parsed[1]) if parsed else ""
    found = [name for name in ("from_numpy", "as_tensor", "new_tensor", "tensor")
             if f"{name}(" in line]
    if not found:
        return "a tensor made from Python or NumPy data"
    return f"{'Tensor.' if found[0].startswith('new_') else 'torch.'}{found[0]}(...)"


#: Whether a torch function neither makes nor moves a tensor (filled as functions are met).
_PLAIN: dict[Any, bool] = {}
#: Calls that move a tensor between devices.
_MOVES = {"to", "cpu", "cuda"}
#: Calls that make a tensor from Python or NumPy data, besides torch's device constructors.
_FROM_DATA = {"from_numpy", "new_tensor", "as_tensor", "tensor"}


def _name(func: Any) -> str:
    name = getattr(func, "__name__", str(func))
    return f"Tensor.{name}" if name.startswith("new_") else f"torch.{name}"


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
        with torch._C.DisableTorchFunction():  # kernels only: no torch function mode sees them
            self._run()
        self.replays += 1

    def _run(self) -> None:
        for op in self.ops:
            if not op.runs:
                continue
            if op.rng_state is not None:  # an unregistered generator: the same draw
                gen, state = op.rng_state
                now = gen.get_state()
                gen.set_state(state)
            grad, inference = op.modes  # an op may return other outputs in another mode
            # (inference_mode(False) turns grad mode on: the grad mode goes inside it); the op
            # runs below autograd, where the capture saw it: a replay records no graph
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    torch._C._AutoDispatchBelowAutograd():
                out = op.func(*_as_captured(op.args, op.shapes),
                              **{k: _as_captured(v, op.shapes) for k, v in op.kwargs.items()})
            if op.rng_state is not None:
                gen.set_state(now)
            with torch.inference_mode(inference), torch.no_grad():
                for made, (_, value) in zip(op.fresh, _returns(op.func._schema, out)):
                    if made is not None and value is not made[0]:
                        _as_made(*made).copy_(value)

    def reset(self) -> None:
        self.ops = None

    def pool(self) -> tuple[int, int]:
        return (0, id(self))


class _Stream:
    """Stands in for ``torch.cuda.Stream``: one stream, so nothing to order; a synchronize
    inside a capture is a problem, as it ends a real one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        _synchronized("Stream.synchronize()")

    def record_event(self, event: Any = None) -> Any:
        return event


class _Event:
    """Stands in for ``torch.cuda.Event``: recording is legal in a capture; waiting on the
    host for one (``synchronize``, ``elapsed_time``) is not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _synchronized("Event.synchronize()")

    def elapsed_time(self, end: Any) -> float:
        _synchronized("Event.elapsed_time()")
        return 0.0


#: What a rehearsal stands in for, for a stage's ``requires``: a pipeline built inside one
#: (``Pipeline(stage, cfg, "cpu", assume=REHEARSED)``) runs in the CPU's precision (fp32 on
#: a CPU without bf16 instructions) where a GPU runs bf16 on CUDA.
REHEARSED = ("cuda", "bf16")
#: The rehearsals entered, innermost last.
_ACTIVE: list[rehearsal] = []


def _synchronized(what: str) -> None:
    """A synchronize call: a problem if it happens inside a rehearsed capture."""
    recorder = _ACTIVE[-1].recorder if _ACTIVE else None
    if recorder is not None:
        recorder._problem("stream_sync", f"{what}: {KINDS['stream_sync'].means}")


def _host_generators() -> tuple[type, ...]:
    """The random generators that live on the host: Python's, and NumPy's if it is there."""
    import random

    kinds: list[type] = [random.Random]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds += [numpy.random.Generator, numpy.random.RandomState]
    return tuple(kinds)


@contextlib.contextmanager
def _host_random(recorder: _Recorder) -> Iterator[None]:
    """A number drawn from a host random generator (``random``, ``numpy.random``) inside the
    capture is drawn once, at capture: every replay reuses it. Seen by a profile hook on the
    generators' C methods, at the line of the caller's code that drew it."""
    kinds, previous = _host_generators(), sys.getprofile()
    library = (os.path.dirname(os.__file__), os.sep + "numpy" + os.sep)
    if not profile_hook_free(previous):  # a profiler owns the hook: this check is skipped
        yield
        return

    def hook(frame, event, arg):
        if event == "c_call" and isinstance(getattr(arg, "__self__", None), kinds):
            while frame is not None and frame.f_code.co_filename.startswith(library):
                frame = frame.f_back  # random.gauss, numpy's Python layer: the caller's line
            if frame is not None:
                site = (f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} "
                        f"({frame.f_code.co_name})")
                recorder.problems.append(Finding("frozen_value", site, CAUSES["host_random"]))
        if previous is not None:
            previous(frame, event, arg)

    hook.labkit = True  # type: ignore[attr-defined]
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


def profile_hook_free(previous: Any) -> bool:
    """Whether the rehearsal may set a profile hook: none is set, or only its own (a profiler
    such as cProfile, or a debugger, owns it otherwise: the checks that need it are skipped)."""
    return previous is None or getattr(previous, "labkit", False)


def _seeded(name: str, original: Callable) -> Callable:
    """``torch.cuda.manual_seed``'s stand-in: a problem inside a capture, then the original."""
    def seed(value: int) -> None:
        recorder = _ACTIVE[-1].recorder if _ACTIVE else None
        if recorder is not None:
            recorder._problem("seed", f"{name}({value}): {KINDS['seed'].means}")
        original(value)
    return seed


class _Watch(TorchFunctionMode):
    """For the whole rehearsal: notes the host tensors made (by a constructor, or by an op on
    host tensors only) into ``owner.host``, so that a capture knows a CPU step counter made
    before it; and, on a machine without an accelerator, where torch has no pinned allocator,
    gives pageable memory for ``pin_memory=True`` and ``Tensor.pin_memory()``, so that code
    written for a GPU runs."""

    def __init__(self, owner: rehearsal, unpin: bool) -> None:
        super().__init__()
        self.owner, self.unpin = owner, unpin

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = _PLAIN.get(func)
        if plain is None:  # once per function: does it make or move a tensor?
            name = getattr(func, "__name__", "")
            plain = _PLAIN[func] = not (name in _MOVES or func in _CONSTRUCTORS or name in
                                        _FROM_DATA or name.endswith("_like")
                                        or name == "pin_memory")
        pinned = bool(kwargs.get("pin_memory"))
        if self.unpin and pinned:
            kwargs = {**kwargs, "pin_memory": False}
        host = self.owner.host
        if plain:
            if not len(host):  # no host tensor yet: nothing to follow (the common case)
                return func(*args, **kwargs)
            moved, made = None, False
        elif getattr(func, "__name__", "") == "pin_memory":
            out = args[0].clone() if self.unpin else func(*args, **kwargs)  # pinning copies
            self.owner.pinned[out] = True
            return out
        else:
            caller = sys._getframe(1)
            made, on_host = _made_on_host(func, args, kwargs, caller)
            moved = _moved_to_host(func, args, kwargs, caller)
        if moved is not None:
            on_host = moved
        elif not made:  # an op: on the host if every tensor it takes is
            inputs = [t for t in _tensors(list(args)) + _tensors(list(kwargs.values()))]
            on_host = bool(inputs) and all(t in host for t in inputs)
        out = func(*args, **kwargs)
        if moved is False and isinstance(out, torch.Tensor):
            # x.to(device) on a CPU is x itself: the code put it on its device, so it is one
            host.pop(out, None)
        elif on_host and isinstance(out, torch.Tensor) and out not in host:
            host[out] = call_site(internal=(__file__,))
        if pinned and isinstance(out, torch.Tensor):
            self.owner.pinned[out] = True
        return out


def _scaler_step(original: Callable) -> Callable:
    """``GradScaler.step``'s stand-in: a scaler made for CUDA (disabled by torch where CUDA is
    missing) reads ``found_inf`` with ``.item()`` before it steps an optimizer that cannot take
    the scale on the device (torch/amp/grad_scaler.py ``_maybe_opt_step``; a fused optimizer's
    ``_step_supports_amp_scaling`` skips it): a problem inside a capture."""
    def step(self, optimizer, *args, **kwargs):
        recorder = _ACTIVE[-1].recorder if _ACTIVE else None
        if recorder is not None and str(getattr(self, "_device", "")) == "cuda" \
                and id(self) not in _ACTIVE[-1].disabled_scalers \
                and not getattr(optimizer, "_step_supports_amp_scaling", False):
            recorder._problem("device_read", CAUSES["scaler"])
        return original(self, optimizer, *args, **kwargs)
    return step


def _capture_health_check(optimizer: torch.optim.Optimizer) -> None:
    """torch's check at the start of a capturable optimizer's ``step()``
    (``Optimizer._accelerator_graph_capture_health_check``, which returns at once without an
    accelerator): inside a capture every param group must be ``capturable``."""
    recorder = _ACTIVE[-1].recorder if _ACTIVE else None
    if recorder is not None and not all(g.get("capturable", False)
                                        for g in optimizer.param_groups):
        recorder._problem("optimizer", f"{type(optimizer).__name__}: {KINDS['optimizer'].means}")


def _optimizer_stand_ins() -> list[tuple[Any, str, Any]]:
    """(owner, name, stand-in): the capture health check, and the CPU among the devices a
    capturable optimizer accepts (torch asserts CUDA, XPU, HPU or XLA), so that
    ``capturable=True`` optimizers run in a rehearsal as they run on a GPU."""
    import sys

    devices = sys.modules["torch.optim.optimizer"]._get_capturable_supported_devices

    def with_cpu(supports_xla: bool = True) -> list[str]:
        return [*devices(supports_xla), "cpu"]

    patches: list[tuple[Any, str, Any]] = [
        (torch.optim.Optimizer, name, _capture_health_check)
        for name in ("_accelerator_graph_capture_health_check",
                     "_cuda_graph_capture_health_check")
        if hasattr(torch.optim.Optimizer, name)]
    patches += [(module, "_get_capturable_supported_devices", with_cpu)
                for name, module in list(sys.modules.items())
                if name.startswith("torch.optim.") and module is not None
                and hasattr(module, "_get_capturable_supported_devices")]
    optimizer = sys.modules["torch.optim.optimizer"]
    foreach = getattr(optimizer, "_get_foreach_kernels_supported_devices", None)
    if foreach is not None:  # an optimizer left to choose picks foreach, as on CUDA
        patches.append((optimizer, "_get_foreach_kernels_supported_devices",
                        lambda: [*foreach(), "cpu"]))
    return patches


class rehearsal:  # noqa: N801 - used like torch's context managers
    """Inside, ``torch.cuda``'s graph API captures and replays on the CPU (see the module
    docstring); ``problems`` collects what every capture inside found, ``graphs`` every graph
    made. ``strict``: raise :class:`CaptureError` at the end of a capture that found any."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.problems: list[Finding] = []
        self.graphs: list[_Graph] = []
        self.capturing = False
        self.recorder: _Recorder | None = None  # the capture's, while one runs
        # tensor -> where it was made on the host: from the start of the outermost rehearsal
        self.host = _ACTIVE[-1].host if _ACTIVE else WeakTensorKeyDictionary()
        #: the host tensors made in pinned memory (pageable here where there is no GPU)
        self.pinned = _ACTIVE[-1].pinned if _ACTIVE else WeakTensorKeyDictionary()
        self.disabled_scalers: set[int] = set()  # GradScalers the code made disabled
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
        self.capturing, self.recorder = True, recorder
        try:
            with meter, _HostMade(recorder), recorder, _host_random(recorder):
                yield
        finally:  # what the capture found is kept, also when the step raised in it
            self.capturing, self.recorder = False, None
            recorder.undo()
            reads: dict[str, list] = {}  # by the line in labkit or user code; torch's kept
            for site, n in meter.sites.items():
                reads.setdefault(site.split(" via ")[0], [site, 0])[1] += n
            found = [Finding("device_read", site, f"{KINDS['device_read'].means} ({n}x)")
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
                "synchronize": lambda device=None: _synchronized("torch.cuda.synchronize()"),
                "is_current_stream_capturing": lambda: self.capturing,
                "Event": _Event, "current_device": lambda: 0,
                "default_stream": lambda device=None: _Stream(),
                # torch.manual_seed and torch.random.manual_seed reach these two
                "manual_seed": _seeded("torch.cuda.manual_seed", torch.cuda.manual_seed),
                "manual_seed_all": _seeded("torch.cuda.manual_seed_all",
                                           torch.cuda.manual_seed_all)}

    # ------------------------------------------------------------------ enter / exit

    def __enter__(self) -> rehearsal:
        owner = _ACTIVE[0].thread if _ACTIVE else None
        if owner is not None and owner != threading.get_ident():
            raise RuntimeError("a rehearsal is running in another thread: it stands in for "
                               "torch.cuda process-wide, so rehearse one step at a time")
        self.thread = threading.get_ident()
        stack = self._stack.__enter__()
        try:
            for name, value in self._stand_ins().items():
                stack.enter_context(_patched(torch.cuda, name, value))
            if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
                stack.enter_context(_patched(torch.accelerator, "synchronize", lambda device=None:
                                             _synchronized("torch.accelerator.synchronize()")))
            # pinned memory needs an accelerator's allocator
            stack.enter_context(_Watch(self, unpin=not torch.cuda.is_available()))
            for owner, name, value in _optimizer_stand_ins():
                stack.enter_context(_patched(owner, name, value))
            for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
                if hasattr(torch.cuda.nvtx, name):  # profiler annotations: nothing to check
                    stack.enter_context(_patched(torch.cuda.nvtx, name,
                                                 lambda *args, **kwargs: 0))
            scaler = torch.amp.GradScaler
            stack.enter_context(_patched(scaler, "step", _scaler_step(scaler.step)))
            stack.enter_context(assuming(REHEARSED))
            _ACTIVE.append(self)
            stack.callback(_ACTIVE.remove, self)
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
