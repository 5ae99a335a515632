"""The PPO update alone, in each way a stage can run it: the loss eager or compiled (as
:class:`labkit.executors.Compiled` compiles it), in fp32 or under bf16 autocast, with the
agent's convolutions as ``nn.Conv2d`` or as one matmul each (:class:`labkit.policy.ConvBody`'s
``conv_math``), at chosen minibatch sizes and thread counts. One minibatch step each (forward,
backward, grad clip, Adam on the reference agent), timed in interleaved rounds; medians with
the min-max spread, and the model work per second as a share of a large matmul's rate in the
variant's dtype, measured at the size's thread count. What decides, on a given CPU, whether
compile, bf16 and the matmul convolutions pay: ``python -m labkit bench-update``.

Beside them, the update's floor: what every minibatch step must do and nothing else, the
model's matrix products (the forward's and the backward's, no loss, no elementwise op between
them) and one step of the optimizer, fused Adam after the fused grad clip as stage 7 runs
them (:class:`labkit.update.FusedAdam`), in each precision, with the convolutions laid out as
matrix products in each of :data:`FORMULATIONS`' three ways (the unfolding itself not timed).
The share of the peak the model's FLOPs would reach in that time is the most a variant that
runs those products can reach at that size on that device (a convolution kernel that is no
matrix product, a Winograd one say, is not bounded by it).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

import torch

from ..device import run_metadata
from ..envs.spec import N_ACTIONS, N_CHANNELS
from ..policy import HIDDEN, Agent, flops_per_sample
from ..ppo import Batch, PPOConfig, minibatch_step, ppo_loss
from ..precision import Precision
from ..timing import timed
from . import tables
from .bench import PEAK_DTYPES, matmul_peak_flops

#: (executor, precision, conv_math) of each timed variant, the reference first.
VARIANTS = tuple((ex, prec, math) for math in ("conv2d", "matmul")
                 for ex in ("eager", "compiled") for prec in ("fp32", "bf16"))
#: On the CPU also: the loss compiled to C++ with 256-bit vectors (``cpp.simdlen=8``, in that
#: one compile's options) where inductor's default on an AVX-512 core is 512-bit. Its slowest
#: kernel here (the ReLU with its mask saved for backward, 5.4 ms a call at minibatch 4,096 on
#: the 2-core Xeon it was found on) runs several times faster in 256-bit code.
CPU_VARIANTS = (("compiled/256b", "fp32", "conv2d"), ("compiled/256b", "bf16", "conv2d"))

TABLE = tables.Table((
    tables.Column("minibatch", "minibatch", lambda r: f"{r['minibatch']:,}", 9),
    tables.Column("threads", "threads", lambda r: str(r["threads"] or "-"), 7),
    tables.Column("variant", "variant",
                  lambda r: f"{r['executor']} {r['precision']} {r['conv_math']}", 25, left=True),
    tables.Column("median ms", "median ms", lambda r: f"{r['median_ms']:.1f}", 9),
    tables.Column("min", "min ms", lambda r: f"{r['min_ms']:.1f}", 7),
    tables.Column("max", "max ms", lambda r: f"{r['max_ms']:.1f}", 7),
    tables.Column("x eager", "x eager fp32", lambda r: f"{r['x_eager_fp32']:.2f}", 7),
    tables.Column("% peak", "% of matmul peak", lambda r: f"{100 * r['frac_of_peak']:.1f}", 6),
))


FLOOR_TABLE = tables.Table((
    tables.Column("minibatch", "minibatch", lambda r: f"{r['minibatch']:,}", 9),
    tables.Column("threads", "threads", lambda r: str(r["threads"] or "-"), 7),
    tables.Column("products", "the model's products, then the optimizer's step",
                  lambda r: f"{r['formulation']} {r['precision']}", 25, left=True),
    tables.Column("median ms", "median ms", lambda r: f"{r['median_ms']:.1f}", 9),
    tables.Column("min", "min ms", lambda r: f"{r['min_ms']:.1f}", 7),
    tables.Column("max", "max ms", lambda r: f"{r['max_ms']:.1f}", 7),
    tables.Column("% peak at most", "% of matmul peak at most",
                  lambda r: f"{100 * r['max_frac_of_peak']:.1f}", 14),
))
#: The three ways the floor lays out the model's convolutions as matrix products.
FORMULATIONS = ("matmul", "im2col", "rows")


def model_products(n: int, view: int = 7) -> dict[str, list[tuple[int, int, int]]]:
    """The forward's matrix products of the reference conv agent on ``n`` observations, (M, K,
    N) each, in :data:`FORMULATIONS`' three ways, a convolution of a C x V x V input into O x
    V' x V' (V' = V - 2) as:

    * "matmul": the dense matmul of ``conv_math`` "matmul", (n, C*V*V) by (C*V*V, O*V'*V');
    * "im2col": (n*V'*V', C*9) by (C*9, O), exactly the convolution's multiply-adds;
    * "rows": each output row from the 3 input rows under it, (n*V', C*3*V) by (C*3*V, O*V'),
      the weight laid out as a banded matrix: fewer zeros than "matmul", wider than "im2col";

    then the linear layer and the two heads as one product."""
    s1, s2 = view - 2, view - 4
    tail = [(n, 32 * s2 * s2, HIDDEN), (n, HIDDEN, N_ACTIONS + 1)]
    return {"matmul": [(n, N_CHANNELS * view * view, 16 * s1 * s1),
                       (n, 16 * s1 * s1, 32 * s2 * s2)] + tail,
            "im2col": [(n * s1 * s1, N_CHANNELS * 9, 16), (n * s2 * s2, 16 * 9, 32)] + tail,
            "rows": [(n * s1, N_CHANNELS * 3 * view, 16 * s1),
                     (n * s2, 16 * 3 * s1, 32 * s2)] + tail}


def _products_pass(products: list[tuple[int, int, int]], dtype: torch.dtype,
                   device: torch.device, then: Callable[[], object] = lambda: None
                   ) -> Callable[[], None]:
    """One forward and backward pass's products, as one call: per layer the forward (M, K) @
    (K, N), the input's gradient (M, N) @ (N, K) (not the first layer's: the observations
    need none) and the weight's (K, M) @ (M, N), on operands made once; then ``then()``."""
    pairs = []
    for i, (m, k, n) in enumerate(products):
        for a, b, c in [(m, k, n)] + ([(m, n, k)] if i else []) + [(k, m, n)]:
            pairs.append((torch.randn(a, b, dtype=dtype, device=device),
                          torch.randn(b, c, dtype=dtype, device=device)))

    def run() -> None:
        for x, w in pairs:
            torch.mm(x, w)
        then()
    return run


