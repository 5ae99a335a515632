"""Diagnosis: what regressed in a training loop, and where.

* ``checkup``: :func:`diagnose` runs a stage (or your pipeline) a few iterations under the
  meters (``meters``), judges what they measured (``findings``) and reports each regression
  with its evidence and the chapter that fixes it (``report``);
* ``plants``: the regressions the chapters plant on purpose, each from a real report;
* ``rehearsal``: a CUDA-graph capture rehearsed on the CPU (``labkit.rehearse``).
"""
from __future__ import annotations

from .checkup import DOCTOR_RUN, diagnose
from .findings import without_graphs
from .report import KINDS, Finding, Report

__all__ = ["DOCTOR_RUN", "KINDS", "Finding", "Report", "diagnose", "without_graphs"]
