"""Counter-based hash RNG, bit-exact across Python ints, torch tensors and NumPy arrays.

A draw is a pure function of ``(seed, env, episode, step, draw)``: no generator state, so the
Python, NumPy and torch environments produce the same numbers in any order and on any device.
Mixing is Chris Wellons' ``lowbias32``. Every multiply is masked back to 32 bits: torch has no
full uint32 arithmetic, but the low 32 bits of a wrapped int64 product are those of the exact
product, so ``hash32`` on int64 tensors equals it on Python ints. NumPy gets its own entry point
only to cast to uint64 first (NumPy will not mix signed arrays with these constants).
"""
from __future__ import annotations

import numpy as np
import torch

MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B
GOLDEN = 0x9E3779B9


def mix(x, out=None):
    """lowbias32 on values in [0, 2**32): works for int, np.uint64 arrays and int64 tensors
    (ten operations each; ``out``, a tensor, takes the result of the last)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK
    return x ^ (x >> 16) if out is None else torch.bitwise_xor(x, x >> 16, out=out)


def mix_(x: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
    """``mix`` of an int64 tensor in place, the same ten operations with nothing allocated
    (``shifted``, of ``x``'s shape, takes the shifts): the form a step made on every call uses,
    where each temporary would be fresh memory."""
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))
    x.mul_(_M1).bitwise_and_(MASK)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=shifted))
    x.mul_(_M2).bitwise_and_(MASK)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))


def chain(h, *keys):
    """``h`` mixed with each key in turn: ``chain(chain(h, a), b) == chain(h, a, b)``, so a
    prefix of the keys can be hashed once and reused (ForageTorch keeps per-env and
    per-episode prefixes)."""
    for key in keys:
        h = mix(h ^ (key & MASK))
    return h


def hash32(seed, env, episode, step, draw):
    """The hash on Python ints, or on int64 tensors (any device; arguments broadcast; no host
    reads). Result in [0, 2**32)."""
    return chain(GOLDEN, seed, env, episode, step, draw)


def hash_np(seed, env, episode, step, draw) -> np.ndarray:
    """``hash32`` for NumPy; arguments broadcast, result is uint64 in [0, 2**32)."""
    return hash32(*(np.asarray(k).astype(np.uint64) for k in (seed, env, episode, step, draw)))