def _optimizer_step(device: torch.device, cfg: PPOConfig) -> Callable[[], None]:
    """One step of stage 7's optimizer on the reference agent's parameters, their gradients
    set once: :class:`labkit.update.FusedAdam` after its fused grad clip."""
    from ..update import FusedAdam

    params = list(Agent().to(device).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = FusedAdam()(params, cfg, device)

    def step() -> None:
        FusedAdam.clip_grad(params, cfg.max_grad_norm)
        optimizer.step()
    return step


def _minibatch(n: int, device: torch.device, generator: torch.Generator) -> Batch:
    """A minibatch of ``n`` samples shaped as the ladder's (values drawn at random: the
    update's time does not depend on them)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator).to(device)

    return Batch(obs=rand(n, 3, 7, 7), actions=torch.randint(0, 5, (n,), generator=generator
                                                              ).to(device),
                 logprobs=torch.full((n,), -1.6, device=device), advantages=rand(n) - 0.5,
                 returns=rand(n), values=rand(n))


def _steps(n: int, device: torch.device, cfg: PPOConfig
           ) -> dict[tuple[str, str, str], partial]:
    """One minibatch step per variant, each on its own agent (the same initial weights) and
    optimizer."""
    from ..executors import Compiled
    from ..update import Adam

    variants = VARIANTS + (CPU_VARIANTS if device.type == "cpu" else ())
    mb = _minibatch(n, device, torch.Generator().manual_seed(0))
    steps = {}
    for ex, prec, math in variants:
        torch.manual_seed(0)
        agent = Agent().to(device)
        agent.body.conv_math = math
        params = list(agent.parameters())
        loss = partial(ppo_loss, agent, cfg=cfg)
        if ex == "compiled":
            loss = Compiled().wrap_model(loss)
        elif ex == "compiled/256b":
            loss = torch.compile(loss, fullgraph=True, options={"cpp.simdlen": 8})
        steps[ex, prec, math] = partial(
            minibatch_step, mb, loss_fn=loss, optimizer=Adam()(params, cfg, device),
            params=params, max_grad_norm=cfg.max_grad_norm, clip_grad=Adam.clip_grad,
            precision=Precision(prec, device.type))
    return steps


def _interleaved(calls: dict, device: torch.device, rounds: int) -> dict[object, list[float]]:
    """Seconds of each of ``calls`` ({key: no-argument callable}), each called twice first
    (compiles, first allocations), then ``rounds`` rounds that call each once, in order."""
    for call in calls.values():
        call(), call()
    times: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            times[key].append(timed(call, device)[0])
    return times


def _spread_ms(found: list[float]) -> dict:
    """Median, min, max and every sample of ``found`` (seconds), in milliseconds."""
    return {"median_ms": 1e3 * statistics.median(found), "min_ms": 1e3 * min(found),
            "max_ms": 1e3 * max(found), "samples_ms": [1e3 * t for t in found]}


def bench_update(device: torch.device, sizes: list[tuple[int, int]], rounds: int = 5) -> dict:
    """Each (minibatch, threads) of ``sizes``: every variant warmed up (compiled; twice),
    then timed ``rounds`` times, the variants interleaved in each round; then the floors
    (``result["floors"]``: the model's products and the fused optimizer step, per formulation
    and precision) the same way; and a large matmul timed in each precision
    (:func:`labkit.measure.bench.matmul_peak_flops`). Threads are set on the CPU only (and
    restored). Before and after each size ``torch.compiler.reset()`` drops the compiles made
    in the process: each size, precision, convolution math and set of compile options is
    another cache entry of the one code object dynamo keeps them on for every compiled
    ``partial``, and past its recompile limit (8) the next ``fullgraph`` compile of the loss
    failed (after a stage's compiles in the same process, this command's own; after this
    command's, a stage's)."""
    rows, floors, cfg, saved = [], [], PPOConfig(), torch.get_num_threads()
    train_flops = flops_per_sample()["train"]
    try:
        for n, threads in sizes:
            if device.type == "cpu":
                torch.set_num_threads(threads)
            torch.compiler.reset()  # what earlier compiles in the process left on that object
            times = _interleaved(_steps(n, device, cfg), device, rounds)
            torch.compiler.reset()
            step = _optimizer_step(device, cfg)
            floor_times = _interleaved(
                {(form, prec): _products_pass(products, PEAK_DTYPES[prec], device, step)
                 for form, products in model_products(n).items() for prec in ("fp32", "bf16")},
                device, rounds)
            peaks = {prec: matmul_peak_flops(device, dtype=PEAK_DTYPES[prec])["peak_flops"]
                     for prec in ("fp32", "bf16")}
            size = {"minibatch": n, "threads": threads if device.type == "cpu" else None}
            for (form, prec), found in floor_times.items():
                floors.append({**size, "formulation": form, "precision": prec,
                               **_spread_ms(found), "model_flops": train_flops * n,
                               "peak_flops": peaks[prec], "max_frac_of_peak":
                               train_flops * n / statistics.median(found) / peaks[prec]})
            reference = statistics.median(times[VARIANTS[0]])
            for (ex, prec, math), found in times.items():
                median = statistics.median(found)
                rows.append({**size, "executor": ex, "precision": prec, "conv_math": math,
                             **_spread_ms(found), "x_eager_fp32": reference / median,
                             "model_flops": train_flops * n, "peak_flops": peaks[prec],
                             "frac_of_peak": train_flops * n / median / peaks[prec]})
    finally:
        torch.set_num_threads(saved)
        torch.compiler.reset()
    return {"meta": run_metadata(device), "rounds": rounds, "rows": rows, "floors": floors}


def format_table(result: dict) -> str:
    m = result["meta"]
    return "\n".join([
        TABLE.text(result["rows"]),
        f"one minibatch step (PPO loss forward and backward, grad clip, Adam) on "
        f"{m['device_name']} ({m['device']}), torch {m['torch']}; "
        f"{result['rounds']} interleaved rounds; x eager fp32: the eager fp32 conv2d median over "
        "the row's (above 1: faster); % peak: the model's FLOPs (forward and backward, "
        "labkit.policy.flops_per_sample; not the zeros the matmul convolutions also multiply) "
        "per second over a large matmul's in the row's dtype, on the row's threads", "",
        *([FLOOR_TABLE.text(result["floors"]),
           "the update's floor: the model's matrix products (forward, and backward but the "
           "observations' gradient), nothing between them, then the fused grad clip and fused "
           "Adam step; the convolutions as dense matmuls, im2col products or row-banded "
           "products (the unfolding not timed); % peak at most: the model's FLOPs in that "
           "time, the most a variant running those products can reach"]
          if result.get("floors") else [])])
