"""``labkit.watch``: the doctor's meters around any PyTorch code, the reader's own loop.

::

    with labkit.watch() as w:
        for update in range(n):
            ...             # your rollout and update
            w.step()        # one iteration ends
    print(w.report())       # or w.report().to_json()

While a block runs, the meters the chapters use count, by the first line outside torch (the
reader's ``file:line``, or a library's): host reads of tensor data, device reads (a sync on a
GPU) apart from host-scalar reads, with :class:`labkit.measure.syncmeter.SyncMeter`'s data-flow
classification on the CPU; and, told each op by that meter's data flow (no second meter of its
own), factories that made a host tensor, tensors made from Python or NumPy data, clones,
host-to-device copies and aten ops by kind, with the kernels compiled regions generate
(:mod:`labkit.measure.kernels`; an aten count sees only what they call out to); dynamo's new
graphs, graph breaks and recompiles, a compiled function that keeps making graphs after two
warm-up iterations, and one that reached its recompile limit (it then runs eagerly, silently);
memory at each ``step()`` (RSS, and allocated and reserved on CUDA), and the Python containers
whose tensor count grew. ``report()`` divides by the iterations marked.

A ``watch`` may be entered again (the counts add up) and used as a decorator, each call one
iteration. Nothing stays patched after a block, also when it raises: while it runs, the sync
meter's tensor methods and ``CompiledFxGraph.__call__`` (to count a compiled graph's kernels)
are the documented patches. Not seen: work in other processes (a ``SubprocVecEnv``'s workers)
and other threads' reads (a logger thread is off the hot path by design).

Overhead: every op passes through torch's Python dispatch once (the data flow), which costs
some microseconds an op whatever the op's size: small ops suffer most (see ``watch_overhead``
in ``scripts/``, and the README's figures).
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import re
import sys
import textwrap
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..measure import hostflow
from ..measure.kernels import compiled_kernels
from ..measure.syncmeter import SyncMeter, call_site, short_path, source_line
from .kinds import KINDS, Finding
from .meters import dynamo_state, rss_mb

_OBSERVED: dict[int, tuple] = {}  # id(op) -> (op, name, counted, what it may make or move)
_SPECIAL = {"aten::lift_fresh": "from_data", "aten::lift_fresh_copy": "from_data",
            "aten::clone": "clone", "aten::_to_copy": "copy", "aten::copy_": "copy",
            "aten::convolution": "convolution", "aten::addmm": "matmul", "aten::mm": "matmul",
            "aten::bmm": "matmul"}
#: The model's forward work, counted by the line that called the module
MODEL_WORK = ("convolution", "matmul")
_SKIP_OPS = ("aten::view", "aten::_unsafe_view", "aten::detach", "aten::alias", "aten::t",
             "aten::transpose", "aten::expand", "aten::unsqueeze", "aten::squeeze",
             "aten::select", "aten::slice", "aten::permute", "aten::as_strided")


class _OpCount(TorchDispatchMode):
    """aten ops by name (views left out: no kernel) and, by call site, what the code made or moved:
    tensors made from Python or NumPy data (``torch.tensor``, ``torch.Tensor(array)``:
    torch's ``lift_fresh``), factories that made a host tensor (no ``device=``, or the CPU
    named; a pinned buffer is host memory on purpose), clones, and host-to-device copies;
    and the model's forward work (:data:`MODEL_WORK`: convolutions, matrix multiplies; the
    backward's follow from them) by the line that called the module. Told each op by the
    sync meter's host flow (it knows which factories were born on the host), or a dispatch
    mode of its own where there is no flow (a watch with ``device="cuda"``: a CPU tensor is
    then a host tensor)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code stays compiled (its kernels: labkit.measure.kernels)

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.calls: dict[str, Counter] = {kind: Counter() for kind in (
            "from_data", "no_device", "clone", "host_to_device", *MODEL_WORK)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        born = made and isinstance(out, torch.Tensor) and out.device.type == "cpu"
        self.observe(func, args, kwargs, out, born if made else None)
        return out

    def observe(self, func, args=(), kwargs=None, out=None, born=None) -> None:
        info = _OBSERVED.get(id(func))
        if info is None or info[0] is not func:  # by id: an op's hash is Python code
            name = f"aten::{func._overloadpacket.__name__}"
            info = _OBSERVED[id(func)] = (func, name, name not in _SKIP_OPS, _SPECIAL.get(name))
        _, name, counted, special = info
        if counted:
            self.ops[name] += 1
        if special == "from_data":
            kind = special
        elif born:
            if kwargs and kwargs.get("pin_memory"):
                return  # a pinned buffer: host memory on purpose
            kind = "no_device"
        elif special == "clone":
            kind = special
        elif special in MODEL_WORK and torch._C._current_autograd_node() is None:
            kind = special  # in a forward (a backward's ops run inside an autograd node)
        elif special == "copy" and _to_device(name, args, out):
            kind = "host_to_device"
        else:
            return
        site = call_site(internal=(__file__, hostflow.__file__))
        if name == "aten::scalar_tensor" and not _spelled(site, "scalar_tensor"):
            return  # a Python number torch wrapped for an op (torch.where(m, x, 0.0)): a 0-d
            # CPU scalar on a GPU too, which CUDA kernels take as an argument
        if site == "<unknown>" and torch._C._current_autograd_node() is not None:
            return  # autograd's own work on its device threads (AccumulateGrad's clone)
        if kind in MODEL_WORK:  # an nn.Module's op: the line that called the module
            self.calls[kind][site.split(" via ")[0]] += 1
        elif " via " not in site:  # made inside torch's own code: not the code's choice
            self.calls[kind][site] += 1


def _spelled(site: str, word: str) -> bool:
    """The source line of call site ``site`` (``file:line (function)``) has ``word`` in it."""
    path, _, rest = site.partition(" ")[0].rpartition(":")
    return rest.isdigit() and word in source_line(path, int(rest))


def _to_device(name: str, args: tuple, out: Any) -> bool:
    """A copy from host memory to an accelerator's."""
    src, dst = (args[1], args[0]) if name == "aten::copy_" else (args[0], out)
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
            and src.device.type == "cpu" and dst.device.type != "cpu")


