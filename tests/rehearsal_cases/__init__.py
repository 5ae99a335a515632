"""Issue 37's case set for ``labkit.rehearse``: small steps written in the style of RL and
training code, each with the verdict a real ``torch.cuda.graph`` capture gives it (from torch's
source at 2.13.0 or the CUDA-graph docs), the line a report must name, and its source.

``CASES`` holds them (registry.py has the record and the rules); check.py runs one through the
rehearsal and names its outcome; known.py holds the outcomes that were not ``agree`` when the
set was committed; ``python -m tests.rehearsal_cases`` (from the repo root) prints the counts
by class. The cases live in one module per class of the issue, and call the modules of
nets.py and the helpers of helpers.py for their "inside a method" and "inside a helper from
another file" variants.
"""
from . import (  # noqa: F401 - importing a module registers its cases
    clean,
    crash_inputs,
    frozen,
    host_memory,
    kernel_sync,
    messages,
    optimizer,
    silent,
    streams,
)
from .registry import CASES, CLASSES, QUOTED, VARIANTS, VERDICTS, Case

__all__ = ["CASES", "CLASSES", "QUOTED", "VARIANTS", "VERDICTS", "Case"]
