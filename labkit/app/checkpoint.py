"""Checkpoints: a pipeline's ``state_dict()`` on disk, written atomically, verified on load.

What is saved is exactly what warmup and graph capture save and restore (``Pipeline.state_dict``:
model, optimizer, env, collector, metrics, sampling generator, counters), moved to the CPU, with
the run's config. The file is a short header (magic, SHA-256 of the rest) and a ``torch.save``
payload; ``save`` writes it through :func:`labkit.files.atomic_write`, so a crash or kill at any
moment leaves either the previous checkpoint or the new one, never a torn file. ``load``
verifies the checksum and the contents and raises :class:`CheckpointError` naming the path and
the field: missing, truncated, a flipped byte, another format, missing keys, non-finite
parameters.

Not saved: an fp16 ``GradScaler``'s scale (GPUs without bf16 only), which re-calibrates within a
few steps after a resume, so such a resumed run is not bit-identical. On a GPU, a resumed run is
bit-identical to an uninterrupted one when both run inside :func:`labkit.device.deterministic`
(cuDNN's and inductor's choices made the same way each time).
"""
from __future__ import annotations

import hashlib
import io
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..capture import tree_map
from ..executors import FUSED_ROLLOUT_PHASE, KINDS, PART_PHASE
from ..files import atomic_write
from ..policy import CONV_MATHS
from ..stages import PipelineState