class _Observing:
    """An op count told each op by a host flow; leaving it stops the telling."""

    def __init__(self, flow: Any, count: _OpCount) -> None:
        self.flow, self.count = flow, count

    def __exit__(self, *exc: Any) -> None:
        self.flow.observers.remove(self.count.observe)


@dataclass
class WatchReport:
    """What a watch saw: ``findings``, the totals, ``ops_per_iteration`` with the top kinds,
    ``memory`` at each ``step()``, dynamo's ``new_graphs``, ``graph_breaks`` (reason: count),
    ``recompiles``, and ``notes`` (what was not seen)."""

    iterations: int
    seconds: float
    findings: list[Finding] = field(default_factory=list)
    device_reads: int = 0
    host_scalar_reads: int = 0
    cuda_syncs: int | None = None
    ops: int = 0
    top_ops: list[tuple[str, int]] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    new_graphs: int = 0
    graph_breaks: dict[str, int] = field(default_factory=dict)
    recompiles: int = 0
    notes: list[str] = field(default_factory=list)

    def per(self, count: int) -> float | None:
        return count / self.iterations if self.iterations else None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> WatchReport:
        """The report ``to_dict`` (or ``--json``) wrote."""
        data = dict(data, findings=[Finding(**f) for f in data.get("findings", [])])
        data["top_ops"] = [tuple(pair) for pair in data.get("top_ops", [])]
        return cls(**data)

    def format(self, top: int = 12) -> str:
        its = self.iterations
        unit = f"per iteration ({its} marked)" if its else "in all (no iteration marked)"
        lines = [f"labkit watch: {self.seconds:.2f} s watched, {its} iteration(s); counts "
                 f"{unit}"]

        def rate(n: int) -> str:
            return f"{n / its:g}" if its else f"{n}"

        lines.append(f"  host reads: {rate(self.device_reads)} device (a sync each on a GPU), "
                     f"{rate(self.host_scalar_reads)} host-scalar"
                     + (f"; CUDA reported {rate(self.cuda_syncs)} syncs"
                        if self.cuda_syncs is not None else ""))
        lines.append(f"  aten ops: {rate(self.ops)}; top: " + ", ".join(
            f"{name.removeprefix('aten::')} {rate(n)}" for name, n in self.top_ops[:6]))
        if self.new_graphs or self.graph_breaks or self.recompiles:
            lines.append(f"  compiled: {self.new_graphs} new graph(s), "
                         f"{sum(self.graph_breaks.values())} graph break(s), "
                         f"{self.recompiles} recompile(s)")
        if len(self.memory) >= 2:
            first, last = self.memory[0], self.memory[-1]
            grew = {k: last[k] - first[k] for k in first if k != "iteration"
                    and isinstance(first[k], float) and isinstance(last.get(k), float)}
            lines.append("  memory from the first to the last step: " + ", ".join(
                f"{k} {v:+,.1f}" for k, v in grew.items()))
        shown = sorted(self.findings, key=lambda f: (-f.evidence["total"], f.kind, f.where))[:top]
        if shown:
            lines.append("findings (most first):")
        for f in shown:
            total, per = f.evidence["total"], f.evidence["per_iteration"]
            n = f"{per:.4g}" if per is not None else f"{total}"
            lines.append(f"  {f.kind:<17} {n:>6} at {f.where}")
            lines += _wrapped(f.summary) + _wrapped(f"fix: chapter {f.chapter}")
        if len(self.findings) > len(shown):
            lines.append(f"  ... {len(self.findings) - len(shown)} more (--json lists all)")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    __str__ = format


