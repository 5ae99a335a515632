"""Env-steps per second of the four Forage implementations with random actions."""
from __future__ import annotations

import gc
import signal
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import CodeType

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
        fn = torch.compile(env.step, fullgraph=True,
                           options={"cpp.simdlen": 0} if scalar else None)
        compile_s, _ = timed(lambda: fn(t_actions[0]), device)  # the first call compiles
        env.reset()
        return _Runner(impl + ("+compile scalar" if scalar else "+compile"), n,
                       lambda i: fn(t_actions[i % n_actions]), ops=ops, compile_s=compile_s)

    def steps(chunk: torch.Tensor) -> None:
        for a in chunk:  # unrolled by torch.compile: one graph of `compiled` steps
            env.step(a)
    loop = torch.compile(steps, fullgraph=True)
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


def bench_envs(device: str | torch.device = "auto", repeats: int = 5,
               n_envs: Sequence[int] | None = None, *, spec: ForageSpec | None = None,
               loop_envs: int = 16, episodes: int = 1, compiled: bool = False,
               compile_loop: int = 4, warmup: int = 16, seed: int = 0) -> dict:
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
    ``fastest`` says which vectorized implementation leads at each N. A stop signal (under
    :func:`labkit.signals.stop_signals`, or a Ctrl-C) after the first round keeps the rounds
    that finished: ``repeats`` counts them and ``interrupted`` names the signal."""
    dev = resolve_device(device)
    check_int("repeats", repeats, 1, 1000)
    check_int("warmup", warmup, 0)
    check_int("loop_envs", loop_envs, 1)
    check_int("episodes", episodes, 1)
    check_int("compile_loop", compile_loop, 1)
    spec = spec if spec is not None else ForageSpec()
    sizes = tuple(n_envs) if n_envs is not None else \
        ((4096, 65536) if dev.type == "cuda" else (256, 1024, 4096))
    if not sizes:
        raise ValueError("n_envs must name at least one size")
    for n in sizes:
        check_n_envs(n)
    steps = episodes * spec.episode_length
    loops = (1, compile_loop) if compile_loop > 1 else (1,)
    if compiled and compile_loop > 1 and (steps % compile_loop or warmup % compile_loop):
        raise ValueError(f"compile_loop must divide the steps per sample ({steps}) and "
                         f"warmup ({warmup}), got {compile_loop}")
    plan = [("ForagePy", loop_envs, 0, False), ("ForageTorchLoop", loop_envs, 0, False)]
    plan += [(impl, n, 0, False) for n in sizes for impl in VECTORIZED]
    plan += [("ForageTorch", n, k, False) for n in sizes for k in loops] if compiled else []
    plan += [("ForageTorch", n, 1, True) for n in sizes] if compiled and dev.type == "cpu" \
        else []
    _check_fits(plan, steps + warmup, dev)
    runners = [_runner(impl, n, spec, dev, steps + warmup, seed, c, scalar)
               for impl, n, c, scalar in plan]
    done, interrupted = _rounds(runners, steps, warmup, repeats, dev)
    rows = []
    for r in runners:
        rates = sorted(r.n_envs * steps / s for s in r.samples)
        rows.append({"impl": r.impl, "n_envs": r.n_envs,
                     "steps_per_s": statistics.median(rates),
                     "steps_per_s_spread": [rates[0], statistics.median(rates), rates[-1]],
                     "samples_s": r.samples, "ops_per_step": r.ops, "compile_s": r.compile_s})
    py = rows[0]["steps_per_s"]
    for row in rows:
        row["ratio_vs_py"] = row["steps_per_s"] / py
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
    }


#: ForageTorch.step by part: the method that does each.
STEP_PARTS = {"move": "_walk", "hash and reward": "_hash", "find cells, write": "_place",
              "episode end": "_end_episodes", "observation": "observation"}


def _step_by_parts(env: ForageTorch, actions: torch.Tensor,
                   part: Callable[..., object]) -> tuple:
    """``env.step(actions)`` as ``ForageTorch.step`` writes it, with each call of a part of
    ``STEP_PARTS`` made through ``part(name, method, *args)``: the parts are timed where they
    are called, and the env is left as it is (a test holds this to ``ForageTorch.step``: the
    same outputs and state, step for step)."""
    actions = check_actions(actions, env.n_envs, env.device, in_range=False)
    cell = part("move", env._walk, actions)
    reward, passes = part("hash and reward", env._hash, cell)
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


# --------------------------------------------------------------------- NumPy or torch: where
# they cross. ForageNumpy skips its reset on a step where no episode ends (``if
# truncated.any():``); ForageTorch runs the same ops on every step. Which wins at a given N
# depends on how often a step has an episode end, so the envs are timed in three cases.

#: Where the envs' episodes stand when a step is timed.
CROSSOVER_CASES = ("no end", "every env ends", "out of phase")


def _numpy_module(name: str | None) -> bool:
    return (name or "").split(".")[0] == "numpy"


def _is_numpy(fn: object) -> bool:
    """A NumPy function, or a method of a NumPy object (``ndarray.cumsum``)."""
    if _numpy_module(getattr(fn, "__module__", None)):
        return True
    owner = getattr(fn, "__self__", None)
    return owner is not None and _numpy_module(type(owner).__module__)


def numpy_calls(fn: Callable[[], object]) -> Counter:
    """The NumPy functions and array methods one call of ``fn`` makes, by name, counted by a
    profile hook (``sys.setprofile``) where code outside NumPy calls them (what NumPy runs
    inside a call is part of that call; ``__array_function__`` dispatchers are not counted).
    Operators and indexing (``a + b``, ``a[i]``) and ufuncs called by name (``np.maximum``)
    are no calls the hook sees: they are left out, so this is a lower bound of the NumPy
    operations, and counts the same code the same way on every machine."""
    counts: Counter = Counter()
    depth = 0

    def hook(frame, event, arg) -> None:
        nonlocal depth
        if event in ("call", "return"):
            if not _numpy_module(frame.f_globals.get("__name__")):
                return
            if event == "return":
                depth -= 1
                return
            name = frame.f_code.co_name
            if depth == 0 and not name.endswith("_dispatcher"):
                counts[name] += 1
            depth += 1
        elif event == "c_call" and _is_numpy(arg):
            if depth == 0:
                counts[arg.__name__] += 1
            depth += 1
        elif event in ("c_return", "c_exception") and _is_numpy(arg):
            depth -= 1

    _profiled(fn, hook)
    return counts


def calls_of(code: CodeType, fn: Callable[[], object]) -> int:
    """How many times one call of ``fn`` runs the Python function whose code is ``code``
    (``ForageNumpy._new_episodes.__code__``), counted by a profile hook: nothing is patched."""
    count = 0

    def hook(frame, event, arg) -> None:
        nonlocal count
        if event == "call" and frame.f_code is code:
            count += 1

    _profiled(fn, hook)
    return count


def _profiled(fn: Callable[[], object], hook: Callable) -> None:
    """``fn()`` with ``hook`` as the profile hook (``sys.setprofile``), the previous one
    restored after."""
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(previous)


def state_at(env: ForageNumpy | ForageTorch, t: int | Sequence[int] | np.ndarray) -> dict:
    """``env.state_dict()`` with every env at step ``t`` of its episode: one int (the envs in
    lockstep) or one step per env. ``load_state_dict`` takes it (ForageTorch rebuilds the
    part of the next layout built ahead by then)."""
    state = env.state_dict()
    steps = torch.as_tensor(np.asarray(t), dtype=state["t"].dtype).expand_as(state["t"])
    state["t"] = steps.clone()
    return state


def out_of_phase_steps(n_envs: int, episode_length: int) -> np.ndarray:
    """Steps ``t_i = i * L // N``: the envs spread evenly over an episode of ``L`` steps, so
    ``min(N, L)`` of every ``L`` steps end some episode (in lockstep: 1 of ``L``)."""
    return np.arange(n_envs, dtype=np.int64) * episode_length // n_envs


def crossover(n_envs: Sequence[int] = (32, 256, 1024, 4096), *, spec: ForageSpec | None = None,
              steps: int = 8, repeats: int = 3, threads: int | None = 1,
              device: str | torch.device = "cpu", seed: int = 0) -> dict:
    """One step of ForageNumpy and one of ForageTorch (on ``device``), timed at each N of
    ``n_envs`` on ``threads`` torch threads (NumPy's step runs on one; None: torch's
    setting), in each of :data:`CROSSOVER_CASES`:

    * ``no end``: every env in mid-episode; ``steps`` steps in a row, none ends an episode;
    * ``every env ends``: every env one step before the end, reloaded (untimed) before each of
      ``steps`` timed steps;
    * ``out of phase``: the envs spread over the episode (:func:`out_of_phase_steps`);
      ``steps`` steps in a row, a share of them with an episode end (``end_share``).

    Each step is timed alone; a case's figure is the mean over its steps of each step's median
    over ``repeats`` rounds (:func:`_per_step`), the two envs taking turns in every round, and
    the garbage collector off while they run (as ``timeit`` does). ``samples_s`` keeps each
    round's seconds per step. ``lockstep_s`` is a step's mean over an episode of envs that
    start together and end together, as in the ladder (fixed-length episodes, all reset at
    once): ``L - 1`` steps with no end and one where every env ends."""
    dev = resolve_device(device)
    spec = spec if spec is not None else ForageSpec()
    check_int("steps", steps, 1)
    check_int("repeats", repeats, 1, 1000)
    sizes = tuple(n_envs)
    for n in sizes:
        check_n_envs(n)
    length = spec.episode_length
    mid = length // 2 - steps // 2  # `steps` steps from here end no episode (when they fit)
    if not 0 <= mid or mid + steps >= length:
        raise ValueError(f"steps ({steps}) must be shorter than half an episode ({length})")
    previous = torch.get_num_threads()
    if threads is not None:
        check_int("threads", threads, 1)
        torch.set_num_threads(threads)
    try:
        envs = _crossover_envs(sizes, spec, seed, steps, mid, dev)
        samples, ends = _crossover_rounds(envs, repeats, dev)
    finally:
        torch.set_num_threads(previous)
    rows = []
    for (impl, n), _ in envs.items():
        row = {"impl": impl, "n_envs": n,
               **{case: _per_step(samples[impl, n, case]) for case in CROSSOVER_CASES},
               "samples_s": {case: samples[impl, n, case] for case in CROSSOVER_CASES},
               "end_share": ends[impl, n] / steps}
        row["lockstep_s"] = ((length - 1) * row["no end"] + row["every env ends"]) / length
        rows.append(row)
    return {"meta": run_metadata(dev), "rows": rows, "threads": threads or previous,
            "steps": steps, "repeats": repeats, "episode_length": length, "mid_step": mid}


def _crossover_envs(sizes: tuple[int, ...], spec: ForageSpec, seed: int, steps: int, mid: int,
                    dev: torch.device) -> dict:
    """{(impl, N): (env, its ``steps`` actions, its state in each crossover case)}."""
    length, envs = spec.episode_length, {}
    for n in sizes:
        acts = np.random.default_rng(seed).integers(0, N_ACTIONS, (steps, n))
        for impl in ("ForageNumpy", "ForageTorch"):
            if impl == "ForageNumpy":
                env, actions = ForageNumpy(n, spec, seed), list(acts)
            else:
                env = ForageTorch(n, spec, seed=seed, device=dev)
                actions = list(torch.as_tensor(acts, device=dev))
            states = {"no end": state_at(env, mid),
                      "every env ends": state_at(env, length - 1),
                      "out of phase": state_at(env, out_of_phase_steps(n, length))}
            envs[impl, n] = (env, actions, states)
    return envs


def _crossover_rounds(envs: dict, repeats: int, dev: torch.device) -> tuple[dict, dict]:
    """Every env's steps in every case, timed in turn in each of ``repeats`` rounds after an
    untimed one, with the garbage collector off (as timeit does: a collection is no part of a
    step): the seconds per step by (impl, N, case), and each env's episode ends out of
    phase."""
    samples: dict[tuple[str, int, str], list[list[float]]] = {}
    ends: dict[tuple[str, int], int] = {}
    collecting = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats + 1):  # round 0 warms up, untimed
            for (impl, n), (env, actions, states) in envs.items():
                for case in CROSSOVER_CASES:
                    seconds, ended = _time_case(env, actions, states[case], case, dev)
                    if r:
                        samples.setdefault((impl, n, case), []).append(seconds)
                    if case == "out of phase":
                        ends[impl, n] = ended
    finally:
        if collecting:
            gc.enable()
    return samples, ends


def _per_step(rounds: list[list[float]]) -> float:
    """Mean over the timed steps of each step's median over the rounds: a step that the OS
    preempted in one round does not move it, and the share of steps with an episode end
    stays what it is."""
    return statistics.fmean(statistics.median(step) for step in zip(*rounds))


def _time_case(env: ForageNumpy | ForageTorch, actions: list, state: dict, case: str,
               device: torch.device) -> tuple[list[float], int]:
    """Seconds of each of ``len(actions)`` steps of ``env`` from ``state`` in ``case`` (in a
    row, or each from ``state`` for ``every env ends``; the loads are not timed), and how many
    of them ended an episode."""
    env.load_state_dict(state)
    seconds, ended = [], 0
    for a in actions:
        if case == "every env ends":
            env.load_state_dict(state)
        s, out = timed(lambda a=a: env.step(a), device)
        seconds.append(s)
        ended += bool(out[3].any())
    return seconds, ended


def crossings(result: dict) -> dict[str, dict]:
    """Per regime (``lockstep``: the ladder's envs; ``out of phase``): ForageNumpy's and
    ForageTorch's seconds per step at each N, the Ns where each is faster, and where they
    cross: ``torch_from``, the smallest N from which ForageTorch is faster at every larger N
    measured (None if it is not faster at the largest), and ``numpy_up_to``, the largest N
    where ForageNumpy is faster (None if nowhere)."""
    by = {(r["impl"], r["n_envs"]): r for r in result["rows"]}
    sizes = sorted({r["n_envs"] for r in result["rows"]})
    out = {}
    for regime, key in (("lockstep", "lockstep_s"), ("out of phase", "out of phase")):
        numpy_s = {n: by["ForageNumpy", n][key] for n in sizes}
        torch_s = {n: by["ForageTorch", n][key] for n in sizes}
        torch_wins = [n for n in sizes if torch_s[n] < numpy_s[n]]
        numpy_wins = [n for n in sizes if n not in torch_wins]
        torch_from = None
        for n in reversed(sizes):
            if n not in torch_wins:
                break
            torch_from = n
        out[regime] = {"numpy_s": numpy_s, "torch_s": torch_s, "torch_wins": torch_wins,
                       "numpy_wins": numpy_wins, "torch_from": torch_from,
                       "numpy_up_to": max(numpy_wins) if numpy_wins else None}
    return out


def format_crossover(result: dict) -> str:
    """``crossover`` as a table: microseconds per step in each case, and a step's mean over an
    episode in lockstep and out of phase."""
    m = result["meta"]
    lines = [f"one step on {m['device']} ({m['device_name']}), torch {m['torch']}, "
             f"{result['threads']} torch thread(s), NumPy 1; us per step: mean of "
             f"{result['steps']} steps, each the median of {result['repeats']} rounds",
             f"{'N':>5}  {'impl':<12}{'no end':>9}{'all end':>9}{'out of ph':>10}"
             f"   episode: {'lockstep':>9}{'out of ph':>10}"]
    for r in sorted(result["rows"], key=lambda r: (r["n_envs"], r["impl"])):
        lines.append(f"{r['n_envs']:>5}  {r['impl']:<12}{1e6 * r['no end']:>9,.0f}"
                     f"{1e6 * r['every env ends']:>9,.0f}{1e6 * r['out of phase']:>10,.0f}"
                     f"   {'':>9}{1e6 * r['lockstep_s']:>9,.0f}{1e6 * r['out of phase']:>10,.0f}")
    return "\n".join(lines)


def _where_they_cross(c: dict, sizes: list[int]) -> str:
    if not c["numpy_wins"]:
        return f"ForageTorch is faster at every N measured ({sizes[0]} to {sizes[-1]})"
    if not c["torch_wins"]:
        return f"ForageNumpy is faster at every N measured ({sizes[0]} to {sizes[-1]})"
    if c["torch_from"] is None:
        return (f"ForageTorch is faster at N={', '.join(map(str, c['torch_wins']))} but not "
                f"at the largest, {sizes[-1]}")
    below = [n for n in sizes if n < c["torch_from"]]
    tail = (f"ForageNumpy at N={below[-1]} and below" if below and
            all(n in c["numpy_wins"] for n in below) else
            f"ForageNumpy at N={', '.join(map(str, c['numpy_wins']))}")
    return f"ForageTorch is faster from N={c['torch_from']} on, {tail}"


def crossover_lines(result: dict, torch_ops: int | None = None) -> list[str]:
    """The chapter's sentences about ``crossover``, each computed from it: where the two envs
    cross in lockstep and out of phase, what an episode end costs each at the smallest N, what
    NumPy's skipped reset is worth there, and (given ``torch_ops``, ForageTorch's non-view
    ops per step) ForageTorch's time per op."""
    c = crossings(result)
    sizes = sorted({r["n_envs"] for r in result["rows"]})
    by = {(r["impl"], r["n_envs"]): r for r in result["rows"]}
    small, length, us = sizes[0], result["episode_length"], 1e6
    npy, trc = by["ForageNumpy", small], by["ForageTorch", small]
    lines = [f"In lockstep (the ladder's envs: every episode ends on the same step, 1 step in "
             f"{length}): {_where_they_cross(c['lockstep'], sizes)}.",
             f"Out of phase (the envs spread over the episode): "
             f"{_where_they_cross(c['out of phase'], sizes)}.",
             f"At N={small}: ForageNumpy's step takes {us * npy['no end']:,.0f} us with no "
             f"episode end and {us * npy['every env ends']:,.0f} us when the episodes end "
             f"(x{npy['every env ends'] / npy['no end']:.1f}); ForageTorch's "
             f"{us * trc['no end']:,.0f} and {us * trc['every env ends']:,.0f} us "
             f"(x{trc['every env ends'] / trc['no end']:.1f}, the same ops)."]
    if torch_ops:
        lines.append(f"At N={small}, ForageTorch's {torch_ops} non-view ops per step take "
                     f"{us * trc['no end'] / torch_ops:.1f} us each, everything around them "
                     f"included (views, allocations, Python); ForageNumpy's whole step with no "
                     f"end takes as long as {npy['no end'] / trc['no end'] * torch_ops:.0f} "
                     "of them.")
    skip = ("pays" if npy["lockstep_s"] < npy["out of phase"] else "does not pay")
    lines.append(f"At N={small}, ForageNumpy averages {us * npy['lockstep_s']:,.0f} us per step "
                 f"over a lockstep episode and {us * npy['out of phase']:,.0f} us out of phase, "
                 f"where {100 * npy['end_share']:.0f}% of its steps end some episode: "
                 f"its skipped reset {skip} here.")
    full = [n for n in sizes if by["ForageNumpy", n]["end_share"] == 1]
    if full:
        n = full[0]
        r = by["ForageNumpy", n]
        lines.append(f"From N={n} on, out of phase every step ends some episode: at N={n} "
                     f"ForageNumpy takes {us * r['out of phase']:,.0f} us per step against "
                     f"{us * r['lockstep_s']:,.0f} in lockstep "
                     f"(x{r['out of phase'] / r['lockstep_s']:.1f}).")
    return lines


