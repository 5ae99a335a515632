"""Checkpoints: everything a training run needs to continue bit-exactly, written atomically.

``capture(pipeline)`` copies the pipeline's state at an iteration boundary (device-side clones,
no host read): model parameters and buffers (PopArt statistics included), optimizer state,
env state, the collector's current observation, done flags and step counter, the sampling
generator, torch's global RNG state and the iteration counter. ``restore(pipeline, state)``
writes it into a freshly built pipeline of the same stage, in place where compiled code or CUDA
graphs hold references (the LR tensor, the collector's buffers).

``save(path, payload)`` writes a temporary file next to ``path``, flushes and fsyncs it, then
renames it over ``path`` (``os.replace``, atomic on POSIX and Windows), so a crash or kill at
any moment leaves either the previous checkpoint or the new one, never a torn file.
``load(path)`` raises :class:`CheckpointError` naming the path when it is missing or unreadable.

Not saved: an fp16 ``GradScaler``'s scale (GPUs without bf16 only), which re-calibrates within a
few steps after a resume, so such a resumed run is not bit-identical.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
FILENAME = "checkpoint.pt"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or not one of ours; the message names the path."""


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested dicts / lists / tuples; copy the containers."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def capture(pipeline) -> dict[str, Any]:
    """The state of ``pipeline`` (a :class:`labkit.stages.Pipeline`) at an iteration boundary.

    Clones on the pipeline's device: no host read, cheap next to an iteration, so the training
    loop can keep the last boundary's state and save it when interrupted mid-iteration."""
    collector, device = pipeline.collector, pipeline.device
    return {
        "agent": _map_tensors(pipeline.agent.state_dict(), _clone),
        "optimizer": _map_tensors(pipeline.optimizer.state_dict(), _clone),
        "env": collector.env.state_dict(),
        "collector": {"obs": collector.obs.clone(), "done": collector.done.clone(),
                      "global_step": collector.global_step},
        "generator": pipeline.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "iteration": pipeline.iteration_index,
    }


@torch.no_grad()
def restore(pipeline, state: dict[str, Any]) -> None:
    """Load ``state`` (from :func:`capture`, possibly via :func:`save`/:func:`load`) into a
    pipeline of the same stage, config and device, before its first iteration."""
    pipeline.agent.load_state_dict(state["agent"])
    _load_optimizer(pipeline.optimizer, state["optimizer"])
    collector = pipeline.collector
    collector.env.load_state_dict(state["env"])
    # In place: the graphed collector's captured step reads these very buffers.
    collector.obs.copy_(state["collector"]["obs"])
    collector.done.copy_(state["collector"]["done"])
    collector.global_step = int(state["collector"]["global_step"])
    pipeline.metrics.reset()  # empty at a boundary: the last iteration's summary reset it
    pipeline.generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and pipeline.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], pipeline.device)
    pipeline.iteration_index = int(state["iteration"])


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``load_state_dict``, but a tensor LR keeps its identity (fused/capturable Adam): torch
    replaces the param groups wholesale, and compiled code and graphs hold the old tensor."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(lr, torch.Tensor):
            lr.copy_(group["lr"])
            group["lr"] = lr


def to_cpu(obj: Any) -> Any:
    """Host copies of every tensor in ``obj`` (a deliberate sync: only when saving)."""
    return _map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def save(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` atomically: a temporary file in the same folder (so the
    rename stays on one file system), flushed and fsynced, then ``os.replace``. On any error,
    or a KeyboardInterrupt, the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # make the rename itself durable
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows, where folders cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
