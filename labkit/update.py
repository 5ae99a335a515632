"""The PPO update as a stage runs it: the math of ``labkit.ppo`` with three swappable parts.

* an **optimizer**: :class:`Adam` (torch's default, as most loops create it) or
  :class:`FusedAdam` (one fused kernel, the LR a device tensor, a sync-free grad clip);
* a **precision** (``labkit.precision``): fp32, or bf16 autocast where the device has bf16;
* an **executor** (``labkit.executors``): eager, compiled or replayed as a CUDA graph.

:func:`build_update` assembles them into ``update(batch) -> stats``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .ppo import PPOConfig, fused_clip_grad_norm_, minibatch_step, ppo_loss, ppo_update
from .precision import Precision


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

    @staticmethod
    def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
        """Set every param group's LR: a Python float, read by each step."""
        for group in optimizer.param_groups:
            group["lr"] = lr

    @staticmethod
    def lr(optimizer: torch.optim.Optimizer) -> float | torch.Tensor:
        """The LR as the optimizer holds it (here a float)."""
        return optimizer.param_groups[0]["lr"]

    @staticmethod
    @torch.no_grad()
    def load_state_(optimizer: torch.optim.Optimizer, state: dict) -> None:
        """``optimizer.load_state_dict(state)`` that keeps every existing state tensor in
        place (compiled code and a captured graph hold them). State the saved dict lacks (it
        was taken before the first step) is zeroed: Adam with zero moments and a zero step
        counter is exactly a fresh Adam."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        live = {p: dict(optimizer.state[p]) for p in params if p in optimizer.state}
        optimizer.load_state_dict(state)  # torch's casts and placement (a CPU step counter)
        for p, old in live.items():
            new = optimizer.state[p]
            for key, tensor in old.items():
                if not isinstance(tensor, torch.Tensor):
                    continue
                if key in new:
                    tensor.copy_(new[key])
                else:
                    tensor.zero_()
                new[key] = tensor


@dataclass(frozen=True, repr=False)
class FusedAdam(Adam):
    """Adam with ``fused=True``: one kernel per step for all parameters, step counters on the
    device. The LR is a 0-d device tensor that :meth:`set_lr` updates in place, so
    compiled code and CUDA graphs see new values without recompiling or recapturing. Gradients
    are clipped by :func:`labkit.ppo.fused_clip_grad_norm_` (no host read). ``capturable``
    (stage 8, on CUDA) makes the step legal inside a CUDA graph capture; only a captured step
    needs it, and torch warns when a capturable optimizer steps outside a capture."""

    capturable: bool = False

    def __repr__(self) -> str:
        return "FusedAdam(capturable=True)" if self.capturable else "FusedAdam()"

    @staticmethod
    def clip_grad(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return fused_clip_grad_norm_(params, max_norm)

    def __call__(self, params: Iterable[torch.Tensor], cfg: PPOConfig,
                 device: torch.device) -> torch.optim.Adam:
        lr = torch.tensor(cfg.lr, dtype=torch.float32, device=device)
        return torch.optim.Adam(params, lr=lr, eps=cfg.adam_eps, fused=True,
                                capturable=self.capturable)

    @staticmethod
    def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
        """Write ``lr`` into the LR tensor, in place: compiled code and a captured graph hold
        that tensor, and read the new value on their next call (``fill_`` takes the float as a
        kernel argument: no host-to-device copy)."""
        for group in optimizer.param_groups:
            group["lr"].fill_(lr)

    @staticmethod
    @torch.no_grad()
    def load_state_(optimizer: torch.optim.Optimizer, state: dict) -> None:
        """:meth:`Adam.load_state_`, the LR tensor kept in place too, the saved LR in it."""
        lrs = [g["lr"] for g in optimizer.param_groups]
        Adam.load_state_(optimizer, state)
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            lr.copy_(group["lr"])
            group["lr"] = lr


def build_update(*, agent: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 clip_grad: Callable, precision: Precision, executor, cfg: PPOConfig,
                 generator: torch.Generator, state: Any, whole: bool = False
                 ) -> tuple[Callable, Callable]:
    """``update(batch) -> stats``: :func:`labkit.ppo.ppo_update` with a minibatch step made of
    ``executor.wrap_model(loss)``, ``precision`` and ``clip_grad``, itself run through
    ``executor.wrap_step`` (``state`` is what a graph capture saves and restores); and that
    wrapped loss (a :class:`labkit.executors.Choice` where the executor decides later).
    ``whole``: ``executor.wrap_step`` wraps the whole update instead, every epoch and
    minibatch (a graphed executor then captures one graph for all of it: the permutations
    drawn from the registered ``generator`` and the minibatches gathered inside it)."""
    loss_fn = executor.wrap_model(partial(ppo_loss, agent, cfg=cfg))
    step = partial(minibatch_step, loss_fn=loss_fn, optimizer=optimizer,
                   params=[p for p in agent.parameters() if p.requires_grad],
                   max_grad_norm=cfg.max_grad_norm, clip_grad=clip_grad, precision=precision)
    if not whole:
        step = executor.wrap_step(step, state=state, generator=generator)
    update = partial(ppo_update, agent, cfg=cfg, generator=generator, step=step)
    if whole:
        update = executor.wrap_step(update, state=state, generator=generator)
    return update, loss_fn
