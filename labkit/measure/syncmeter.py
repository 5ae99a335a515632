"""Sync meter: count host reads of tensor data, and tell device reads from host-scalar reads.

A *host read* is any call that needs a tensor's values on the CPU: ``.item()``, ``.cpu()``,
``.numpy()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``operator.index(t)``, and
a device tensor copied to the host by ``.to("cpu")`` or ``copy_`` (except a non-blocking copy
into pinned memory, which does not wait). Each read is one of two kinds:

* a **device read** (``device_reads``): its tensor lives on the device; on a GPU the host waits
  there for every kernel queued before it, a sync that drains the pipeline;
* a **host-scalar read** (``host_scalar_reads``): its tensor lives on the CPU even in a GPU run
  (torch's default Adam keeps its step counters there on purpose; a host copy already made);
  it costs Python time, never a wait for the GPU.

On a CUDA tensor the device decides. On a CPU run every tensor is a CPU tensor, so the meter
follows the data instead (:mod:`labkit.measure.hostflow`): a read is a device read when its
tensor was computed from the parameters, buffers, env state or inputs the code placed on its
device, and a host-scalar read when it comes only from tensors made on the host (a factory
that names no device or names ``"cpu"``, an optimizer's CPU step counter). So a stage's counts
are the same numbers on the CPU and on a GPU. ``SyncMeter(device="cuda")`` on a GPU run skips
the data flow: a CPU tensor there is a host tensor. ``host_reads`` is their sum. Counting is per
thread: only reads made by the thread that entered the meter count (a background logger's
reads are off the hot path by design).

On CUDA the meter can also record what ``torch.cuda.set_sync_debug_mode("warn")`` reports
(``cuda_syncs``), which includes syncs done inside torch ops.

With ``call_sites=True`` it also counts where each read came from (``sites``, and
``device_sites`` for the device reads): the first frame outside torch, as
``file:line (function)``, and, when the read itself happened inside torch (an optimizer
reading its step counter), the torch line after ``via``.
"""
from __future__ import annotations

import functools
import linecache
import os
import re
import sys
import threading
import warnings
from collections import Counter

import torch
from torch import _guards

from . import hostflow

_READS = ("item", "cpu", "numpy", "tolist", "__bool__", "__int__", "__float__", "__index__")
_lock = threading.Lock()
_active: list[SyncMeter] = []
_originals: dict[str, object] = {}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


#: The folder that holds the labkit package (the repository, in a checkout).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SITE = re.compile(r"(?P<file>.*):(?P<line>\d+) \((?P<func>.*?)\)(?: via (?P<via>.+))?")


def short_path(path: str) -> str:
    """``labkit/rollout.py`` or ``torch/optim/adam.py`` rather than a full path."""
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if marker in path:
            return path.split(marker, 1)[1]
    here = _ROOT + os.sep
    return path[len(here):] if path.startswith(here) else path


def parse_site(site: str) -> tuple[str, int, str, str | None] | None:
    """``(file, line, function, via)`` of a sync meter's call site ``file:line (function)``
    with an optional ``via torch_file:line``; None for anything else (``<unknown>``)."""
    m = _SITE.fullmatch(site)
    return (m["file"], int(m["line"]), m["func"], m["via"]) if m else None


def source_lines(path: str) -> list[str]:
    """The lines of ``path`` as a call site names it (absolute, relative to the repository, or
    to a ``sys.path`` entry: ``torch/optim/adam.py``); [] if unknown."""
    full = os.path.join(_ROOT, path)  # an absolute path (a notebook cell's too) stays as it is
    return linecache.getlines(full) or linecache.getlines(path)


def source_line(path: str, line: int) -> str:
    """The text of line ``line`` of ``path`` as a call site names it, stripped; "" if
    unknown."""
    lines = source_lines(path)
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


