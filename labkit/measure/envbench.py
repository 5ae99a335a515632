"""The Forage envs alone, with random actions: env steps per second of the four
implementations over a sweep of N (:func:`bench_envs`, printed by :func:`format_table`), and
where a ForageTorch step's time goes, timed part by part (:func:`step_parts`, printed by
:func:`format_parts`). Where ForageNumpy and ForageTorch cross over is
:mod:`labkit.measure.envcrossover`."""
from __future__ import annotations

import signal
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..device import resolve_device, run_metadata, synchronize
from ..envs.numpy import ForageNumpy
from ..envs.python import ForagePy
from ..envs.spec import N_ACTIONS, ForageSpec, check_n_envs
from ..envs.torch import ForageTorch, check_actions
from ..envs.torch_loop import ForageTorchLoop
from ..signals import raise_if_stopped, signum_of
from ..timing import timed
from ..validate import check_int
from . import tables
from .profiling import dispatch_ops

IMPLS = ("ForagePy", "ForageNumpy", "ForageTorchLoop", "ForageTorch")
#: Implementations that step every env in one call, timed at each N of the sweep; the others
#: loop over envs in Python and are timed at ``loop_envs`` only.
VECTORIZED = ("ForageNumpy", "ForageTorch")


@dataclass
class _Runner:
    """One implementation at one N: ``step(i)`` steps every env with the i-th actions."""

    impl: str
    n_envs: int
    step: Callable[[int], None]
    ops: int | None = None
    compile_s: float | None = None
    stride: int = 1
    """Env steps one ``step`` call makes (a compiled loop of K steps makes K)."""
    samples: list[float] = field(default_factory=list)