FORMAT = 3
FILENAME = "checkpoint.pt"
MAGIC = b"LABKITCK"
#: What a checkpoint payload holds, and what its state holds.
KEYS = ("format", "config", "device", "wall_s", "state")
STATE_KEYS = PipelineState.required_keys()


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, corrupt or does not fit its run; the message names
    the path and the field."""


def to_cpu(obj: Any) -> Any:
    """Host copies of every tensor in ``obj`` (a deliberate sync: only when saving)."""
    return tree_map(lambda t: t.detach().to("cpu", copy=True), obj)


def save(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (tensors moved to the CPU) to ``path`` atomically, with a checksum."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **to_cpu(payload)}, buf)
    body = buf.getvalue()
    with atomic_write(path, "wb") as f:
        f.write(MAGIC + hashlib.sha256(body).digest() + body)
    return Path(path)


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save` (tensors on the CPU)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    data = path.read_bytes()
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a labkit checkpoint of format {FORMAT} "
                              "(no labkit header; truncated, or another file)")
    body = data[head:]
    if hashlib.sha256(body).digest() != data[len(MAGIC):head]:
        raise CheckpointError(f"{path} is corrupt: its checksum does not match its contents")
    if not body.startswith(b"PK\x03\x04"):  # refused before torch reads (and warns about) it
        raise CheckpointError(f"{path} is not a labkit checkpoint of format {FORMAT}: its body "
                              "is not the zip archive torch.save writes (a raw pickle, say)")
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: "
                              f"{err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path} is not a labkit checkpoint of format {FORMAT} "
                              f"(found {found!r})")
    return payload


def check(payload: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """The payload of a training run's checkpoint, its fields checked: every key present, the
    device a device name, the counters integers, every floating-point tensor of the model and
    optimizer finite. Raises :class:`CheckpointError` naming ``path`` and the field."""
    for key in KEYS:
        if key not in payload:
            raise CheckpointError(f"{path}: field {key!r} is missing")
    state = payload["state"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: field 'state' must be a dict")
    for key in STATE_KEYS:
        if key not in state:
            raise CheckpointError(f"{path}: field 'state.{key}' is missing")
    for key in ("global_step", "iteration"):
        if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
            raise CheckpointError(f"{path}: field 'state.{key}' must be an int >= 0, got "
                                  f"{state[key]!r}")
    try:
        torch.device(payload["device"])
    except (RuntimeError, TypeError, ValueError):
        raise CheckpointError(f"{path}: field 'device' is not a device: "
                              f"{payload['device']!r}") from None
    if not isinstance(payload["wall_s"], (int, float)) or not math.isfinite(payload["wall_s"]) \
            or payload["wall_s"] < 0:
        raise CheckpointError(f"{path}: field 'wall_s' must be a finite number >= 0 (seconds "
                              f"trained); got {payload['wall_s']!r:.50}")
    threads = payload.get("threads")  # absent before the thread count was kept
    if threads is not None and (type(threads) is not int or not 1 <= threads <= MAX_THREADS):
        raise CheckpointError(f"{path}: field 'threads' must be an int in 1..{MAX_THREADS} (the "
                              f"CPU threads the run used); got {threads!r:.50}")
    choices = payload.get("executor_choices", {})  # absent before compile choices existed
    if not isinstance(choices, dict) or not all(
            part in PART_PHASE and choice_ok(made, part) for part, made in choices.items()):
        raise CheckpointError(f"{path}: field 'executor_choices' must map "
                              f"{' or '.join(PART_PHASE)} to {{'kept': "
                              f"{' or '.join(map(repr, KINDS))}, 'why': str, ...}} (a timed "
                              f"choice with its phase and timings); got {choices!r:.200}")
    convs = payload.get("conv_choices", {})  # absent before the convolutions' choice existed
    if not isinstance(convs, dict) or (convs and set(convs) != set(PART_PHASE)) or not all(
            choice_ok(made, part, CONV_MATHS) for part, made in convs.items()):
        raise CheckpointError(f"{path}: field 'conv_choices' must be empty or map "
                              f"{' and '.join(PART_PHASE)} to {{'kept': "
                              f"{' or '.join(map(repr, CONV_MATHS))}, 'why': str, ...}} (a "
                              f"timed choice with its phase and timings); got {convs!r:.200}")
    precision = state.get("precision", {})  # absent before precision state was kept
    if not isinstance(precision, dict) or (precision and not _scaler_ok(precision)):
        raise CheckpointError(f"{path}: field 'state.precision' must be empty (fp32, bf16) or "
                              f"a GradScaler's {{'scale': one float32 in (0, 3.4e38), "
                              f"'growth_tracker': one int32 >= 0}}; got {precision!r:.200}")
    for part in ("agent", "optimizer"):
        bad = _first_non_finite(state[part], f"state.{part}")
        if bad:
            raise CheckpointError(f"{path}: field {bad!r} holds non-finite values (NaN or "
                                  "inf); this state cannot train")
    bad = _optimizer_state_bad(state["optimizer"])
    if bad:
        raise CheckpointError(f"{path}: field 'state.optimizer' {bad}; this state cannot train")
    return payload


#: More CPU threads than any machine has: a saved count above it is not one a run used.
MAX_THREADS = 65536


def _optimizer_state_bad(optimizer: Any) -> str | None:
    """What is impossible in an Adam state (finite values are checked apart): a negative
    second moment, or a step count that is not one finite whole number >= 0 shared by every
    parameter. None where it is sound."""
    per_param = optimizer.get("state", {}) if isinstance(optimizer, dict) else None
    if not isinstance(per_param, dict):
        return "must be an optimizer's state_dict (a dict with 'state')"
    steps = set()
    for key, entry in per_param.items():
        if not isinstance(entry, dict):
            return f"['state'][{key!r}] must be a dict of tensors"
        sq = entry.get("exp_avg_sq")
        if isinstance(sq, torch.Tensor) and bool((sq < 0).any()):
            return (f"['state'][{key!r}]['exp_avg_sq'] holds negative values (a second moment "
                    "is >= 0)")
        step = entry.get("step")
        if step is not None:
            value = float(step) if isinstance(step, (int, float, torch.Tensor)) and (
                not isinstance(step, torch.Tensor) or step.numel() == 1) else math.nan
            if not math.isfinite(value) or value < 0 or value != int(value):
                return f"['state'][{key!r}]['step'] must be a whole number >= 0; got {step!r:.50}"
            steps.add(value)
    if len(steps) > 1:
        return (f"holds different step counts across parameters ({sorted(steps)}); Adam steps "
                "them all at once")
    return None


def _scaler_ok(state: dict) -> bool:
    """A GradScaler's saved tensors (``ScaledPrecision.state_dict``), each one element."""
    scale, tracker = state.get("scale"), state.get("growth_tracker")
    return set(state) == {"scale", "growth_tracker"} \
        and isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 \
        and scale.numel() == 1 and bool(torch.isfinite(scale).all() & (scale > 0).all()) \
        and isinstance(tracker, torch.Tensor) and tracker.dtype == torch.int32 \
        and tracker.numel() == 1 and bool((tracker >= 0).all())


def choice_ok(made: Any, part: str, kinds: tuple[str, ...] = KINDS) -> bool:
    """A saved choice for ``part`` between ``kinds`` (compiled or eager; its convolutions,
    conv2d or matmul): what it kept, why, and for a timed one its phase (the part's) and each
    kind's timings; a fused rollout step's is timed in its ``step`` phase)."""
    if not (isinstance(made, dict) and made.get("kept") in kinds
            and isinstance(made.get("why"), str)):
        return False
    if made["why"] != "timed":
        return True
    phases = {PART_PHASE[part]} | ({FUSED_ROLLOUT_PHASE} if part == "rollout" else set())
    return made.get("phase") in phases and _timings_ok(
        [made.get(f"{kind}_ms") for kind in kinds])


def _timings_ok(timings: list) -> bool:
    return all(isinstance(t, list) and t and all(
        isinstance(x, (int, float)) and math.isfinite(x) for x in t) for t in timings)


def _first_non_finite(obj: Any, prefix: str) -> str | None:
    if isinstance(obj, torch.Tensor):
        ok = not obj.is_floating_point() or bool(torch.isfinite(obj).all())
        return None if ok else prefix
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        bad = _first_non_finite(value, f"{prefix}.{key}")
        if bad:
            return bad
    return None
