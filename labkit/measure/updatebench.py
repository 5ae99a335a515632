"""The PPO update alone, in each way a stage can run it: the loss eager or compiled (as
:class:`labkit.executors.Compiled` compiles it), in fp32 or under bf16 autocast, at chosen
minibatch sizes and thread counts. One minibatch step each (forward, backward, grad clip, Adam
on the reference agent), timed in interleaved rounds; medians with the min-max spread. What
decides, on a given CPU, whether compile and bf16 pay: ``python -m labkit bench-update``.
"""
from __future__ import annotations

import statistics
from functools import partial

import torch

from ..device import run_metadata
from ..policy import Agent
from ..ppo import Batch, PPOConfig, minibatch_step, ppo_loss
from ..precision import Precision
from ..timing import timed
from . import tables

#: (executor, precision) of each timed variant, the reference first.
VARIANTS = (("eager", "fp32"), ("eager", "bf16"), ("compiled", "fp32"), ("compiled", "bf16"))
#: On the CPU also: the loss compiled to C++ with 256-bit vectors (``cpp.simdlen=8``, in that
#: one compile's options) where inductor's default on an AVX-512 core is 512-bit. Its slowest
#: kernel here (the ReLU with its mask saved for backward, 5.4 ms a call at minibatch 4,096 on
#: the 2-core Xeon it was found on) runs several times faster in 256-bit code.
CPU_VARIANTS = (("compiled/256b", "fp32"), ("compiled/256b", "bf16"))

TABLE = tables.Table((
    tables.Column("minibatch", "minibatch", lambda r: f"{r['minibatch']:,}", 9),
    tables.Column("threads", "threads", lambda r: str(r["threads"] or "-"), 7),
    tables.Column("variant", "variant", lambda r: f"{r['executor']} {r['precision']}", 18,
                  left=True),
    tables.Column("median ms", "median ms", lambda r: f"{r['median_ms']:.1f}", 9),
    tables.Column("min", "min ms", lambda r: f"{r['min_ms']:.1f}", 7),
    tables.Column("max", "max ms", lambda r: f"{r['max_ms']:.1f}", 7),
    tables.Column("x eager", "x eager fp32", lambda r: f"{r['x_eager_fp32']:.2f}", 7),
))


def _minibatch(n: int, device: torch.device, generator: torch.Generator) -> Batch:
    """A minibatch of ``n`` samples shaped as the ladder's (values drawn at random: the
    update's time does not depend on them)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator).to(device)

    return Batch(obs=rand(n, 3, 7, 7), actions=torch.randint(0, 5, (n,), generator=generator
                                                              ).to(device),
                 logprobs=torch.full((n,), -1.6, device=device), advantages=rand(n) - 0.5,
                 returns=rand(n), values=rand(n))


def _steps(n: int, device: torch.device, cfg: PPOConfig) -> dict[tuple[str, str], partial]:
    from ..executors import Compiled
    from ..update import Adam

    torch.manual_seed(0)
    agent = Agent().to(device)
    params = list(agent.parameters())
    optimizer = Adam()(params, cfg, device)
    loss = {"eager": partial(ppo_loss, agent, cfg=cfg),
            "compiled": Compiled().wrap_model(partial(ppo_loss, agent, cfg=cfg))}
    variants = VARIANTS
    if device.type == "cpu":
        loss["compiled/256b"] = torch.compile(partial(ppo_loss, agent, cfg=cfg), fullgraph=True,
                                              options={"cpp.simdlen": 8})
        variants += CPU_VARIANTS
    mb = _minibatch(n, device, torch.Generator().manual_seed(0))
    return {(ex, prec): partial(minibatch_step, mb, loss_fn=loss[ex], optimizer=optimizer,
                                params=params, max_grad_norm=cfg.max_grad_norm,
                                clip_grad=Adam.clip_grad,
                                precision=Precision(prec, device.type))
            for ex, prec in variants}


def bench_update(device: torch.device, sizes: list[tuple[int, int]], rounds: int = 5) -> dict:
    """Each (minibatch, threads) of ``sizes``: every variant warmed up (compiled; twice),
    then timed ``rounds`` times, the variants interleaved in each round. Threads are set on
    the CPU only (and restored). At the end ``torch.compiler.reset()`` drops the compiles it
    made: each size, precision and set of compile options is another cache entry of the one
    code object dynamo keeps them on for every compiled ``partial``, and past its recompile
    limit (8) the next ``fullgraph`` compile of the loss in the process (a stage's) failed."""
    rows, cfg, saved = [], PPOConfig(), torch.get_num_threads()
    try:
        for n, threads in sizes:
            if device.type == "cpu":
                torch.set_num_threads(threads)
            steps = _steps(n, device, cfg)
            for step in steps.values():
                step(), step()
            times: dict = {key: [] for key in steps}
            for _ in range(rounds):
                for key, step in steps.items():
                    times[key].append(timed(step, device)[0])
            reference = statistics.median(times[VARIANTS[0]])
            for (ex, prec), found in times.items():
                median = statistics.median(found)
                rows.append({"minibatch": n, "threads": threads if device.type == "cpu"
                             else None, "executor": ex, "precision": prec,
                             "median_ms": 1e3 * median, "min_ms": 1e3 * min(found),
                             "max_ms": 1e3 * max(found), "samples_ms": [1e3 * t for t in found],
                             "x_eager_fp32": reference / median})
    finally:
        torch.set_num_threads(saved)
        torch.compiler.reset()
    return {"meta": run_metadata(device), "rounds": rounds, "rows": rows}


def format_table(result: dict) -> str:
    m = result["meta"]
    return "\n".join([
        TABLE.text(result["rows"]),
        f"one minibatch step (PPO loss forward and backward, grad clip, Adam) on "
        f"{m['device_name']} ({m['device']}), torch {m['torch']}; "
        f"{result['rounds']} interleaved rounds; x eager fp32: the eager fp32 median over the "
        "row's (above 1: faster)"])
