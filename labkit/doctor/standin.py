"""The CPU stand-ins for ``torch.cuda``'s calls that graph code makes, which the rehearsal
context (:class:`labkit.doctor.graphs_on_cpu.rehearsal`) puts in place: streams and events
(one stream, nothing to order; a synchronize inside a capture is a problem, as it ends a real
one), the seeding calls (a problem inside a capture), torch's capture health check of an
optimizer's ``step()`` and the devices a ``capturable=True`` optimizer accepts (the CPU among
them), and ``GradScaler.step`` (a CUDA scaler's host read); plus the profile hook that sees a
host random draw inside a capture. The graph itself is :class:`labkit.doctor.recorder.Graph`.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..measure.syncmeter import short_path, stands_in
from .kinds import CAUSES, KINDS, Finding

stands_in(__file__)  # a problem's line is the caller's, never a stand-in's


class Stream:
    """Stands in for ``torch.cuda.Stream``: one stream, so nothing to order; a synchronize
    inside a capture is a problem, as it ends a real one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        synchronized("Stream.synchronize()")

    def record_event(self, event: Any = None) -> Any:
        return event


class Event:
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
        synchronized("Event.synchronize()")

    def elapsed_time(self, end: Any) -> float:
        synchronized("Event.elapsed_time()")
        return 0.0


#: What a rehearsal stands in for, for a stage's ``requires``: a pipeline built inside one
#: (``Pipeline(stage, cfg, "cpu", assume=REHEARSED)``) runs in the CPU's precision (fp32 on
#: a CPU without bf16 instructions) where a GPU runs bf16 on CUDA.
REHEARSED = ("cuda", "bf16")
#: The rehearsals entered, innermost last.
ACTIVE: list = []  # graphs_on_cpu.rehearsal contexts


def synchronized(what: str) -> None:
    """A synchronize call: a problem if it happens inside a rehearsed capture."""
    recorder = ACTIVE[-1].recorder if ACTIVE else None
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
def host_random(recorder: Any) -> Iterator[None]:  # the capture's recorder.Recorder
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


def seeded(name: str, original: Callable) -> Callable:
    """``torch.cuda.manual_seed``'s stand-in: a problem inside a capture, then the original."""
    def seed(value: int) -> None:
        recorder = ACTIVE[-1].recorder if ACTIVE else None
        if recorder is not None:
            recorder._problem("seed", f"{name}({value}): {KINDS['seed'].means}")
        original(value)
    return seed


def scaler_step(original: Callable) -> Callable:
    """``GradScaler.step``'s stand-in: a scaler made for CUDA (disabled by torch where CUDA is
    missing) reads ``found_inf`` with ``.item()`` before it steps an optimizer that cannot take
    the scale on the device (torch/amp/grad_scaler.py ``_maybe_opt_step``; a fused optimizer's
    ``_step_supports_amp_scaling`` skips it): a problem inside a capture."""
    def step(self, optimizer, *args, **kwargs):
        recorder = ACTIVE[-1].recorder if ACTIVE else None
        if recorder is not None and str(getattr(self, "_device", "")) == "cuda" \
                and id(self) not in ACTIVE[-1].disabled_scalers \
                and not getattr(optimizer, "_step_supports_amp_scaling", False):
            recorder._problem("device_read", CAUSES["scaler"])
        return original(self, optimizer, *args, **kwargs)
    return step


def _capture_health_check(optimizer: torch.optim.Optimizer) -> None:
    """torch's check at the start of a capturable optimizer's ``step()``
    (``Optimizer._accelerator_graph_capture_health_check``, which returns at once without an
    accelerator): inside a capture every param group must be ``capturable``."""
    recorder = ACTIVE[-1].recorder if ACTIVE else None
    if recorder is not None and not all(g.get("capturable", False)
                                        for g in optimizer.param_groups):
        recorder._problem("optimizer", f"{type(optimizer).__name__}: {KINDS['optimizer'].means}")


def optimizer_stand_ins() -> list[tuple[Any, str, Any]]:
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