def _runner(impl: str, n: int, spec: ForageSpec, device: torch.device, n_actions: int,
            seed: int, compiled: int = 0, scalar: bool = False) -> _Runner:
    """``impl`` with ``n`` envs and its actions drawn beforehand (``compiled``: ForageTorch's
    step through ``torch.compile``, 1 step per call, or a loop of that many steps compiled as
    one function; ``scalar``: the one step compiled to C++ without SIMD vectors, inductor's
    ``cpp.simdlen=0``, on the CPU)."""
    rng = np.random.default_rng(seed)
    if impl == "ForagePy":
        envs = [ForagePy(spec, seed=seed, env_index=i) for i in range(n)]
        actions = rng.integers(0, N_ACTIONS, (n_actions, n)).tolist()

        def step(i: int) -> None:
            for env, a in zip(envs, actions[i % n_actions], strict=True):
                env.step(a)
        return _Runner(impl, n, step)
    if impl == "ForageNumpy":
        env = ForageNumpy(n, spec, seed)
        np_actions = rng.integers(0, N_ACTIONS, (n_actions, n))
        return _Runner(impl, n, lambda i: env.step(np_actions[i % n_actions]))
    env = (ForageTorch if impl == "ForageTorch" else ForageTorchLoop)(n, spec, seed=seed,
                                                                      device=device)
    gen = torch.Generator(device).manual_seed(seed)
    t_actions = torch.randint(0, N_ACTIONS, (n_actions, n), generator=gen, device=device)
    ops = sum(dispatch_ops(lambda: env.step(t_actions[0])).values())
    env.reset()  # the counted step is not part of the timed episodes
    if not compiled:
        return _Runner(impl, n, lambda i: env.step(t_actions[i % n_actions]), ops=ops)
    if compiled == 1:
        # dynamic=False: each N its own static graph, as a run at one N compiles it (a second
        # N would otherwise recompile with symbolic sizes, which the step's gather(out=) and
        # its preallocated buffers do not support)
        fn = torch.compile(env.step, fullgraph=True, dynamic=False,
                           options={"cpp.simdlen": 0} if scalar else None)
        compile_s, _ = timed(lambda: fn(t_actions[0]), device)  # the first call compiles
        env.reset()
        return _Runner(impl + ("+compile scalar" if scalar else "+compile"), n,
                       lambda i: fn(t_actions[i % n_actions]), ops=ops, compile_s=compile_s)

    def steps(chunk: torch.Tensor) -> None:
        for a in chunk:  # unrolled by torch.compile: one graph of `compiled` steps
            env.step(a)
    loop = torch.compile(steps, fullgraph=True, dynamic=False)
    chunks = t_actions.split(compiled)
    compile_s, _ = timed(lambda: loop(chunks[0]), device)
    env.reset()
    return _Runner(f"{impl}+compile x{compiled}", n,
                   lambda i: loop(chunks[(i // compiled) % len(chunks)]), ops=ops,
                   compile_s=compile_s, stride=compiled)


def _rounds(runners: list[_Runner], steps: int, warmup: int, repeats: int,
            device: torch.device) -> tuple[int, str | None]:
    """Each runner warmed up by ``warmup`` untimed steps, then timed for ``steps`` steps once
    per round, the runners in turn in every round: drift slows them alike. Returns the rounds
    done and the stop signal's name if one ended them early (the rounds that finished are
    kept; a stop before the first finished is raised)."""
    for r in runners:
        for i in range(0, warmup, r.stride):
            r.step(i)
    synchronize(device)
    done = 0
    try:
        for _ in range(repeats):
            for r in runners:
                def episode(r: _Runner = r) -> None:
                    for i in range(0, steps, r.stride):
                        r.step(warmup + i)
                r.samples.append(timed(episode, device)[0])
            done += 1
            raise_if_stopped()  # a stop that something swallowed ends the rounds here
        return repeats, None
    except KeyboardInterrupt as stop:
        if done == 0:
            raise
        for r in runners:  # the round in progress is dropped: every runner has `done` samples
            del r.samples[done:]
        return done, signal.Signals(signum_of(stop)).name


def _fastest(rows: list[dict]) -> dict[int, dict]:
    """Per N of the sweep: the fastest vectorized implementation and its lead over the next."""
    vectorized = [r for r in rows if r["impl"].split("+")[0] in VECTORIZED]
    out = {}
    for n in sorted({r["n_envs"] for r in vectorized}):
        ranked = sorted((r for r in vectorized if r["n_envs"] == n),
                        key=lambda r: r["steps_per_s"], reverse=True)
        out[n] = {"impl": ranked[0]["impl"], "steps_per_s": ranked[0]["steps_per_s"],
                  "next": ranked[1]["impl"] if len(ranked) > 1 else None,
                  "lead": (ranked[0]["steps_per_s"] / ranked[1]["steps_per_s"]
                           if len(ranked) > 1 else None)}
    return out


#: Bytes per env of one runner besides its drawn actions: a ForageTorch step's peak, measured
#: as max RSS over 3 steps at N=262,144 on the CPU (1,953 B; ForageNumpy's is smaller), doubled.
ENV_BYTES = 4096


def _check_fits(plan: list[tuple], steps: int, device: torch.device) -> None:
    """Refuse, before anything is allocated, a plan whose runners (all alive at once: each
    env's state and its ``steps`` drawn int64 actions) do not fit in what the device, or the
    process's limits on the host, leave (:func:`labkit.config.host_memory`)."""
    from ..config import available_memory, host_memory

    need = sum(n * (ENV_BYTES + 8 * steps) for _, n, *_ in plan)
    free, what = (available_memory(device), "free") if device.type == "cuda" else host_memory()
    if free is not None and need > free:
        raise ValueError(f"n_envs {max(n for _, n, *_ in plan):,}: the benchmark's runners need "
                         f"about {need / 2**30:.1f} GiB on {device}, and {free / 2**30:.1f} GiB "
                         f"is {what}; use smaller --n-envs")


def _sizes(n_envs: Sequence[int] | None, device: torch.device) -> tuple[int, ...]:
    """The Ns of the sweep: ``n_envs``, each checked, or the device's default."""
    sizes = tuple(n_envs) if n_envs is not None else \
        ((4096, 65536) if device.type == "cuda" else (256, 1024, 4096))
    if not sizes:
        raise ValueError("n_envs must name at least one size")
    for n in sizes:
        check_n_envs(n)
    return sizes


def _plan(sizes: tuple[int, ...], loop_envs: int, compiled: bool, compile_loop: int,
          device: torch.device, torch_only: bool = False) -> list[tuple[str, int, int, bool]]:
    """The runners of the sweep as ``(impl, N, compiled, scalar)`` (:func:`_runner`'s
    arguments): the per-env loops at ``loop_envs``, the vectorized ones at every N, and if
    ``compiled`` ForageTorch's compiled step (and loop of ``compile_loop`` steps, and on the
    CPU its scalar step) at every N; ``torch_only``: ForageTorch's runners alone."""
    loops = (1, compile_loop) if compile_loop > 1 else (1,)
    vectorized = ("ForageTorch",) if torch_only else VECTORIZED
    plan = [] if torch_only else [("ForagePy", loop_envs, 0, False),
                                  ("ForageTorchLoop", loop_envs, 0, False)]
    plan += [(impl, n, 0, False) for n in sizes for impl in vectorized]
    plan += [("ForageTorch", n, k, False) for n in sizes for k in loops] if compiled else []
    plan += [("ForageTorch", n, 1, True) for n in sizes] if compiled and device.type == "cpu" \
        else []
    return plan


def _rows(runners: list[_Runner], steps: int) -> list[dict]:
    """A row per runner: its env steps/s (median, and min/median/max over its samples), its
    samples, ops per step and compile seconds, and its speed over ForagePy's (the first; none
    where ForagePy was not timed)."""
    rows = []
    for r in runners:
        rates = sorted(r.n_envs * steps / s for s in r.samples)
        rows.append({"impl": r.impl, "n_envs": r.n_envs,
                     "steps_per_s": statistics.median(rates),
                     "steps_per_s_spread": [rates[0], statistics.median(rates), rates[-1]],
                     "samples_s": r.samples, "ops_per_step": r.ops, "compile_s": r.compile_s})
    py = rows[0]["steps_per_s"] if rows[0]["impl"] == "ForagePy" else None
    for row in rows:
        row["ratio_vs_py"] = row["steps_per_s"] / py if py else None
    return rows


def bench_envs(device: str | torch.device = "auto", repeats: int = 5,
               n_envs: Sequence[int] | None = None, *, spec: ForageSpec | None = None,
               loop_envs: int = 16, episodes: int = 1, compiled: bool = False,
               compile_loop: int = 4, warmup: int = 16, seed: int = 0,
               torch_only: bool = False) -> dict:
    """Env steps/s of each Forage implementation with random actions.

    The vectorized implementations (NumPy, torch) run at every N of ``n_envs`` (default: 256,
    1024, 4096 on the CPU; 4096, 65536 on CUDA), the per-env loops (Python, the torch loop) at
    ``loop_envs``. Every sample is ``episodes`` whole episodes, so each holds the same share of
    resets; the implementations are timed in turn in each of ``repeats`` rounds, so a machine
    that slows down does not pick the winner. Rows hold the median and min/median/max env
    steps/s, the samples, and for torch the non-view aten ops per step; ``compiled`` adds
    ``ForageTorch+compile`` rows (``torch.compile`` of the step) and, if ``compile_loop`` > 1,
    ``ForageTorch+compile xK`` rows (a loop of K steps compiled as one graph; K must divide
    the steps of a sample and ``warmup``) and, on the CPU, ``ForageTorch+compile scalar`` rows
    (the step compiled without SIMD vectors: on an AVX-512 core inductor's vectorized loops
    over this step's int8 lanes were several times slower than its scalar ones), the first
    call's seconds in ``compile_s``.
    ``torch_only`` times ForageTorch's rows alone (a large-N GPU sweep need not time NumPy at
    every size; ``ratio_vs_py`` is then None). ``fastest`` says which vectorized
    implementation leads at each N. A stop signal (under
    :func:`labkit.signals.stop_signals`, or a Ctrl-C) after the first round keeps the rounds
    that finished: ``repeats`` counts them and ``interrupted`` names the signal."""
    dev = resolve_device(device)
    check_int("repeats", repeats, 1, 1000)
    check_int("warmup", warmup, 0)
    check_int("loop_envs", loop_envs, 1)
    check_int("episodes", episodes, 1)
    check_int("compile_loop", compile_loop, 1)
    spec = spec if spec is not None else ForageSpec()
    sizes = _sizes(n_envs, dev)
    steps = episodes * spec.episode_length
    if compiled and compile_loop > 1 and (steps % compile_loop or warmup % compile_loop):
        raise ValueError(f"compile_loop must divide the steps per sample ({steps}) and "
                         f"warmup ({warmup}), got {compile_loop}")
    plan = _plan(sizes, loop_envs, compiled, compile_loop, dev, torch_only)
    _check_fits(plan, steps + warmup, dev)
    runners = [_runner(impl, n, spec, dev, steps + warmup, seed, c, scalar)
               for impl, n, c, scalar in plan]
    done, interrupted = _rounds(runners, steps, warmup, repeats, dev)
    rows = _rows(runners, steps)
    return {
        "meta": run_metadata(dev),
        "rows": rows,
        "fastest": _fastest(rows),
        "repeats": done,
        **({"interrupted": interrupted, "repeats_planned": repeats} if interrupted else {}),
        "warmup_steps": warmup,
        "steps_per_sample": steps,
        "threads": torch.get_num_threads(),
        "spec": vars(spec),
        **({"torch_only": True} if torch_only else {}),
    }


def format_table(result: dict) -> str:
    """The rows of ``bench_envs`` as a fixed-width text table under a line saying where, and
    a line per N saying which implementation is fastest and by how much."""
    m = result["meta"]
    lines = [f"Forage env-steps/s on {m['device']} ({m['device_name']}), torch {m['torch']}, "
             f"{result.get('threads', '?')} thread(s), median of {result['repeats']} rounds of "
             f"{result.get('steps_per_sample', '?')} steps", tables.ENVS.text(result["rows"])]
    for n, f in (result.get("fastest") or {}).items():
        lead = f" ({f['lead']:.2f}x {f['next']})" if f.get("lead") else ""
        lines.append(f"N={n}: fastest {f['impl']}{lead}")
    if result.get("interrupted"):
        lines.append(f"PARTIAL: interrupted by {result['interrupted']} after "
                     f"{result['repeats']} of {result['repeats_planned']} rounds")
    return "\n".join(lines)


#: ForageTorch.step by part: the method that does each.
STEP_PARTS = {"move": "_walk", "hash and reward": "_placements", "find cells, write": "_place",
              "episode end": "_end_episodes", "observation": "observation"}


def _step_by_parts(env: ForageTorch, actions: torch.Tensor,
                   part: Callable[..., object]) -> tuple:
    """``env.step(actions)`` as ``ForageTorch.step`` writes it, with each call of a part of
    ``STEP_PARTS`` made through ``part(name, method, *args)``: the parts are timed where they
    are called, and the env is left as it is (a test holds this to ``ForageTorch.step``: the
    same outputs and state, step for step)."""
    actions = check_actions(actions, env.n_envs, env.device, in_range=False)
    cell = part("move", env._walk, actions)
    reward, passes = part("hash and reward", env._placements, cell)
    for n, values, column in passes:
        col = part("find cells, write", env._place, n, values)
        env._next_pos.scatter_(1, column, col[1])
    truncated, info = part("episode end", env._end_episodes, reward)
    obs = part("observation", env.observation)
    if env.final_obs:
        info["final_observation"] = torch.where(truncated.view(-1, 1, 1, 1),
                                                info["final_observation"], obs)
    return obs, reward, torch.zeros_like(truncated), truncated, info


def step_parts(env: ForageTorch, steps: int | None = None, seed: int = 0) -> dict:
    """Where a ``ForageTorch.step`` goes: each part of ``STEP_PARTS`` timed on the host over
    ``steps`` steps with random actions (default: one whole episode, so the share of the
    layout work is exact), each through :func:`labkit.timing.timed` where the step calls it
    (a device sync on both sides: on a GPU the syncs serialize the queue, so read shares, not
    speed). ``other`` is the rest of the step (the action check, Python between the parts, the
    timing itself)."""
    if type(env).step is not ForageTorch.step:
        raise TypeError(f"step_parts times ForageTorch.step; {type(env).__name__} has its own")
    dev, steps = env.device, steps or env.spec.episode_length
    check_int("steps", steps, 1)
    gen = torch.Generator(dev).manual_seed(seed)
    actions = torch.randint(0, N_ACTIONS, (steps + 1, env.n_envs), generator=gen, device=dev)
    spent = dict.fromkeys(STEP_PARTS, 0.0)

    def part(name: str, method: Callable, *args: object) -> object:
        seconds, out = timed(lambda: method(*args), dev)
        spent[name] += seconds
        return out

    _step_by_parts(env, actions[-1], part)  # warm up, then count from zero
    spent.update(dict.fromkeys(spent, 0.0))

    def run() -> None:
        for a in actions[:steps]:
            _step_by_parts(env, a, part)
    total, _ = timed(run, dev)
    parts = {name: s / steps for name, s in spent.items()}
    parts["other"] = total / steps - sum(parts.values())
    return {"n_envs": env.n_envs, "device": str(dev), "steps": steps,
            "step_s": total / steps, "parts_s": parts}


def format_parts(result: dict) -> str:
    """``step_parts`` as lines: microseconds per step and share of the step, by part."""
    step = result["step_s"]
    lines = [f"ForageTorch.step at N={result['n_envs']} on {result['device']}: "
             f"{1e6 * step:,.0f} us per step (mean of {result['steps']} steps)"]
    lines += [f"  {part:<20} {1e6 * s:>8,.0f} us  {100 * s / step:5.1f}%"
              for part, s in result["parts_s"].items()]
    return "\n".join(lines)