#: The cases of :func:`step_ops`: which episodes end on the step that is counted.
OPS_CASES = ("no end", "one env ends", "every env ends")


def step_ops(n_envs: int = 8, spec: ForageSpec | None = None, seed: int = 0,
             device: str | torch.device = "cpu") -> dict:
    """The ops of one step of ForageNumpy (NumPy calls, :func:`numpy_calls`) and of
    ForageTorch (non-view aten ops, ``profiling.dispatch_ops``), from a state in each of
    :data:`OPS_CASES` (every env in mid-episode; env 0 at its last step; every env at its
    last step), and how many times ForageNumpy's reset (``_new_episodes``) ran in each."""
    dev = resolve_device(device)
    spec = spec if spec is not None else ForageSpec()
    length = spec.episode_length
    ends = {"no end": np.full(n_envs, length // 2),
            "one env ends": np.r_[length - 1, np.full(n_envs - 1, length // 2)],
            "every env ends": np.full(n_envs, length - 1)}
    actions = np.random.default_rng(seed).integers(0, N_ACTIONS, n_envs)
    out: dict = {"ForageNumpy": {}, "ForageTorch": {}, "numpy_resets": {}}
    numpy_env = ForageNumpy(n_envs, spec, seed)
    torch_env = ForageTorch(n_envs, spec, seed=seed, device=dev)
    reset = type(numpy_env)._new_episodes.__code__
    torch_actions = torch.as_tensor(actions, device=dev)
    for case, t in ends.items():
        numpy_env.load_state_dict(state_at(numpy_env, t))
        out["ForageNumpy"][case] = numpy_calls(lambda: numpy_env.step(actions))
        numpy_env.load_state_dict(state_at(numpy_env, t))  # the same step again, its resets
        out["numpy_resets"][case] = calls_of(reset, lambda: numpy_env.step(actions))
        torch_env.load_state_dict(state_at(torch_env, t))
        out["ForageTorch"][case] = dispatch_ops(lambda: torch_env.step(torch_actions))
    return out


def op_census(fn: Callable[[], object], device: str | torch.device,
              setup: Callable[[], object] | None = None) -> dict:
    """One call of ``fn`` counted two ways, and how the counts relate (``setup`` runs,
    uncounted, before each): ``profiler``, every aten event ``torch.profiler`` records
    (``profiling.op_counts``); ``dispatched``, the non-view ops ``profiling.dispatch_ops``
    counts (the env bench's ops/step); ``views``, the profiler's events of ops whose schema
    may return an alias of an input (``select``, ``unsqueeze``, ``as_strided``, ``to``); and
    ``inside``, the rest of the profiler's events: calls made inside another op or by a
    wrapper op (``empty``, ``copy_``, ``__xor__`` calling ``bitwise_xor``). ``covered``: every
    dispatched op is among the profiler's events (so profiler = dispatched + views + inside).
    Each count is a Counter by name; ``totals`` sums them."""
    from .profiling import op_counts, profile_calls

    dev = resolve_device(device)
    if setup:
        setup()
    events = op_counts(profile_calls(fn, dev))
    if setup:
        setup()
    dispatched = dispatch_ops(fn)
    views: Counter = Counter()
    inside: Counter = Counter()
    for name, count in events.items():
        if _may_alias(name):
            views[name] += count
        else:
            left = count - dispatched.get(name.removeprefix("aten::"), 0)
            if left > 0:
                inside[name] += left
    covered = all(events.get(f"aten::{name}", 0) >= count for name, count in dispatched.items())
    parts = {"profiler": events, "dispatched": dispatched, "views": views, "inside": inside}
    return {**parts, "covered": covered,
            "totals": {key: sum(c.values()) for key, c in parts.items()}}


def _may_alias(name: str) -> bool:
    """Does an overload of the aten op ``name`` (``aten::select``) return an alias?"""
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    try:
        return packet is not None and any(getattr(packet, o).is_view for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return False