#: torch's frames that only pass a call on (dynamo's disable wrapper around a dispatch mode):
#: never the "via" of a call site.
_WRAPPERS = (os.path.join("_dynamo", "eval_frame.py"), os.path.join("torch", "_compile.py"),
             os.path.join("torch", "_ops.py"))


#: A torch function or dispatch mode passes calls on: its hook is never a call site.
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")
#: Files whose frames only stand in for torch's (the capture rehearsal's): never a call site.
_STAND_INS: set[str] = set()


def stands_in(path: str) -> None:
    """Register ``path`` as a file of stand-ins for torch's functions: its frames are passed
    over like torch's when a call site is looked for."""
    _STAND_INS.add(path)


#: c10's warning for each synchronizing CUDA operation under ``set_sync_debug_mode("warn")``.
#: Not the note ``set_sync_debug_mode`` itself gives once per process ("Synchronization debug
#: mode is a prototype feature ..."): counting that one added a sync to the first meter of a
#: process (torch 2.11 on an H200: stage 8's replayed rollout "made 1 sync").
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"
CUDA_DEBUG_NOTE = "Synchronization debug mode is a prototype feature"


def is_cuda_sync_warning(message: str) -> bool:
    """Is ``message`` CUDA's report of a synchronizing operation?"""
    return message.startswith(CUDA_SYNC_WARNING)


def call_site(skip: int = 0, internal: tuple[str, ...] = ()) -> str:
    """Where the current call comes from: the first frame outside this module, the files
    ``internal`` names (the caller's own module, say) and torch (``file:line (function)``),
    plus ``via`` the torch frame that made it, if any."""
    frame = sys._getframe(1 + skip)
    inner = None
    own = (__file__, *internal, *_STAND_INS)
    while frame is not None and (frame.f_code.co_filename in own
                                 or frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_name in _MODE_HOOKS):
        if frame.f_code.co_filename.startswith(_TORCH_DIR) and inner is None \
                and not frame.f_code.co_filename.endswith(_WRAPPERS):
            inner = frame
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    site = f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
    if inner is not None:
        site += f" via {short_path(inner.f_code.co_filename)}:{inner.f_lineno}"
    return site


def _count(name: str, tensor: torch.Tensor, cpu_tensor: bool = False) -> None:
    """Count a read of ``tensor`` in the meters of this thread (one of a CPU tensor only in
    those that count CPU tensors as device tensors), as a device read or a host-scalar one."""
    tid = threading.get_ident()
    site = None
    for meter in _active:
        if meter._thread == tid and (meter.cpu_as_device or not cpu_tensor):
            on_device = meter.is_device_tensor(tensor)
            meter.counts[name] += 1
            if on_device:
                meter.device_counts[name] += 1
            if meter.sites is not None:
                site = site or call_site()
                meter.sites[site] += 1
                if on_device:
                    meter.device_sites[site] += 1


def wraps_method(fn):
    """``functools.wraps`` for labkit's wrappers around a ``torch.Tensor`` method (the sync
    meter's, the rehearsal's): ``labkit_original`` is the method wrapped, so that a torch
    function mode can call torch's own and leave every other decorator alone."""
    def decorate(wrapper):
        wrapper = functools.wraps(fn)(wrapper)
        wrapper.labkit_original = fn
        return wrapper
    return decorate


_inside = threading.local()  # a read in progress on this thread: what it calls is not another


def _once(fn):
    """Call ``fn``, counting no read it makes itself (a torch function mode, such as
    ``torch.set_default_device``'s, calls the method again from inside)."""
    def call(*args, **kwargs):
        depth = getattr(_inside, "depth", 0)
        _inside.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth = depth
    return call


def _reading() -> bool:
    """Inside a read already counted; while dynamo traces (the read is then a graph break,
    run and counted eagerly; tracing the meter itself would add breaks of its own); or while
    torch compiles, also a backward that AOT autograd compiles lazily at the first
    ``backward()``, outside dynamo: inductor's own reads there (it rounds a bf16 scalar with
    ``.item()``) are compile-time work, not the code's."""
    return torch.compiler.is_compiling() or getattr(_inside, "depth", 0) > 0 \
        or _guards.CompileContext.try_get() is not None \
        or _guards.TracingContext.try_get() is not None


