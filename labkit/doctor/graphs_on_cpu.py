"""The rehearsal context: inside ``with rehearsal():``, ``torch.cuda``'s graph API captures and
replays on the CPU, with a graph's semantics (:mod:`labkit.doctor.recorder`), the stand-ins of
:mod:`labkit.doctor.standin` in place and the host tensors followed
(:mod:`labkit.doctor.hostmade`). :func:`labkit.doctor.rehearsal.rehearse` judges a step in it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..measure.syncmeter import SyncMeter, stands_in, wraps_method
from ..stages import assuming
from .hostmade import HostMade, HostWatch
from .kinds import KINDS, Finding
from .recorder import CaptureError, Graph, Recorder
from .standin import (
    ACTIVE,
    REHEARSED,
    Event,
    Stream,
    host_random,
    optimizer_stand_ins,
    scaler_step,
    seeded,
    synchronized,
)

stands_in(__file__)  # a problem's line is the caller's, never the context's


class rehearsal:  # noqa: N801 - used like torch's context managers
    """Inside, ``torch.cuda``'s graph API captures and replays on the CPU: the few calls graph
    code makes (``CUDAGraph``, ``graph``, ``Stream``, ``stream``, ``current_stream``,
    ``synchronize``, ``is_current_stream_capturing``) are stood in for
    (:mod:`labkit.doctor.standin`, :class:`labkit.doctor.recorder.Graph`), so that
    ``labkit.capture.CapturedStep``, stage 8, the recipe's graph step and a reader's own capture
    code run as they are. ``problems`` collects what every capture inside found (a host read,
    as the sync meter counts it, with every tensor standing for a device tensor; and what the
    recorder and the host rules of :mod:`labkit.doctor.hostmade` find), ``graphs`` every graph
    made. ``strict``: raise :class:`CaptureError` at the end of a capture that found any, as a
    real capture would have failed; ``strict=False`` collects them.

    Compiled functions run eagerly inside (``torch.compiler.set_stance("force_eager")``): a
    dispatch mode and ``fullgraph=True`` compiled code do not mix. So a rehearsed stage 8 equals
    stage 7 run eagerly bit for bit, and compiled stage 7 within the tolerance the tests state.
    Stages that need CUDA or bf16 are built on the CPU inside (``stages.assuming(REHEARSED)``):
    the rehearsal runs in the CPU's precision (bf16 where it has bf16 instructions, fp32
    elsewhere, where a GPU runs bf16), and a ``capturable=True`` optimizer as on a GPU."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.problems: list[Finding] = []
        self.graphs: list[Graph] = []
        self.capturing = False
        self.recorder: Recorder | None = None  # the capture's, while one runs
        # tensor -> where it was made on the host: from the start of the outermost rehearsal
        self.host = ACTIVE[-1].host if ACTIVE else WeakTensorKeyDictionary()
        #: the host tensors made in pinned memory (pageable here where there is no GPU)
        self.pinned = ACTIVE[-1].pinned if ACTIVE else WeakTensorKeyDictionary()
        self.disabled_scalers: set[int] = set()  # GradScalers the code made disabled
        self.in_read = False
        self._stack = contextlib.ExitStack()

    # ------------------------------------------------------------------ torch.cuda's calls

    def _graph_class(self) -> type:
        owner = self

        class CUDAGraph(Graph):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__()
                owner.graphs.append(self)

        return CUDAGraph

    @contextlib.contextmanager
    def _graph(self, cuda_graph: Graph, pool: Any = None, stream: Any = None,
               capture_error_mode: str = "global") -> Iterator[None]:
        if self.capturing:
            raise RuntimeError("a capture inside a capture: CUDA graphs do not nest")
        recorder = Recorder(cuda_graph, self)
        meter = SyncMeter(call_sites=True, cpu_as_device=True)
        self.capturing, self.recorder = True, recorder
        try:
            with meter, HostMade(recorder), recorder, host_random(recorder):
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
        return {"CUDAGraph": self._graph_class(), "graph": self._graph, "Stream": Stream,
                "stream": lambda stream=None: contextlib.nullcontext(),
                "current_stream": lambda device=None: Stream(),
                "synchronize": lambda device=None: synchronized("torch.cuda.synchronize()"),
                "is_current_stream_capturing": lambda: self.capturing,
                "Event": Event, "current_device": lambda: 0,
                "default_stream": lambda device=None: Stream(),
                # torch.manual_seed and torch.random.manual_seed reach these two
                "manual_seed": seeded("torch.cuda.manual_seed", torch.cuda.manual_seed),
                "manual_seed_all": seeded("torch.cuda.manual_seed_all",
                                           torch.cuda.manual_seed_all)}

    # ------------------------------------------------------------------ enter / exit

    def __enter__(self) -> rehearsal:
        owner = ACTIVE[0].thread if ACTIVE else None
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
                                             synchronized("torch.accelerator.synchronize()")))
            # pinned memory needs an accelerator's allocator
            stack.enter_context(HostWatch(self, unpin=not torch.cuda.is_available()))
            for owner, name, value in optimizer_stand_ins():
                stack.enter_context(_patched(owner, name, value))
            for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
                if hasattr(torch.cuda.nvtx, name):  # profiler annotations: nothing to check
                    stack.enter_context(_patched(torch.cuda.nvtx, name,
                                                 lambda *args, **kwargs: 0))
            scaler = torch.amp.GradScaler
            stack.enter_context(_patched(scaler, "step", scaler_step(scaler.step)))
            stack.enter_context(assuming(REHEARSED))
            ACTIVE.append(self)
            stack.callback(ACTIVE.remove, self)
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
