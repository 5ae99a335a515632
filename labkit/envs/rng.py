"""Counter-based hash RNG, written identically for Python ints, NumPy and torch.

A draw is a pure function of ``(seed, env, episode, step, draw)``: no generator state, so the
Python, NumPy and torch environments produce the same numbers in any order and on any device.
Mixing is Chris Wellons' ``lowbias32``. All arithmetic is done in 64-bit integers and masked to
32 bits after each multiply (torch has no full uint32 support; the low 32 bits of a wrapped
int64 product are the same as of the exact product), so the three versions are bit-exact.
"""
from __future__ import annotations

import numpy as np
import torch

MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mix(x):
    """lowbias32 on values in [0, 2**32): works for int, np.uint64 arrays and int64 tensors."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK
    return x ^ (x >> 16)


def hash_py(seed: int, env: int, episode: int, step: int, draw: int) -> int:
    """Reference version on Python ints."""
    h = _GOLDEN
    for key in (seed, env, episode, step, draw):
        h = _mix(h ^ (key & MASK))
    return h


def hash_np(seed, env, episode, step, draw) -> np.ndarray:
    """NumPy version; arguments broadcast, result is uint64 in [0, 2**32)."""
    h = np.uint64(_GOLDEN)
    for key in (seed, env, episode, step, draw):
        h = _mix(h ^ (np.asarray(key).astype(np.uint64) & np.uint64(MASK)))
    return h


def hash_torch(seed, env, episode, step, draw) -> torch.Tensor:
    """torch version on int64 tensors (any device); arguments broadcast. No host reads."""
    h = _GOLDEN
    for key in (seed, env, episode, step, draw):
        h = _mix(h ^ (key & MASK))
    return h