def _wrap(name: str, fn):
    @wraps_method(fn)
    def wrapper(self, *args, **kwargs):
        if _reading():
            return fn(self, *args, **kwargs)
        _count(name, self)
        out = _once(fn)(self, *args, **kwargs)
        if name == "cpu" and isinstance(out, torch.Tensor):
            flow = hostflow.current() if _active else None
            if flow is not None:
                out = flow.host_copy(self, out)
        return out
    return wrapper


def _copy_wrapper(fn):
    @wraps_method(fn)
    def copy_(self, src, non_blocking=False):
        # Device -> host: it waits, unless non_blocking into pinned memory (which may not).
        if (not _reading() and self.device.type == "cpu" and isinstance(src, torch.Tensor)
                and src.device.type != "cpu" and not (non_blocking and self.is_pinned())):
            _count("copy_", src)
        return _once(fn)(self, src, non_blocking)
    return copy_


def target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device ``Tensor.to(*args, **kwargs)`` sends a tensor to (None: where it is)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    try:
        return torch._C._nn._parse_to(*args[:3], **kwargs)[0]
    except (TypeError, RuntimeError):
        return None  # torch's own call raises the error the caller should see


def _to_wrapper(fn):
    @wraps_method(fn)
    def to(self, *args, **kwargs):
        if _reading():
            return fn(self, *args, **kwargs)
        device = target_device(args, kwargs)
        if self.device.type != "cpu":  # ``x.to("cpu")`` of a device tensor is a D2H copy
            if device is not None and device.type == "cpu":
                _count("to", self)
        elif device is not None and device.type == "cpu" and \
                hostflow.frame_call_device(sys._getframe(1)) in ("cpu", "unknown"):
            # a CPU tensor sent to "cpu" named in the code: a host read where CPU tensors stand
            # for device ones (``x.to(x.device)`` or ``x.to(device)`` with ``device`` a
            # variable is not: on a GPU run the variable names the GPU)
            _count("to", self, cpu_tensor=True)
        out = _once(fn)(self, *args, **kwargs)
        flow = hostflow.current() if _active else None
        if flow is not None and device is not None and isinstance(out, torch.Tensor):
            said = hostflow.frame_call_device(sys._getframe(1))
            if said == "cpu":
                out = flow.host_copy(self, out)  # x.to("cpu"): a host copy
            elif device.type == out.device.type:
                flow.placed(out)  # x.to(device): the code put it on its device
        return out
    return to


def _install() -> None:
    for name in _READS:
        _originals[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, _wrap(name, _originals[name]))
    _originals["copy_"] = torch.Tensor.copy_
    torch.Tensor.copy_ = _copy_wrapper(_originals["copy_"])
    _originals["to"] = torch.Tensor.to
    torch.Tensor.to = _to_wrapper(_originals["to"])


def _uninstall() -> None:
    for name, fn in _originals.items():
        setattr(torch.Tensor, name, fn)
    _originals.clear()


