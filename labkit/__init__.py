"""labkit: a staged path from a naive Python PPO loop to a GPU-native pipeline."""
from __future__ import annotations

__version__ = "0.1.0"
