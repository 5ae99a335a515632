"""The chapters as a GPU executed them, kept beside the CPU chapters that nbval checks.

``python -m labkit record --device cuda --part notebook-NN`` executes chapter NN from
``notebooks/`` (its relative paths as they are there) and writes what it showed to
``results/chapters_cuda/NN_name.ipynb``, stamped with the device, torch and commit: the CPU
chapter stays as CI compares it, device-independent. The book (:mod:`labkit.book.site`) builds a
chapter's page from the CPU chapter's cells with each code cell's outputs taken from its GPU
copy, where the copy is **current**: its code cells are the chapter's, one for one, so every
output is what that very code printed on the GPU. A copy whose code differs is **stale**: the
page shows the CPU outputs and says the GPU copy is stale and when it was recorded, never
showing its outputs as the chapter's.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Where ``record`` keeps the chapters a GPU executed (results, as every GPU record).
GPU_COPIES = ROOT / "results" / "chapters_cuda"


def code_cells(nb: dict) -> list[str]:
    """The sources of a notebook's code cells, in order."""
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "code"]


@dataclass
class GpuCopy:
    """A chapter's GPU copy: the notebook, whether it is current, and its stamp."""

    nb: dict
    current: bool
    stamp: dict

    def label(self) -> str:
        """Where its outputs were recorded, from its stamp (what ``record`` wrote there)."""
        s = self.stamp
        return (f"{s.get('device_name', '?')} ({s.get('device', '?')}), torch "
                f"{s.get('torch', '?')}, at commit {str(s.get('git_commit', '?'))[:10]}, "
                f"{str(s.get('date', '?'))[:10]}")


def gpu_copy(chapter: dict, path: Path) -> GpuCopy | None:
    """The GPU copy of ``chapter`` at ``path`` (None where there is none), current where its
    code cells are the chapter's."""
    import nbformat

    if not path.exists():
        return None
    nb = nbformat.read(path, as_version=4)
    stamp = dict(nb.metadata.get("labkit") or {})
    return GpuCopy(nb, code_cells(nb) == code_cells(chapter) and stamp.get("device") == "cuda",
                   stamp)


def with_gpu_outputs(chapter: dict, copy: GpuCopy) -> dict:
    """``chapter`` with every code cell's outputs (and execution count) its current GPU
    copy's: the prose is the chapter's as it stands, the outputs what its code printed on
    the GPU. The stamp is the copy's."""
    import copy as copying

    if not copy.current:
        raise ValueError("a stale GPU copy's outputs belong to other code: not shown")
    merged = copying.deepcopy(chapter)
    theirs = [c for c in copy.nb["cells"] if c["cell_type"] == "code"]
    for cell, gpu in zip([c for c in merged["cells"] if c["cell_type"] == "code"], theirs,
                         strict=True):
        cell["outputs"] = copying.deepcopy(gpu.get("outputs", []))
        cell["execution_count"] = gpu.get("execution_count")
    merged["metadata"]["labkit"] = dict(copy.stamp)
    return merged


def shown(chapter: dict, copy: GpuCopy | None) -> dict:
    """The notebook a chapter's page shows: with its current GPU copy's outputs, else as it
    is stored."""
    return with_gpu_outputs(chapter, copy) if copy is not None and copy.current else chapter


def provenance(chapter: dict, copy: GpuCopy | None) -> str:
    """The line a page starts with (HTML): where the outputs it shows were recorded, and what
    became of the chapter's GPU copy."""
    stamp = (copy.stamp if copy is not None and copy.current
             else chapter.get("metadata", {}).get("labkit")) or {}
    if copy is not None and copy.current:
        line = (f"Outputs recorded on a GPU, {html.escape(copy.label())}, by <code>python -m "
                "labkit record --device cuda</code>; the CPU outputs CI checks are in the "
                "chapter's notebook.")
    elif not stamp:
        line = "Outputs as stored in the notebook (not stamped by labkit record)."
    else:
        line = (f"Outputs recorded on {html.escape(str(stamp.get('device', '?')))} by "
                f"<code>python -m labkit record</code> at commit "
                f"{html.escape(str(stamp.get('git_commit', '?'))[:10])}, "
                f"{html.escape(str(stamp.get('date', '?'))[:10])}.")
    if copy is not None and not copy.current:
        why = ("the chapter's code changed since" if copy.stamp.get("device") == "cuda"
               else "it is not stamped as a GPU's run")
        line += (f" Its GPU copy ({html.escape(copy.label())}) is stale: {why}, so its "
                 "outputs are not shown.")
    return line
