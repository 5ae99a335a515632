"""Warmup off the clock: run one iteration, then put the model and optimizer back in place.

``torch.compile`` compiles on first call and CUDA graphs capture on first call, so the first
iteration of those stages is mostly one-time cost. ``warmup`` runs it, then restores parameters,
buffers and optimizer state *in place* (same storage, so compiled code and captured graphs stay
valid) and resets the envs, so the timed iterations compute what an un-warmed run would.
"""
from __future__ import annotations

import time

import torch


def snapshot(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copies of parameters, buffers and optimizer state tensors."""
    return {
        "module": [t.detach().clone() for t in (*module.parameters(), *module.buffers())],
        "optim": {p: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                  for p, s in optimizer.state.items()},
        "lr": [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
               for g in optimizer.param_groups],
    }


@torch.no_grad()
def restore_(module: torch.nn.Module, optimizer: torch.optim.Optimizer, snap: dict) -> None:
    """Write ``snap`` back in place. Optimizer state that did not exist at snapshot time is
    zeroed: Adam with zero moments and step 0 is exactly a fresh Adam."""
    for t, saved in zip((*module.parameters(), *module.buffers()), snap["module"]):
        t.copy_(saved)
    for p, state in optimizer.state.items():
        saved = snap["optim"].get(p, {})
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                v.copy_(saved[k]) if k in saved else v.zero_()
            elif k in saved:
                state[k] = saved[k]
    for g, lr in zip(optimizer.param_groups, snap["lr"]):
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].copy_(lr)
        else:
            g["lr"] = lr


def warmup(pipeline) -> float:
    """Run one full iteration of ``pipeline`` (compile / capture / cuDNN autotune happen here),
    restore its state and return the seconds it took (synchronized)."""
    from .device import synchronize
    snap = snapshot(pipeline.agent, pipeline.optimizer)
    gen_state = pipeline.generator.get_state()
    synchronize(pipeline.device)
    start = time.perf_counter()
    pipeline.iteration()
    synchronize(pipeline.device)
    elapsed = time.perf_counter() - start
    restore_(pipeline.agent, pipeline.optimizer, snap)
    pipeline.generator.set_state(gen_state)
    pipeline.collector.reset()
    pipeline.iteration_index = 0
    pipeline.collector.global_step = 0
    return elapsed