def _wrapped(text: str, indent: int = 29, width: int = 96) -> list[str]:
    """``text`` as the report's indented lines, none wider than ``width``."""
    return textwrap.wrap(text, width, initial_indent=" " * indent,
                         subsequent_indent=" " * (indent + 2), break_on_hyphens=False,
                         break_long_words=False)


class watch:  # noqa: N801 - a context manager, used like torch's
    """Watch the code in a ``with`` block (module docstring); ``step()`` ends an iteration,
    ``report()`` says what was seen. ``device``: where the watched code runs (None: CUDA if a
    CUDA tensor is read, the data flow otherwise; see ``SyncMeter``)."""

    _active: list[watch] = []

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.iterations = 0
        self.seconds = 0.0
        self.reads: Counter[str] = Counter()
        self.device_site_reads: Counter[str] = Counter()
        self.calls: dict[str, Counter] = {}
        self.ops: Counter[str] = Counter()
        self.cuda_syncs: int | None = None
        self.memory: list[dict] = []
        self._containers: dict[int, int] | None = None  # id -> tensors held, at iteration 2
        self._containers_at = 0
        self._graphs = 0
        self._breaks: Counter[str] = Counter()
        self._recompiled: Counter[str] = Counter()  # function -> graphs after its first
        self._reasons: dict[str, str] = {}  # function -> the last guard that failed
        self._entries: dict | None = None  # code -> its graphs, at the last step()
        self._growth: dict[str, list] = {}  # function -> [graphs, iterations]
        self._limits: dict[str, str] = {}  # function -> last reason, recompile limit reached
        self._stack: list[Any] = []

    # ------------------------------------------------------------------ the block
    def __enter__(self) -> watch:
        if watch._active:
            raise RuntimeError("labkit.watch blocks do not nest: end the outer one first, or "
                               "mark iterations of the outer one with step()")
        watch._active.append(self)
        # where there is CUDA, the syncs CUDA itself reports too (sync debug mode "warn")
        cuda = torch.cuda.is_available() and (self.device is None or self.device.type == "cuda")
        try:
            self._meter = SyncMeter(call_sites=True, device=self.device,
                                    cuda_debug=cuda).__enter__()
            self._stack.append(self._meter)
            self._opcount = _OpCount()
            flow = hostflow.current()
            if flow is not None:  # told each op by the meter's flow: no second dispatch mode
                flow.observers.append(self._opcount.observe)
                self._stack.append(_Observing(flow, self._opcount))
            else:
                self._stack.append(self._opcount.__enter__())
            self._stack.append(compiled_kernels().__enter__())
            self._stack.append(_LimitSeen(self._limits))
        except BaseException:
            self._close(None, None, None)
            raise
        self._dynamo = dynamo_state()
        self._at_enter = _graph_counts()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._start
        graphs, breaks, _ = dynamo_state()
        self._graphs += graphs - self._dynamo[0]
        self._breaks += breaks - self._dynamo[1]
        for code, n in _graph_counts().items():
            more = n - max(1, self._at_enter.get(code, 0))
            if more > 0:
                self._recompiled[_function(code)] += more
                self._reasons[_function(code)] = _reason(code)
        self._close(*exc)

    def _close(self, *exc: Any) -> None:
        while self._stack:  # innermost first; every meter is left even if one fails
            meter = self._stack.pop()
            try:
                meter.__exit__(*exc)
            except Exception:  # noqa: BLE001 - the others must still be left
                pass
            self._collect(meter)
        watch._active.remove(self)

    def _collect(self, meter: Any) -> None:
        if isinstance(meter, SyncMeter):
            self.reads.update(meter.sites or {})
            self.device_site_reads.update(meter.device_sites or {})
            if meter._cuda_debug:
                self.cuda_syncs = (self.cuda_syncs or 0) + meter.cuda_syncs
        elif isinstance(meter, (_OpCount, _Observing)):
            count = meter if isinstance(meter, _OpCount) else meter.count
            self.ops.update(count.ops)
            for kind, sites in count.calls.items():
                self.calls.setdefault(kind, Counter()).update(sites)
        elif isinstance(meter, compiled_kernels):  # what compiled regions generated
            self.ops.update({f"inductor::{k}": n for k, n in meter.counts.items()})

    def step(self) -> None:
        """One iteration ends: count it and take the memory snapshot."""
        self.iterations += 1
        snap: dict[str, Any] = {"iteration": self.iterations, "rss_mb": rss_mb()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            snap["cuda_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
            snap["cuda_reserved_mb"] = torch.cuda.memory_reserved() / 2**20
        self.memory.append(snap)
        if self.iterations == 2:  # after a warm-up iteration: the containers to follow
            self._containers = _tensor_containers()
            self._containers_at = 2
        self._graphs_grew()

    def _graphs_grew(self) -> None:
        """After the two warm-up iterations, the compiled functions that made new graphs
        (a guard that failed: a Python number, a shape, an object that changes each time)."""
        entries = _graph_counts()
        if self._entries is not None and self.iterations > 2:
            for code, n in entries.items():
                if n > self._entries.get(code, 0):
                    entry = self._growth.setdefault(_function(code), [0, 0])
                    entry[0] += n - self._entries.get(code, 0)
                    entry[1] += 1
                    self._reasons[_function(code)] = _reason(code)
        if self.iterations >= 2:
            self._entries = entries

    def __call__(self, fn: Callable) -> Callable:
        """Decorate ``fn``: each call is watched, and is one iteration."""
        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self:
                out = fn(*args, **kwargs)
            self.step()
            return out

        watched.watch = self
        return watched

    # ------------------------------------------------------------------ the report
    def report(self) -> WatchReport:
        r = WatchReport(iterations=self.iterations, seconds=self.seconds,
                        cuda_syncs=self.cuda_syncs, memory=list(self.memory),
                        new_graphs=self._graphs, graph_breaks=dict(self._breaks),
                        recompiles=sum(self._recompiled.values()))
        r.device_reads = sum(self.device_site_reads.values())
        r.host_scalar_reads = sum(self.reads.values()) - r.device_reads
        r.ops = sum(self.ops.values())
        r.top_ops = self.ops.most_common(12)
        def found(kind: str, where: str, n: int, summary: str, per: float | None = None
                  ) -> None:
            r.findings.append(Finding(kind, where, summary, {
                "total": n, "per_iteration": r.per(n) if per is None else per}))

        for site, n in self.device_site_reads.items():
            found("device_read", site, n, "a sync on a GPU")
        for site, n in (self.reads - self.device_site_reads).items():
            found("host_scalar_read", site, n, "a CPU tensor: Python time, no wait for the GPU")
        for kind in ("no_device", "host_to_device", "clone", "from_data"):
            for site, n in self.calls.get(kind, Counter()).items():
                found(kind, site, n, KINDS[kind].means)
        for reason, n in self._breaks.items():
            found("graph_break", reason[:200], n, "dynamo's reason")
        growing = {where: entry for where, entry in self._growth.items()
                   if entry[1] >= 2 or where in self._limits}  # keeps growing, or stopped
        for where, n in self._recompiled.items():
            if where not in growing:
                found("recompile", where, n, "a new graph each; last guard that failed: "
                                             f"{self._reasons[where]}")
        for where, (graphs, its) in growing.items():
            found("graph_growth", where, graphs, f"new graphs in {its} of the "
                  f"{self.iterations - 2} iterations after warm-up; last guard that failed: "
                  f"{self._reasons[where]}", graphs / (self.iterations - 2))
        for where, reason in self._limits.items():
            r.findings.append(Finding("recompile_limit", where, f"{KINDS['recompile_limit'].means}"
                                      f"; last guard that failed: {_first_line(reason)}",
                                      {"total": 1, "per_iteration": None}))
        later = self.iterations - self._containers_at
        if self._containers is not None and later > 0:  # one scan more, at the report
            for key, (obj, n) in _tensor_containers(objects=True).items():
                grew = n - self._containers.get(key, n)
                if grew > 0:
                    found("memory_growth", f"a {type(obj).__name__} held as {_origin(obj)}",
                          grew, f"tensors it gained since iteration {self._containers_at}",
                          grew / later)
        if not self.iterations:
            r.notes.append("no iteration was marked (step(), or --function): counts are totals")
        r.notes.append("not seen: other processes (SubprocVecEnv workers), other threads' "
                       "reads")
        return r


class _LimitSeen(logging.Handler):
    """While a watch runs, dynamo's warning that a function reached its recompile limit (from
    then on it runs eagerly, with nothing else said): function -> the last guard that failed."""

    def __init__(self, seen: dict[str, str]) -> None:
        super().__init__(logging.WARNING)
        self.seen = seen
        self.logger = logging.getLogger("torch._dynamo.convert_frame")
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "torch._dynamo hit config." not in str(record.msg):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        said = re.fullmatch(r"'(.*)' \((.*):(\d+)\)", str(args[2])) if len(args) > 3 else None
        where = f"{short_path(said[2])}:{said[3]} ({said[1]})" if said else "a compiled function"
        self.seen[where] = str(args[3]) if len(args) > 3 else record.getMessage()

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)


def _graph_counts() -> dict:
    """The graphs dynamo holds for each function that recompiled (a guard failed): code ->
    its cache entries."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import guard_failures

    return {code: len(_debug_get_cache_entry_list(code)) for code in list(guard_failures)}


def _reason(code: Any) -> str:
    from torch._dynamo.utils import guard_failures

    reasons = guard_failures.get(code)
    return _first_line(str(reasons[-1])) if reasons else ""


def _first_line(reason: str) -> str:
    """``0/3: k == 3.0   # def f(x, k): ...`` -> ``0/3: k == 3.0``."""
    return reason.splitlines()[0].split("  #")[0].strip()[:160] if reason else ""


def _function(code: Any) -> str:
    """A code object as a call site names a function: ``file:line (name)``."""
    return f"{short_path(code.co_filename)}:{code.co_firstlineno} ({code.co_name})"


def _tensor_containers(objects: bool = False) -> dict[int, Any]:
    """Lists, deques and dicts that hold tensors directly: id -> count (``objects``: id ->
    (the container, count)). One pass over what the garbage collector tracks (~50 ms for
    torch's own 170k objects on a 2-core CPU)."""
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        kind = type(obj)  # type(), not isinstance: a lazy module's __class__ may warn
        if kind is list or kind is deque:
            items = obj
        elif kind is dict:
            items = obj.values()
        else:
            continue
        try:
            n = sum(1 for x in items if issubclass(type(x), torch.Tensor))
        except RuntimeError:  # changed size while iterating (another thread)
            continue
        if n:
            found[id(obj)] = (obj, n) if objects else n
    return found


def _origin(obj: Any) -> str:
    """Who holds a container: the attribute or global that refers to it, or a local variable
    of a function running now (the report is read inside the reader's code)."""
    for ref in gc.get_referrers(obj):
        if isinstance(ref, dict):
            for key, value in ref.items():
                if value is obj and isinstance(key, str):
                    return key
    frame = sys._getframe(1)
    while frame is not None:
        names = [k for k, v in frame.f_locals.items() if v is obj] \
            if frame.f_code.co_filename != __file__ else []
        if names:
            return f"{names[0]} (a local of {frame.f_code.co_name})"
        frame = frame.f_back
    return "an unnamed holder"
