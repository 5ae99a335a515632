"""Forage environments: one spec, four implementations, bit-exact with each other."""
from __future__ import annotations

import importlib.util

from .numpy import ForageNumpy, Layout
from .policies import mean_return, oracle_actions, random_actions
from .python import ForagePy, ForagePyList
from .spec import ACTION_DELTAS, EMPTY, FOOD, N_ACTIONS, POISON, WALL, ForageSpec
from .torch import ForageTorch, kth_free, nth_free
from .torch_loop import ForageTorchLoop

__all__ = ["ACTION_DELTAS", "EMPTY", "FOOD", "N_ACTIONS", "POISON", "WALL", "ForageNumpy",
           "ForagePy", "ForagePyList", "ForageSpec", "ForageTorch", "ForageTorchLoop", "Layout",
           "kth_free", "nth_free", "mean_return", "oracle_actions",
           "random_actions"]

if importlib.util.find_spec("gymnasium") is not None:  # optional: pip install 'labkit[gym]'
    from .gym import ForageEnv, ForageVectorEnv
    from .gym import register as _register_gymnasium

    _register_gymnasium()  # labkit/Forage-v0
    __all__ += ["ForageEnv", "ForageVectorEnv"]
