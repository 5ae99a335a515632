"""Which tensors a rehearsal knows to be host tensors, on a CPU where every tensor is one.

On a GPU a tensor made without ``device=`` (or with the CPU named in the code) lives on the
host; on the CPU nothing tells it apart from a device tensor. So the rehearsal follows where
each tensor comes from: a ``TorchFunctionMode`` notes each tensor made with a constructor given
no ``device=`` (torch's list of them, the one ``set_default_device`` uses) or the CPU named in
the code, and each made by an op that takes host tensors only; ``.to(device)`` with a device
that is not the CPU takes a tensor off the list. :class:`HostWatch` does it for the whole
rehearsal (so a capture knows a CPU step counter made before it), :class:`HostMade` inside a
capture, where a host tensor copied in or made from data is a problem
(:mod:`labkit.doctor.recorder` then follows it through the ops and names an op that mixes one,
not a 0-d scalar, which CUDA accepts, with device tensors).

A second pass under ``FakeTensorMode`` with every existing tensor faked onto ``cuda`` was tried
first and rejected: on CPU-only torch 2.13 autograd through a fake CUDA tensor aborts the
process (no CUDA device guard); faking onto ``meta`` instead wrote a fake gradient into the real
parameter's ``.grad``, ops with a generator do not run under it, and code that keeps a device in
Python (an env's ``self.device``) refuses the faked tensors.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..measure.hostflow import frame_call_device, unnamed_is_host
from ..measure.syncmeter import call_site, parse_site, source_line, stands_in, target_device
from .kernel_syncs import checks_on_cpu_only
from .kinds import CAUSES, KINDS

stands_in(__file__)  # a problem's line is the caller's, never this module's


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


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's argument: the tensor, or those of a list or tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def made_on_host(func: Any, args: tuple, kwargs: dict, caller: Any) -> tuple[bool, bool]:
    """(whether ``func`` makes a tensor from nothing or from data, whether on a GPU that tensor
    would be a host tensor): a constructor or ``*_like`` given ``device=`` the CPU named in
    the code (``caller``'s source says so), or given no device and no tensor to take one from
    (``sparse_coo_tensor(i, v)`` and ``empty_like(x)`` take their inputs' device,
    ``x.new_tensor`` x's), where no default device takes it
    (:func:`labkit.measure.hostflow.unnamed_is_host`)."""
    fname = getattr(func, "__name__", "")
    made = func in _CONSTRUCTORS or fname in _FROM_DATA or (
        fname.endswith("_like") and kwargs.get("device") is not None)
    if not made:
        return False, False
    if kwargs.get("device") is not None:
        return True, frame_call_device(caller) == "cpu"
    if func in _CONSTRUCTORS and not unnamed_is_host():  # a default device takes it
        return True, False
    return True, not fname.startswith("new_") and not any(
        isinstance(a, torch.Tensor) for a in args)


def moved_to_host(func: Any, args: tuple, kwargs: dict, caller: Any,
                  host: Any) -> bool | None:
    """For a call that moves a tensor (``.to``, ``.cpu()``, ``.cuda()``): whether the result
    is a host tensor on a GPU (``.cpu()``, ``.to("cpu")`` named in the code; ``.to(device)``
    with a variable is the device, ``.to(dtype)`` stays where it was: in ``host``, the
    host tensors known so far, or not); None for other calls."""
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True
    if name == "cuda":
        return False
    if name != "to" or not args or not isinstance(args[0], torch.Tensor):
        return None
    if target_device(args[1:], kwargs) is None:
        return args[0] in host
    return frame_call_device(caller) == "cpu"


class HostMade(TorchFunctionMode):
    """Notes each tensor a capture makes with a constructor given no ``device=``: on a GPU it
    is a host tensor, whatever the CPU rehearsal makes of it."""

    def __init__(self, recorder: Any) -> None:  # the capture's recorder.Recorder
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        while hasattr(func, "labkit_original"):  # torch's method, not labkit's wrapper of it:
            func = func.labkit_original          # one read counts once
        recorder = self.recorder
        cpu_only = checks_on_cpu_only(func, args, kwargs)
        made, host = made_on_host(func, args, kwargs, sys._getframe(1))
        moved = moved_to_host(func, args, kwargs, sys._getframe(1), recorder.host)
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


def maker_in_source(site: str) -> str:
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


class HostWatch(TorchFunctionMode):
    """For the whole rehearsal: notes the host tensors made (by a constructor, or by an op on
    host tensors only) into ``owner.host``, so that a capture knows a CPU step counter made
    before it; and, on a machine without an accelerator, where torch has no pinned allocator,
    gives pageable memory for ``pin_memory=True`` and ``Tensor.pin_memory()``, so that code
    written for a GPU runs."""

    def __init__(self, owner: Any, unpin: bool) -> None:
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
            made, on_host = made_on_host(func, args, kwargs, caller)
            moved = moved_to_host(func, args, kwargs, caller, host)
        if moved is not None:
            on_host = moved
        elif not made:  # an op: on the host if every tensor it takes is
            inputs = [t for t in tensors_of(list(args)) + tensors_of(list(kwargs.values()))]
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
