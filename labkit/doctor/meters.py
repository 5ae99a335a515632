"""What the doctor measures besides time and :func:`labkit.watch`'s counts: the kernels each
optimizer step launches, host reads by call site (device reads apart from host-scalar reads),
memory held and alive, and dynamo's counters; :class:`Measurements` holds one diagnosis'
worth."""
from __future__ import annotations

import gc
import os
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..device import synchronize
from ..measure.profiling import launches
from ..measure.syncmeter import SyncMeter, call_site
from ..stages import Pipeline

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@contextmanager
def step_launches(optimizer: torch.optim.Optimizer) -> Iterator[dict[str, Counter]]:
    """Count, while the block runs, the ops each ``optimizer.step()`` would launch as GPU
    kernels (:func:`labkit.measure.profiling.launches`: non-view ops whose result lives on the
    device, by the sync meter's data flow, so the CPU step counters of a non-fused Adam are
    not launches): ``{"optimizer_step": {call site: calls}, "launch": {aten op: launches}}``.
    The count is the same on the CPU and on a GPU: a per-parameter optimizer launches its ops
    once per parameter, a fused one a few for all of them."""
    found: dict[str, Counter] = {"optimizer_step": Counter(), "launch": Counter()}
    step = optimizer.step  # the instance's bound method (torch's hooks included)

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        out = []
        found["launch"].update(launches(lambda: out.append(step(*args, **kwargs))))
        found["optimizer_step"][call_site(1)] += 1
        return out[0]

    own = vars(optimizer).get("step")  # an LR scheduler may have wrapped it on the instance
    optimizer.step = counted_step
    try:
        yield found
    finally:
        if own is None:
            del optimizer.step  # back to the class's method
        else:
            optimizer.step = own


def metered(pipe: Pipeline) -> tuple[SyncMeter, SyncMeter]:
    """One iteration under the sync meter, with call sites: (rollout meter, learn meter). Each
    tells device reads (a sync on a GPU) from host-scalar reads: by the tensor's device on a
    GPU run, by the data flow on a CPU run, so the counts are the same."""
    with SyncMeter(call_sites=True, device=pipe.device) as m_roll:
        batch = pipe.rollout()
    synchronize(pipe.device)
    with SyncMeter(call_sites=True, device=pipe.device) as m_learn:
        pipe.learn(batch)
    synchronize(pipe.device)
    return m_roll, m_learn


_CONTAINERS = (list, tuple, dict, deque, set)


def _held(obj: Any, depth: int = 3, seen: set | None = None) -> tuple[int, int]:
    """(tensors, bytes) reachable from ``obj`` through containers and labkit objects."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth < 0:
        return 0, 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, _CONTAINERS):
        items = list(obj)
    elif type(obj).__module__.startswith("labkit") and hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return 0, 0
    n = b = 0
    for item in items:
        dn, db = _held(item, depth - 1, seen)
        n, b = n + dn, b + db
    return n, b


def memory_snapshot(pipe: Pipeline) -> dict:
    """Memory at an iteration boundary: live tensors, those each component attribute holds,
    RSS, CUDA allocated."""
    flush = getattr(pipe.logger, "flush", None)
    if flush:
        flush()
    live = sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    parts = {"env": pipe.collector.env, "collector": pipe.collector, "metrics": pipe.metrics,
             "logger": pipe.logger, "model": pipe.agent}
    skip = {id(p) for p in parts.values()} | {id(pipe.collector.clock)}
    held = {f"{slot}.{attr}": _held(value, seen=set(skip))
            for slot, obj in parts.items() for attr, value in vars(obj).items()
            if id(value) not in skip and not attr.startswith("_modules")}
    snap = {"live_tensors": live, "held": held, "rss_mb": rss_mb()}
    if pipe.device.type == "cuda":
        snap["cuda_mb"] = torch.cuda.memory_allocated(pipe.device) / 2**20
    return snap


def rss_mb() -> float | None:
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return None
    return psutil.Process().memory_info().rss / 2**20


def dynamo_state() -> tuple[int, Counter, dict]:
    from torch._dynamo.utils import counters, guard_failures
    return (counters["stats"]["unique_graphs"], Counter(counters["graph_break"]),
            {code: len(reasons) for code, reasons in guard_failures.items()})


@dataclass
class Measurements:
    """What one diagnosis measured: the timed iterations' seconds and phases, memory after
    each step, the metered iteration's host reads (rollout, learn), the function watch, and
    dynamo's counts before and after."""

    times: list[float]
    phases: list[dict]
    snaps: list[dict]
    reads: tuple[SyncMeter, SyncMeter]
    watch: tuple[dict, dict]
    new_graphs: int
    breaks: Counter
    reasons_before: dict
