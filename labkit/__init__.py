"""labkit: a staged path from a naive Python PPO loop to a GPU-native pipeline."""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    """``labkit.rehearse``: a CUDA-graph capture rehearsal of your own step, on the CPU
    (``labkit.rehearsal``), imported when first used."""
    if name == "rehearse":
        from .rehearsal import rehearse
        return rehearse
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
