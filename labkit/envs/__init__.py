"""Forage environments: one spec, four implementations, bit-exact with each other."""
from __future__ import annotations

from .python import ForagePy
from .spec import ACTION_DELTAS, EMPTY, FOOD, N_ACTIONS, POISON, WALL, ForageSpec

__all__ = ["ACTION_DELTAS", "EMPTY", "FOOD", "N_ACTIONS", "POISON", "WALL", "ForagePy",
           "ForageSpec"]
