"""The case record, the ``@case`` decorator that registers one, and the issue's quoted examples.

A case is a factory: called, it builds a fresh step function and its arguments (new tensors,
new modules, new optimizers every time). Its expected verdict is what a real
``torch.cuda.graph`` capture on a GPU does with the step (warm-up calls, one capture, replays),
taken from torch's source at 2.13.0 or its docs, with the reason in ``source``:

* ``capturable``: the capture succeeds and every replay computes what an eager call would;
* ``refused``: the capture raises (a host sync, a forbidden call, a health check);
* ``replays_differ``: the capture succeeds, but replays compute something other than eager
  calls would (a Python value, a CPU op or a tensor binding frozen at capture).

A case that is not ``capturable`` marks the one line a report must name with a trailing
``# HAZARD`` comment, in the function given as ``hazard`` (a module's method, a helper in
another file) or, by default, in the factory itself. Device tensors are made with
``device=DEVICE`` (``cuda`` where there is one) and host tensors with ``device="cpu"``, so that
the code says on a CPU what it would be on a GPU. The outcomes in known.py are those of a
CPU-only torch, where ``DEVICE`` is the CPU.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: The issue's classes (issue 37): 1 kernel_sync, 2 optimizer, 3 frozen_value, 4 stream_sync,
#: 5 host_memory, 6 clean (false alarms on clean code, with their hazardous twins),
#: 7 crash_input, 8 message, and the silent failures users report. A class holds the clean
#: counterparts of its hazards too: the verdict, not the class, says whether a case is clean.
CLASSES = ("kernel_sync", "optimizer", "frozen_value", "stream_sync", "host_memory", "clean",
           "crash_input", "message", "silent")
VERDICTS = ("capturable", "refused", "replays_differ")
#: Another spelling, inside a module's method, inside a helper from another file; ``quoted``
#: is the issue's own example (or the plain form), ``other`` a case outside any family.
VARIANTS = ("quoted", "spelling", "method", "helper", "other")

#: Every example the issue quotes, by family: each needs at least three variants, among them a
#: spelling, a method and a helper.
QUOTED: dict[str, str] = {
    "linalg_inv": "torch.linalg.inv (its error check reads info on the host)",
    "linalg_solve": "torch.linalg.solve",
    "linalg_cholesky": "torch.linalg.cholesky",
    "histc_default_range": "torch.histc with its default range (reads min and max)",
    "multinomial": "torch.multinomial captures cleanly (device-side asserts)",
    "categorical_unvalidated": "Categorical(..., validate_args=False).sample() captures",
    "categorical_validated": "a default Categorical syncs in its argument validation",
    "fused_adam_not_capturable": "Adam(fused=True) with capturable=False",
    "capturable_adam": "Adam(foreach=True, capturable=True): rehearse it, do not crash",
    "python_int_index": "buf[t[0]] = x; t[0] += 1",
    "python_float_lr": "a Python-float learning-rate schedule",
    "rebound_state": "state rebound to a new tensor each call",
    "python_random_branch": "a random.random() branch",
    "manual_seed_in_step": "torch.manual_seed(k) inside the step",
    "cuda_synchronize": "torch.cuda.synchronize()",
    "stream_synchronize": "current_stream().synchronize()",
    "d2h_into_pageable": "host = torch.empty(4); host.copy_(x.sum(0))",
    "cpu_step_counter": "a CPU step counter made before the capture",
    "cpu_lr_tensor": "a CPU learning-rate tensor made before the capture",
    "one_hot_num_classes": "F.one_hot(a, num_classes=5) is clean",
    "one_hot_inferred": "one_hot without num_classes (its hazardous twin)",
    "mask_fill_scalar": "y[y < 0] = 0.0 is clean",
    "cpu_scalar_tensor": "x * torch.tensor(0.5) is clean (a 0-d CPU scalar)",
    "repeat_interleave_output_size": "repeat_interleave(..., output_size=8) is clean",
    "repeat_interleave_inferred": "repeat_interleave without output_size (its twin)",
    "portable_to_device": "obs.to(device), device = 'cuda' if ... else 'cpu', is clean",
    "fused_host_lr": "Adam(fused=True, capturable=True) given a tensor lr on the host",
    "log_unless_capturing": "a host read skipped under is_current_stream_capturing() is clean",
    "to_cpu": ".to('cpu') of a device tensor (its twin)",
    "static_int_output": "return y, x.shape[0] is clean",
    "lstm_autograd": "nn.LSTM forward with autograd",
    "inference_mode": "an inference_mode step",
    "sparse_coo": "sparse COO tensors",
    "nested_tensor": "nested tensors",
    "from_numpy": "torch.from_numpy inside the step: name it",
    "as_tensor": "torch.as_tensor inside the step: name it",
    "new_tensor": "x.new_tensor inside the step: name it",
    "mask_assign_tensor": "x[mask] = tensor_values: name the mask assignment",
    "zero_d_index": "a 0-d tensor index: say it is an .item()",
    "python_shape": "a shape problem names the output that changed",
    "frozen_rng": "random numbers frozen into a graph",
    "output_overwritten": "graph outputs read after the next replay overwrote them",
    "eager_fallback": "a step whose capture never happened (a fallback to eager)",
}

_MARKER = re.compile(r"#\s*HAZARD\s*$")

Build = Callable[[], tuple[Callable[..., Any], tuple]]


@dataclass(frozen=True)
class Case:
    """One step with its expected real-capture verdict (see the module docstring)."""

    id: str
    issue_class: str
    expect: str
    source: str
    build: Build = field(repr=False)
    family: str = ""
    variant: str = "other"
    hazard: Callable[..., Any] | None = field(default=None, repr=False)
    says: tuple[str, ...] = ()
    unsure: str = ""

    def marked(self) -> tuple[str, list[int]]:
        """The file and the line numbers of the ``# HAZARD`` markers in the hazard function
        (the factory where no other is named)."""
        obj = inspect.unwrap(self.hazard if self.hazard is not None else self.build)
        lines, start = inspect.getsourcelines(obj)
        found = [start + i for i, text in enumerate(lines) if _MARKER.search(text.rstrip())]
        return inspect.getsourcefile(obj) or "", found

    def hazard_site(self) -> tuple[str, int] | None:
        """``(file, line)`` of the hazard a report must name; None for a capturable case."""
        if self.expect == "capturable":
            return None
        path, lines = self.marked()
        if len(lines) != 1:
            raise ValueError(f"{self.id}: {len(lines)} '# HAZARD' markers, expected one")
        return path, lines[0]


CASES: list[Case] = []


def case(id: str, issue_class: str, expect: str, source: str, *, family: str = "",
         variant: str = "other", hazard: Callable[..., Any] | None = None,
         says: tuple[str, ...] = (), unsure: str = "") -> Callable[[Build], Build]:
    """Register the decorated factory as a case."""
    if issue_class not in CLASSES or expect not in VERDICTS or variant not in VARIANTS:
        raise ValueError(f"{id}: bad class, verdict or variant")

    def register(build: Build) -> Build:
        CASES.append(Case(id, issue_class, expect, source, build, family, variant, hazard,
                          says, unsure))
        return build

    return register
