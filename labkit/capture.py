"""One snapshot/restore for everything that must run work and then undo it.

A pipeline's whole state is one ``state_dict()`` (PureJaxRL's ``runner_state``). Three things
run real work they must take back, and all three use it:

* ``warmup(pipeline)``: one iteration off the clock (compilation, graph capture, allocator and
  cuDNN warmup happen there), then the state from before it (and a stage that compiles only
  where it pays times eager against compiled, each of those iterations undone too);
* ``CapturedStep``: a CUDA graph is captured after a few warmup calls on a side stream (as
  torch's docs require), which really train and really step the envs;
* checkpoints (``labkit.app.checkpoint``) save and load the same dict.

Restores write *in place*: compiled code and captured graphs hold the very tensors (parameters,
optimizer moments, the LR, env state, rollout buffers), so a restore copies values into them
instead of replacing them.

A replay dispatches no op, so a count of launches sees one graph launch where the GPU runs
every kernel the graph holds: a harness that counts kernels asks each capture to count its
graph's (``counting_nodes``), and listens to the replays (``listening``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from .device import synchronize
from .timing import timed

WARMUP_CALLS = 3


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in nested dicts, lists, tuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: tree_map(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` in ``tree_map`` order."""
    found: list[torch.Tensor] = []
    tree_map(found.append, obj)
    return found


def clone_state(obj: Any) -> Any:
    """Detached copies of every tensor in ``obj`` (on the same device: no host read)."""
    return tree_map(lambda t: t.detach().clone(), obj)


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def warmup(pipeline) -> float:
    """Run one iteration of ``pipeline`` off the clock, then restore the state from before it;
    return its seconds (synchronized). Compilation, graph capture and cuDNN autotuning happen
    here, and the timed iterations compute what an un-warmed run would. Then a stage that
    compiles only where it pays times eager against compiled, and its convolutions' two ways
    (``pipeline.math.choose``, also off the clock and undone); what it keeps may compute
    within float rounding of the un-warmed run, not bit for bit."""
    saved = pipeline.state_dict()
    elapsed, _ = timed(pipeline.iteration, pipeline.device)
    pipeline.load_state_dict(saved)
    pipeline.math.choose(pipeline)
    return elapsed


def timed_phases(pipeline) -> dict[str, float]:
    """Milliseconds per phase of one ``pipeline.iteration()`` (its ``PhaseClock``)."""
    pipeline.clock.start()
    pipeline.iteration()
    synchronize(pipeline.device)
    return pipeline.clock.stop()


def side_stream_warmup(fn: Callable[[], object], calls: int = WARMUP_CALLS) -> None:
    """Call ``fn`` a few times on a side stream before capturing it (torch's recipe: lazy
    initialization, autotuning and allocator growth must not happen inside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), warnings.catch_warnings():
        # These calls step a capturable optimizer outside the capture on purpose (torch's own
        # recipe); torch's warning about that is meant for optimizers that are never captured.
        warnings.filterwarnings("ignore", message="This instance was constructed with "
                                                  "capturable=True")
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


#: What counts the kernels a capture puts in its graph: a harness sets it around a warm-up
#: (:func:`counting_nodes`; :mod:`labkit.measure.bench` uses its launch count), so that each
#: capture made there keeps the kernels its graph holds; None: captures count nothing.
_node_counter: ContextVar[Callable[[], Any] | None] = ContextVar("node_counter", default=None)
#: Per thread: the kernel counts told of each replay (``replayed(nodes)``), and whether a
#: replay runs (a stand-in replay that dispatches its ops, as the rehearsal's does, launches
#: none of its own: a GPU's replay is one graph launch).
_replays = threading.local()


@contextlib.contextmanager
def counting_nodes(counter: Callable[[], Any]) -> Iterator[None]:
    """Inside, each capture runs under ``counter()`` (a context manager whose value has a
    ``counts`` Counter of kernels launched, as :class:`labkit.measure.profiling.LaunchCount`):
    the graph keeps those counts, its nodes, and tells them to the counts listening at each
    replay (:func:`listening`)."""
    token = _node_counter.set(counter)
    try:
        yield
    finally:
        _node_counter.reset(token)


@contextlib.contextmanager
def listening(count: Any) -> Iterator[None]:
    """Inside, ``count.replayed(nodes)`` is called after each replay of a captured step in
    this thread (``nodes``: the kernels its graph holds, None where its capture was not
    counted)."""
    listeners = _replays.__dict__.setdefault("listeners", [])
    listeners.append(count)
    try:
        yield
    finally:
        listeners.remove(count)


class _Uncounted:
    counts = None


@contextlib.contextmanager
def _counted() -> Iterator[Any]:
    """The harness's count of the kernels a capture records (:func:`counting_nodes`), as a
    Counter in ``counts`` once the block ends; ``counts`` None where none counts."""
    counter = _node_counter.get()
    if counter is None:
        yield _Uncounted()
        return
    with counter() as count:
        yield count


def replaying() -> bool:
    """Whether a captured step's replay runs in this thread now."""
    return getattr(_replays, "on", False)


def _replay(graph: Any, nodes: Counter | None) -> None:
    """``graph.replay()``, told to the counts listening in this thread (see :func:`listening`)."""
    _replays.on = True
    try:
        graph.replay()
    finally:
        _replays.on = False
    for count in getattr(_replays, "listeners", ()):
        count.replayed(nodes)


def _copy_(dst: Any, src: Any) -> None:
    for d, s in zip(tree_tensors(dst), tree_tensors(src), strict=True):
        if d.shape != s.shape:  # copy_ would broadcast a wrong shape silently
            raise ValueError(f"a captured step takes inputs of shape {tuple(d.shape)}, got "
                             f"{tuple(s.shape)}: shapes must stay static")
        d.copy_(s)


class CapturedStep:
    """Run ``step(*args)`` as a CUDA graph.

    The first call warms ``step`` up on a side stream on static copies of its tensor arguments,
    restores ``state`` (everything the warmup calls changed: a ``Stateful`` such as the
    pipeline), and captures one call. Each call then copies its arguments into the static
    copies and replays: one launch for the whole step. Outputs are cloned, since the next replay
    overwrites them. The capture is what makes the rules binding: static shapes, state updated
    in place, no host reads, random numbers from the registered ``generator``.
    """

    def __init__(self, step: Callable[..., Any], state: Stateful,
                 generator: torch.Generator | None = None,
                 after_replay: Callable[[], None] | None = None) -> None:
        self.step, self.state, self.generator = step, state, generator
        self.after_replay = after_replay
        self.graph: torch.cuda.CUDAGraph | None = None
        self.nodes: Counter | None = None  # its kernels, where counted (counting_nodes)

    def _capture(self, args: tuple) -> None:
        self.static = clone_state(args)
        saved = self.state.state_dict()
        side_stream_warmup(lambda: self.step(*self.static))
        self.state.load_state_dict(saved)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        # thread_local: the async logger's writer thread may touch CUDA during the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"), _counted() as nodes:
            self.out = self.step(*self.static)
        self.nodes, self.graph = nodes.counts, graph

    def __call__(self, *args: Any) -> Any:
        if self.graph is None:
            self._capture(args)
        _copy_(self.static, args)
        _replay(self.graph, self.nodes)
        if self.after_replay is not None:
            self.after_replay()
        return clone_state(self.out)
