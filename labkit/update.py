"""The PPO update as each stage runs it: eager, compiled, or replayed as a CUDA graph.

All three run ``ppo.ppo_update``'s epochs x shuffled minibatches and ``ppo.minibatch_step``'s
math; they differ only in how one minibatch step is executed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch

from .ppo import Batch, PPOConfig, fused_clip_grad_norm_, minibatch_step, ppo_update

Updater = Callable[[Batch], dict]


def autocast_for(precision: str, device: torch.device) -> Callable:
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # cache off: cached casts of parameters would be stale across graph replays
    return partial(torch.autocast, device.type, dtype=dtype, cache_enabled=False)


def make_updater(stage, agent, optimizer, cfg: PPOConfig, precision: str,
                 generator: torch.Generator) -> Updater:
    """The update for ``stage``: torch's clip and unfused Adam before stage 7, fused after."""
    device = next(agent.parameters()).device
    clip = fused_clip_grad_norm_ if stage.fused_amp else torch.nn.utils.clip_grad_norm_
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    step = partial(minibatch_step, agent, optimizer, cfg=cfg, clip_grad=clip,
                   autocast=autocast_for(precision, device), scaler=scaler)
    if stage.graphs:
        from .graphs import GraphedStep
        step = GraphedStep(step, agent, optimizer)
    elif stage.compile:
        step = torch.compile(step)
    return partial(ppo_update, agent, optimizer, cfg=cfg, generator=generator, step=step)
