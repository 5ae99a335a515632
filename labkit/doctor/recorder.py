"""What a rehearsed capture records, and how a replay runs it (the stand-in for
``torch.cuda.CUDAGraph`` that :mod:`labkit.doctor.graphs_on_cpu`'s context hands out):

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
* **what a capture cannot do is a problem**, with the call site: an op torch tags as
  data-dependent, of dynamic output shape or unsafe in a CUDA graph, an op whose CUDA kernel
  reads the device (:mod:`labkit.doctor.kernel_syncs`), ``torch.tensor(...)`` built inside the
  capture (a host-to-device copy), a tensor made without ``device=`` (a host tensor on a GPU,
  :mod:`labkit.doctor.hostmade`) mixed into an op with device tensors, and a generator that is
  used without being registered (torch registers the default one itself). Host reads are the
  sync meter's (``labkit.measure.syncmeter``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from ..measure.syncmeter import call_site, stands_in
from .hostmade import maker_in_source, tensors_of
from .kernel_syncs import in_kernel_sync
from .kinds import CAUSES, KINDS, Finding

stands_in(__file__)  # a problem's line is the caller's, never this module's


_TAGS = {torch.Tag.data_dependent_output: "data_dependent",
         torch.Tag.dynamic_output_shape: "dynamic_shape"}
if hasattr(torch.Tag, "cudagraph_unsafe"):
    _TAGS[torch.Tag.cudagraph_unsafe] = "cudagraph_unsafe"
#: Tagged dynamic_output_shape for boolean masks only: with integer indices the output has
#: the indices' shape.
_INDEXING = {"index", "_unsafe_index"}
#: In-place ops that change a tensor's shape or strides, not its data.
_META_INPLACE = {"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
                 "as_strided_", "resize_", "resize_as_", "detach_"}
#: Writes through an index (``x[i] = v``, ``index_put``).
_INDEX_PUTS = {"index_put_", "index_put", "_index_put_impl_"}
#: torch's fused optimizer steps: given a learning rate on the host, the CUDA kernel reads it
#: once, at launch (``if (lr.is_cpu()) ... lr.item<double>()`` in aten/src/ATen/native/cuda/
#: FusedAdamKernel.cu, FusedAdamWKernel.cu, FusedSgdKernel.cu)
_FUSED_STEPS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
#: Allocations: a replay keeps the buffer a capture made, so they are not re-run.
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
#: Ops that may take a host tensor beside device tensors: copies between devices.
_CROSS_DEVICE = {"copy_", "_to_copy", "lift_fresh", "_copy_from"}


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


class Recorder(TorchDispatchMode):
    """Records the ops of one capture, with what is needed to undo it and to replay it."""

    def __init__(self, graph: Graph, rehearsal: Any) -> None:  # its graphs_on_cpu.rehearsal
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
                for t in tensors_of(value):
                    self._save(t)
        self._inspect(func, named)
        host = self._host_inputs(func, named)
        if host and writes and not self.rehearsal.in_read and any(
                storage_key(t) not in self.made for a, v in named
                if a.alias_info is not None and a.alias_info.is_write for t in tensors_of(v)):
            self._problem("host_op", f"{KINDS['host_op'].means}: {func} writes the tensor made at "
                                     f"{host}")
        rng_state = self._generator(func, named)
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == "lift_fresh" and isinstance(out, torch.Tensor):
            self.lifts[out] = True
        if host:
            for t in tensors_of(out) if not isinstance(out, tuple) else [
                    t for v in out for t in tensors_of(v)]:
                self.host[t] = host
        inputs = {storage_key(t) for _, v in named for t in tensors_of(v)}
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
                             for _, v in named for t in tensors_of(v) if dense_storage(t)}))
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
        lr = by_name.get("lr")
        if name in _FUSED_STEPS and isinstance(lr, torch.Tensor) and lr in self.host:
            self._problem("frozen_value", f"{CAUSES['host_lr']} (made at {self.host[lr]}): "
                                          f"{func}")
        synced = in_kernel_sync(name, by_name)
        if synced:
            self._problem("kernel_sync", f"{synced}: {func}")
        for tag in func.tags:
            if tag not in _TAGS:
                continue
            if name in _INDEXING and not any(
                    t.dtype in (torch.bool, torch.uint8) for _, v in named[1:]
                    for t in tensors_of(v)):
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
        indices = [t for t in tensors_of(named[1][1]) if t is not None] if len(named) > 1 else []
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
        what = f"{made}(...)" if made else maker_in_source(call_site(internal=(__file__,)))
        self._problem("host_tensor", f"{what} {KINDS['host_tensor'].means}")

    def _host_inputs(self, func, named: list) -> str | None:
        """Where the host tensors among an op's inputs were made, if all its inputs are host
        tensors (its outputs are host tensors too); a problem if it mixes one that is not a
        scalar with device tensors."""
        tensors = [t for _, v in named for t in tensors_of(v)]
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


class Graph:
    """Stands in for ``torch.cuda.CUDAGraph`` inside a rehearsal: the ops a capture recorded."""

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
