"""The checks that configs, PPO and the envs run on what they are given: each names the field
and what is allowed, so a bad value is one clear line (the CLI prints it and exits 2)."""
from __future__ import annotations

import math


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """Return ``value`` if it is an int in ``[low, high]``, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_float(name: str, value: object, low: float, allowed: str, high: float | None = None,
                strict: bool = False) -> None:
    """Raise naming ``name`` unless ``value`` is a finite number >= ``low`` (> with
    ``strict``) and <= ``high``; ``allowed`` says so in words."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number {allowed}, got {value!r}")
    if not math.isfinite(value) or value < low or (strict and value == low) or (
            high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_type(name: str, value: object, cls: type) -> None:
    """Raise naming ``name`` unless ``value`` is a ``cls``."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