class SyncMeter:
    """Context manager counting host reads in the current thread, device reads apart from
    host-scalar reads (module docstring). ``device``: the device the metered code runs on;
    an accelerator there makes a tensor's own device decide (no data flow followed), the CPU
    or None follows the data. ``cpu_as_device``: count ``.to("cpu")`` of a CPU tensor too
    (the device named "cpu"), as if every tensor lived on a device (the CUDA-graph rehearsal
    on the CPU, ``labkit.doctor.rehearsal``).

    >>> w = torch.nn.Linear(2, 1)
    >>> with SyncMeter() as m:
    ...     loss = w(torch.ones(1, 2, device="cpu")).sum()
    ...     steps = torch.tensor(0)  # a counter made on the host
    ...     steps += 1
    ...     _ = loss.item(), steps.item()
    >>> m.host_reads, m.device_reads, m.host_scalar_reads
    (2, 1, 1)
    """

    def __init__(self, cuda_debug: bool = False, call_sites: bool = False,
                 cpu_as_device: bool = False, device: str | torch.device | None = None
                 ) -> None:
        self.cpu_as_device = cpu_as_device
        self.counts: Counter[str] = Counter()
        self.device_counts: Counter[str] = Counter()
        self.sites: Counter[str] | None = Counter() if call_sites else None
        self.device_sites: Counter[str] | None = Counter() if call_sites else None
        self.cuda_syncs = 0
        #: call site -> count: where the Python code was when CUDA reported each sync (the
        #: first frame outside torch, as :func:`call_site` names it; a sync in another
        #: thread, a logger's writer say, is counted too)
        self.cuda_sync_sites: Counter[str] = Counter()
        self._cuda_debug = cuda_debug and torch.cuda.is_available()
        self._by_device = device is not None and torch.device(device).type != "cpu"
        self._thread = threading.get_ident()
        self._flow = None
        self._show_other = warnings.showwarning

    @property
    def host_reads(self) -> int:
        """Every read: device reads + host-scalar reads."""
        return sum(self.counts.values())

    @property
    def device_reads(self) -> int:
        """Reads of tensors on the device: each one a sync on a GPU."""
        return sum(self.device_counts.values())

    @property
    def host_scalar_reads(self) -> int:
        """Reads of tensors that live on the CPU even in a GPU run: no wait for the GPU."""
        return self.host_reads - self.device_reads

    @property
    def host_scalar_counts(self) -> Counter[str]:
        return self.counts - self.device_counts

    def _cuda_warning(self, message, category, filename, lineno, file=None, line=None
                      ) -> None:
        """``warnings.showwarning`` while the CUDA sync debug mode is on: count each sync
        CUDA reports, at the first frame outside torch (the warning's own frame is the
        innermost Python one, often torch's); show any other warning as usual."""
        sync = is_cuda_sync_warning(str(message))
        if sync:
            self.cuda_syncs += 1
            self.cuda_sync_sites[call_site(skip=1, internal=(warnings.__file__,))] += 1
        if not sync or isinstance(getattr(self._show_other, "__self__", None), SyncMeter):
            # any other warning is shown as usual; a sync, to an enclosing meter too
            self._show_other(message, category, filename, lineno, file, line)

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        """Is a read of ``t`` a device read (a sync on a GPU)?"""
        if t.device.type != "cpu":
            return True
        if self._by_device:
            return False  # a CPU tensor in a run on an accelerator
        flow = hostflow.current()
        return flow is None or not flow.is_host(t)

    def __enter__(self) -> SyncMeter:
        self._thread = threading.get_ident()
        if not self._by_device:
            self._flow = hostflow.tracked()
            self._flow.__enter__()
        with _lock:
            if not _active:
                _install()
            _active.append(self)
        if self._cuda_debug:
            self.cuda_syncs, self.cuda_sync_sites = 0, Counter()
            self._warn_ctx = warnings.catch_warnings()
            self._warn_ctx.__enter__()
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=CUDA_DEBUG_NOTE)  # torch's, not a sync
            self._show_other = warnings.showwarning
            warnings.showwarning = self._cuda_warning  # restored by the context on exit
            self._old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda_debug:
            torch.cuda.set_sync_debug_mode(self._old_mode)
            self._warn_ctx.__exit__(*exc)
        with _lock:
            _active.remove(self)
            if not _active:
                _uninstall()
        if self._flow is not None:
            self._flow.__exit__(*exc)
            self._flow = None


def count_host_reads(fn, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` under a meter; return (host reads, result): every read,
    device and host-scalar alike."""
    with SyncMeter() as meter:
        out = fn(*args, **kwargs)
    return meter.host_reads, out
