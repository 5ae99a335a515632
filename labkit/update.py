"""The PPO update as a stage runs it: the math of ``labkit.ppo`` with three swappable parts.

* an **optimizer**: :class:`Adam` (torch's default, as most loops create it) or
  :class:`FusedAdam` (one fused kernel, the LR a device tensor, a sync-free grad clip);
* a **precision**: :func:`fp32` or :func:`amp` (bf16 autocast where the GPU has it);
* an **executor** (``labkit.executors``): eager, compiled or replayed as a CUDA graph.

:func:`build_update` assembles them into ``update(batch) -> stats``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .device import has_bf16
from .ppo import PPOConfig, fused_clip_grad_norm_, minibatch_step, ppo_loss, ppo_update

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Adam:
    """``torch.optim.Adam`` as most training loops create it: a float learning rate, step
    counters kept as CPU tensors, and ``torch.nn.utils.clip_grad_norm_``. Each step reads every
    parameter's counter with ``.item()``. ``foreach=False`` (torch's choice on the CPU) steps one
    parameter at a time on every device: the multi-tensor kernels torch picks by default on CUDA
    read each counter twice, and the chapters compare the count across devices."""

    requires: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def clip_grad(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def __call__(self, params: Iterable[torch.Tensor], cfg: PPOConfig,
                 device: torch.device) -> torch.optim.Adam:
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.adam_eps, foreach=False)


@dataclass(frozen=True, repr=False)
class FusedAdam(Adam):
    """Adam with ``fused=True``: one kernel per step for all parameters, step counters on the
    device. The LR is a 0-d device tensor that :func:`labkit.ppo.set_lr` updates in place, so
    compiled code and CUDA graphs see new values without recompiling or recapturing; on CUDA it
    is ``capturable``. Gradients are clipped by :func:`labkit.ppo.fused_clip_grad_norm_` (no
    host read)."""

    @staticmethod
    def clip_grad(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return fused_clip_grad_norm_(params, max_norm)

    def __call__(self, params: Iterable[torch.Tensor], cfg: PPOConfig,
                 device: torch.device) -> torch.optim.Adam:
        lr = torch.tensor(cfg.lr, dtype=torch.float32, device=device)
        return torch.optim.Adam(params, lr=lr, eps=cfg.adam_eps, fused=True,
                                capturable=device.type == "cuda")


class Precision(str):
    """What the update's forward runs in (``"fp32"``, ``"bf16"`` or ``"fp16"``: it compares and
    prints as that name) and what that brings: its autocast and, for fp16, a GradScaler."""

    def __new__(cls, name: str) -> Precision:
        if name not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {name!r}")
        return super().__new__(cls, name)

    def autocast(self, device: torch.device) -> Callable[[], Any]:
        """A context-manager factory for this precision's autocast (a no-op for fp32)."""
        if self == "fp32":
            return contextlib.nullcontext
        dtype = torch.bfloat16 if self == "bf16" else torch.float16
        # cache off: cached casts of the parameters would be stale across graph replays
        return partial(torch.autocast, device.type, dtype=dtype, cache_enabled=False)

    def scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """fp16 gradients can underflow: a GradScaler scales the loss (None otherwise)."""
        return torch.amp.GradScaler(device.type) if self == "fp16" else None


def fp32(device: torch.device) -> Precision:
    """Everything in float32."""
    return Precision("fp32")


def amp(device: torch.device) -> Precision:
    """Mixed precision for the loss's forward: bf16 autocast where the GPU has it, fp16 (with a
    GradScaler) on older GPUs, fp32 on the CPU, where bf16 matmuls without AMX are slower than
    fp32 for this small model."""
    if device.type != "cuda":
        return Precision("fp32")
    return Precision("bf16" if has_bf16(device) else "fp16")


def build_update(*, agent: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 clip_grad: Callable, precision: Precision, executor, cfg: PPOConfig,
                 generator: torch.Generator, state: Any) -> Callable:
    """``update(batch) -> stats``: :func:`labkit.ppo.ppo_update` with a minibatch step made of
    ``executor.inner(loss)``, ``precision``'s autocast and ``clip_grad``, itself run through
    ``executor.outer`` (``state`` is what a graph capture saves and restores)."""
    device = next(agent.parameters()).device
    loss_fn = executor.inner(partial(ppo_loss, agent, cfg=cfg))
    step = partial(minibatch_step, loss_fn=loss_fn, optimizer=optimizer,
                   params=[p for p in agent.parameters() if p.requires_grad],
                   max_grad_norm=cfg.max_grad_norm, clip_grad=clip_grad,
                   autocast=precision.autocast(device), scaler=precision.scaler(device))
    step = executor.outer(step, state)
    return partial(ppo_update, agent, optimizer, cfg=cfg, generator=generator, step=step)
