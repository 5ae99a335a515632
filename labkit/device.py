"""Device selection with clear errors."""
from __future__ import annotations

import torch

ALLOWED = ("auto", "cpu", "cuda", "cuda:<index>")


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/``None`` picks CUDA when present, else the CPU. Unknown names and CUDA asked
    for on a machine without it raise ``ValueError`` naming the field."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be one of {', '.join(ALLOWED)}; got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {', '.join(ALLOWED)}; got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here; "
                             "use device='cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device index {dev.index} out of range: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine() or "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device``; the only place the harness blocks on the GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
