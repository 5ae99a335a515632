"""The kernels a ``torch.compile``'d region launches, counted as it runs.

An aten-level count (a ``TorchDispatchMode`` that compiled code is allowed to run under) sees
only what a compiled graph calls out to: ``extern_kernels.mm``, ``addmm``. The kernels inductor
generated itself (``cpp_fused_*`` on the CPU, ``triton_*`` on a GPU) are not aten ops, so a
compiled stage would look launch-free. Each compiled graph carries the source of the wrapper
inductor wrote (``CompiledFxGraph.source_code``): its ``call`` function launches each generated
kernel at fixed places, with no branches. :func:`generated_launches` reads them once per graph;
:class:`compiled_kernels` counts each graph's calls while active (the one patch it makes, of
``CompiledFxGraph.__call__``, restored on exit also when the block raises), and so the kernels
launched. A graph that CUDA graphs replay launches the same kernels as one graph launch; a
graph with control flow (``torch.cond``) counts each branch's kernels. Only the thread that
entered counts, as the sync meter's reads do, and the threads where autograd runs a backward
(a GPU's backward runs in autograd's own thread for that device).
"""
from __future__ import annotations

import functools
import re
import threading
from collections import Counter

import torch

#: a generated kernel defined in the wrapper: ``name = async_compile.cpp_pybinding(`` /
#: ``async_compile.triton(`` / ``async_compile.cpp(``
_DEFINED = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
_lock = threading.Lock()


@functools.lru_cache(maxsize=512)
def generated_launches(source: str) -> tuple[str, ...]:
    """The generated kernels one call of an inductor wrapper module launches, in order, by
    name: each call of a kernel the module defines (``cpp_fused_add_0(buf0, ...)``,
    ``triton_poi_fused_0.run(...)``) in its Python code, the kernels' own sources (the
    triple-quoted strings) left out. The wrapper's code has no branches: its ``call`` (and the
    partitions it calls, once each) launch each kernel written there once per call."""
    names = set(_DEFINED.findall(source))
    if not names:
        return ()
    code = re.sub(r"(?s)\'{3}.*?\'{3}|\"{3}.*?\"{3}", "", source)
    code = re.sub(r"#[^\n]*", "", code)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names)))
                         + r")(?:\.run)?\(")
    return tuple(m.group(1) for m in pattern.finditer(code))


def _kernels(graph: object) -> tuple[str, ...]:
    return generated_launches(getattr(graph, "source_code", "") or "")


class compiled_kernels:  # noqa: N801 - a context manager
    """Count the generated kernels compiled graphs launch in this block: ``counts`` (kernel
    kind, e.g. ``cpp_fused_mean_pow``, the trailing index dropped: launches) and ``graphs``
    (compiled graph calls). Blocks nest (each counts what ran inside it)."""

    _active: list[compiled_kernels] = []
    _original = None

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.graphs = 0
        self._thread = threading.get_ident()

    @property
    def launches(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> compiled_kernels:
        graph_class = _graph_class()
        self._thread = threading.get_ident()
        with _lock:
            if not compiled_kernels._active and graph_class is not None:
                CompiledFxGraph = graph_class  # noqa: N806 - torch's class
                original = compiled_kernels._original = CompiledFxGraph.__call__

                def counted(graph, inputs):
                    backward = _in_backward()
                    for meter in compiled_kernels._active:
                        if backward or meter._thread == threading.get_ident():
                            meter.graphs += 1
                            meter.counts.update(_kind(k) for k in _kernels(graph))
                    return original(graph, inputs)

                CompiledFxGraph.__call__ = counted
            compiled_kernels._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            compiled_kernels._active.remove(self)
            if not compiled_kernels._active and compiled_kernels._original is not None:
                _graph_class().__call__ = compiled_kernels._original
                compiled_kernels._original = None


def _graph_class() -> type | None:
    """inductor's compiled graph (``torch._inductor.output_code.CompiledFxGraph`` since torch
    2.6); None where a torch has none, and then nothing is counted (nor patched)."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None
    return CompiledFxGraph


def _in_backward() -> bool:
    """Is this thread running a backward pass? On a GPU autograd runs a backward in its own
    thread per device, not the thread that called ``backward()``: a compiled backward graph is
    called there (an H200, torch 2.11: only the forward graphs were counted)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _kind(kernel: str) -> str:
    """``cpp_fused_mean_pow_1`` -> ``cpp_fused_mean_pow``: one kind for a graph's numbered
    kernels and the same fusion in another graph."""
    return re.sub(r"_\d+$", "", kernel)
