"""labkit: a staged path from a naive Python PPO loop to a GPU-native pipeline."""
from __future__ import annotations

from .version import __version__

__all__ = ["__version__", "rehearse"]


def __getattr__(name: str):
    """``labkit.rehearse``: a CUDA-graph capture rehearsal of your own step, on the CPU
    (``labkit.doctor.rehearsal``), imported when first used."""
    if name == "rehearse":
        from .doctor.rehearsal import rehearse
        return rehearse
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
