"""Forage environments: one spec, four implementations, bit-exact with each other."""
from __future__ import annotations

from .bench import bench_envs, format_table
from .numpy import ForageNumpy, Layout
from .policies import mean_return, oracle_actions, random_actions
from .python import ForagePy, ForagePyList
from .spec import ACTION_DELTAS, EMPTY, FOOD, N_ACTIONS, POISON, WALL, ForageSpec
from .torch import ForageTorch, kth_free
from .torch_loop import ForageTorchLoop

__all__ = ["ACTION_DELTAS", "EMPTY", "FOOD", "N_ACTIONS", "POISON", "WALL", "ForageNumpy",
           "ForagePy", "ForagePyList", "ForageSpec", "ForageTorch", "ForageTorchLoop", "Layout",
           "bench_envs", "format_table", "kth_free", "mean_return", "oracle_actions",
           "random_actions"]

try:  # Gymnasium is optional (pip install labkit[gym]): register labkit/Forage-v0 if present
    from .gym import register as _register_gymnasium
except ImportError:
    pass
else:
    _register_gymnasium()
