"""Sync meter: count host reads of tensor data.

A *host read* is any call that needs a tensor's values on the CPU: ``.item()``, ``.cpu()``,
``.numpy()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``operator.index(t)``, and
a device tensor copied to the host by ``.to("cpu")`` or ``copy_`` (except a non-blocking copy
into pinned memory, which does not wait). On a GPU each one is a sync that
stalls the pipeline; on a CPU it is counted the same way, so a stage's count is the same
number on both. Counting is per thread: only reads made by the thread that entered the meter
count (a background logger's reads are off the hot path by design).

On CUDA the meter can also record what ``torch.cuda.set_sync_debug_mode("warn")`` reports
(``cuda_syncs``), which includes syncs done inside torch ops.

With ``call_sites=True`` it also counts where each read came from (``sites``): the first frame
outside torch, as ``file:line (function)``, and, when the read itself happened inside torch
(an optimizer reading its step counter), the torch line after ``via``.
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


def source_line(path: str, line: int) -> str:
    """The text of line ``line`` of ``path`` as a call site names it (absolute, relative to the
    repository, or to a ``sys.path`` entry: ``torch/optim/adam.py``), stripped; "" if unknown."""
    full = os.path.join(_ROOT, path)  # an absolute path (a notebook cell's too) stays as it is
    return (linecache.getline(full, line) or linecache.getline(path, line)).strip()


#: torch's frames that only pass a call on (dynamo's disable wrapper around a dispatch mode):
#: never the "via" of a call site.
_WRAPPERS = (os.path.join("_dynamo", "eval_frame.py"), os.path.join("torch", "_compile.py"))


#: A torch function or dispatch mode passes calls on: its hook is never a call site.
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")


def call_site(skip: int = 0, internal: tuple[str, ...] = ()) -> str:
    """Where the current call comes from: the first frame outside this module, the files
    ``internal`` names (the caller's own module, say) and torch (``file:line (function)``),
    plus ``via`` the torch frame that made it, if any."""
    frame = sys._getframe(1 + skip)
    inner = None
    own = (__file__, *internal)
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


def _count(name: str, cpu_tensor: bool = False) -> None:
    """Count a read in the meters of this thread (one of a CPU tensor only in those that
    count CPU tensors as device tensors)."""
    tid = threading.get_ident()
    for meter in _active:
        if meter._thread == tid and (meter.cpu_as_device or not cpu_tensor):
            meter.counts[name] += 1
            if meter.sites is not None:
                meter.sites[call_site()] += 1


def wraps_method(fn):
    """``functools.wraps`` for labkit's wrappers around a ``torch.Tensor`` method (the sync
    meter's, the rehearsal's): ``labkit_original`` is the method wrapped, so that a torch
    function mode can call torch's own and leave every other decorator alone."""
    def decorate(wrapper):
        wrapper = functools.wraps(fn)(wrapper)
        wrapper.labkit_original = fn
        return wrapper
    return decorate


def _wrap(name: str, fn):
    @wraps_method(fn)
    def wrapper(self, *args, **kwargs):
        _count(name)
        return fn(self, *args, **kwargs)
    return wrapper


def _copy_wrapper(fn):
    @wraps_method(fn)
    def copy_(self, src, non_blocking=False):
        # Device -> host: it waits, unless non_blocking into pinned memory (which may not).
        if (self.device.type == "cpu" and isinstance(src, torch.Tensor)
                and src.device.type != "cpu" and not (non_blocking and self.is_pinned())):
            _count("copy_")
        return fn(self, src, non_blocking)
    return copy_


def _to_wrapper(fn):
    @wraps_method(fn)
    def to(self, *args, **kwargs):
        if self.device.type != "cpu":  # ``x.to("cpu")`` of a device tensor is a D2H copy
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None and device.type == "cpu":
                _count("to")
        elif "cpu" in (*args[:1], kwargs.get("device")):
            # a CPU tensor sent to "cpu" by name: a host read where CPU tensors stand for
            # device ones (``x.to(x.device)`` is not: it stays where it is on every device)
            _count("to", cpu_tensor=True)
        return fn(self, *args, **kwargs)
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
    """Context manager counting host reads in the current thread. ``cpu_as_device``: count
    ``.to("cpu")`` of a CPU tensor too (the device named "cpu"), as if every tensor lived on a
    device (the CUDA-graph rehearsal on the CPU, ``labkit.doctor.rehearsal``).

    >>> with SyncMeter() as m:
    ...     torch.ones(2).sum().item()
    >>> m.host_reads
    1
    """

    def __init__(self, cuda_debug: bool = False, call_sites: bool = False,
                 cpu_as_device: bool = False) -> None:
        self.cpu_as_device = cpu_as_device
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] | None = Counter() if call_sites else None
        self.cuda_syncs = 0
        self._cuda_debug = cuda_debug and torch.cuda.is_available()
        self._thread = threading.get_ident()

    @property
    def host_reads(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> SyncMeter:
        self._thread = threading.get_ident()
        with _lock:
            if not _active:
                _install()
            _active.append(self)
        if self._cuda_debug:
            self._warn_ctx = warnings.catch_warnings(record=True)
            self._caught = self._warn_ctx.__enter__()
            warnings.simplefilter("always")
            self._old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda_debug:
            torch.cuda.set_sync_debug_mode(self._old_mode)
            self.cuda_syncs = sum("synchroniz" in str(w.message) for w in self._caught)
            self._warn_ctx.__exit__(*exc)
        with _lock:
            _active.remove(self)
            if not _active:
                _uninstall()


def count_host_reads(fn, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` under a meter; return (host reads, result)."""
    with SyncMeter() as meter:
        out = fn(*args, **kwargs)
    return meter.host_reads, out
