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


def check_state_tensor(name: str, value: object, like: object, low: float | None = None,
                       high: float | None = None, finite: bool = True) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a tensor of ``like``'s shape and
    dtype, finite where floating point (``finite``), with every element in ``[low, high]``
    where given: what a ``load_state_dict`` takes, checked on the host, once, at load."""
    import torch

    if not isinstance(value, torch.Tensor) or value.shape != like.shape \
            or value.dtype != like.dtype:
        raise ValueError(f"{name} must be a {like.dtype} tensor of shape {tuple(like.shape)}")
    host = value.detach().cpu()
    if finite and host.is_floating_point() and not bool(torch.isfinite(host).all()):
        raise ValueError(f"{name} must be finite (it holds NaN or inf)")
    if (low is not None and bool((host < low).any())) \
            or (high is not None and bool((host > high).any())):
        raise ValueError(f"{name} must be in [{low}, {high}]")


def check_state_keys(name: str, state: object, keys: tuple[str, ...]) -> dict:
    """``state`` if it is a dict with exactly ``keys``; else a ValueError naming ``name``."""
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name} must have keys {sorted(keys)}, got {got}")
    return state
