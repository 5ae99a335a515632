"""Diagnosis: what regressed in a training loop, and where; three instruments and their parts.

* ``checkup``: :func:`diagnose` runs a stage (or your pipeline) a few iterations under the
  meters and reports each regression with its evidence and the chapter that fixes it;
* ``meters``: what the doctor measures besides time and ``watch``'s counts (each optimizer
  step's kernels, host reads by site, memory, dynamo's state);
* ``kinds``: the one vocabulary, :class:`Finding` and the kinds table every instrument reports
  with; ``findings``: how the doctor judges what it measured; ``report``: its report;
* ``plants``: the regressions the chapters plant on purpose, each from a real report;
* ``watch``: ``labkit.watch``, the same kind of meters around any PyTorch code;
* ``rehearsal``: a CUDA-graph capture rehearsed on the CPU (``labkit.rehearse``) in the
  context of ``graphs_on_cpu``, with ``standin`` (the ``torch.cuda`` stand-ins), ``recorder``
  (what a capture records, how a replay runs it), ``hostmade`` (which tensors are host
  tensors), ``origins`` (where a step's tensors were made), ``frozen`` (what a capture
  freezes) and ``kernel_syncs`` (the kernels that read the device from inside).
"""
from __future__ import annotations

from ..stages import without_graphs
from .checkup import DOCTOR_RUN, diagnose
from .kinds import KINDS, Finding
from .report import Report

__all__ = ["DOCTOR_RUN", "KINDS", "Finding", "Report", "diagnose", "without_graphs"]
