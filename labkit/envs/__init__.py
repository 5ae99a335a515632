"""Forage environments: one spec, four implementations, bit-exact with each other.

For Gymnasium (optional: ``pip install 'labkit[gym]'``) see :mod:`labkit.envs.gym`: importing
it registers ``labkit/Forage-v0``; importing this package imports no Gymnasium."""
from __future__ import annotations

from .numpy import ForageNumpy
from .policies import mean_return, oracle_actions, random_actions
from .python import ForagePy, ForagePyList
from .spec import ACTION_DELTAS, EMPTY, FOOD, N_ACTIONS, POISON, WALL, ForageSpec, Layout
from .torch import ForageTorch, kth_free, nth_free
from .torch_loop import ForageTorchLoop

__all__ = ["ACTION_DELTAS", "EMPTY", "FOOD", "N_ACTIONS", "POISON", "WALL", "ForageNumpy",
           "ForagePy", "ForagePyList", "ForageSpec", "ForageTorch", "ForageTorchLoop", "Layout",
           "kth_free", "nth_free", "mean_return", "oracle_actions",
           "random_actions"]
