"""Checkpoints: a pipeline's ``state_dict()`` on disk, written atomically.

What is saved is exactly what warmup and graph capture save and restore (``Pipeline.state_dict``:
model, optimizer, env, collector, metrics, sampling generator, counters), moved to the CPU.
``save(path, payload)`` writes a uniquely named temporary file next to ``path``, flushes and
fsyncs it, then renames it over ``path`` (atomic on POSIX and Windows), so a crash or kill at
any moment leaves either the previous checkpoint or the new one, never a torn file.
``load(path)`` raises :class:`CheckpointError` naming the path when it is missing or unreadable.

Not saved: an fp16 ``GradScaler``'s scale (GPUs without bf16 only), which re-calibrates within a
few steps after a resume, so such a resumed run is not bit-identical.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .capture import tree_map
from .files import atomic_write

FORMAT = 2
FILENAME = "checkpoint.pt"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or not one of ours; the message names the path."""


def to_cpu(obj: Any) -> Any:
    """Host copies of every tensor in ``obj`` (a deliberate sync: only when saving)."""
    return tree_map(lambda t: t.detach().to("cpu", copy=True), obj)


def save(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (tensors moved to the CPU) to ``path`` atomically."""
    with atomic_write(path, "wb") as f:
        torch.save({"format": FORMAT, **to_cpu(payload)}, f)
    return Path(path)


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (tensors on the CPU). Raises
    :class:`CheckpointError` naming ``path`` if it is missing, truncated, corrupt or of
    another format."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path} (truncated or corrupt?): "
                              f"{type(err).__name__}: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is not a labkit checkpoint of format {FORMAT} "
                              f"(found {found!r})")
    return payload
