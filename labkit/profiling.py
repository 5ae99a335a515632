"""``torch.profiler`` made short: profile a few calls, read the top ops and op counts."""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from .device import synchronize


def profile_calls(fn: Callable[[], object], device: torch.device, calls: int = 1,
                  **kwargs) -> profile:
    """Run ``fn`` ``calls`` times under ``torch.profiler`` (CPU, and CUDA kernels on a GPU);
    warm ``fn`` up first yourself: the first call's compilation is not what you want to read.
    ``kwargs`` go to ``torch.profiler.profile`` (e.g. ``record_shapes=True``)."""
    # Kineto prints "profiler_start/stop" lines to stderr at its default log level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, **kwargs) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    return prof


def _self_us(event, device: torch.device) -> float:
    if device.type == "cuda":
        return getattr(event, "self_device_time_total", 0.0)
    return event.self_cpu_time_total


def top_ops(prof: profile, device: torch.device, n: int = 10, per: int = 1) -> str:
    """The ``n`` ops with the most self time (CUDA kernels' time on a GPU, CPU time
    otherwise), with their call counts; ``per`` divides counts and times (e.g. by calls)."""
    events = [e for e in prof.key_averages() if _self_us(e, device) > 0]
    events.sort(key=lambda e: -_self_us(e, device))
    total = sum(_self_us(e, device) for e in events) or 1.0
    where = "CUDA" if device.type == "cuda" else "CPU"
    lines = [f"{'op':<40} {'calls':>8} {'self ' + where + ' ms':>13} {'share':>6}"]
    for e in events[:n]:
        lines.append(f"{e.key[:40]:<40} {e.count / per:>8g} "
                     f"{_self_us(e, device) / 1e3 / per:>13.3f} "
                     f"{100 * _self_us(e, device) / total:>5.1f}%")
    return "\n".join(lines)


def op_counts(prof: profile, prefix: str = "aten::") -> Counter:
    """How many times each op ran (by name, e.g. ``aten::clone``)."""
    return Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith(prefix)})
