"""NumPy or torch: where ForageNumpy and ForageTorch cross over (chapter 04).

ForageNumpy skips its reset on a step where no episode ends (``if truncated.any():``);
ForageTorch runs the same ops on every step. Which wins at a given N depends on how often a
step has an episode end, so :func:`crossover` times one step of each in three cases
(:data:`CROSSOVER_CASES`), :func:`crossings` finds where they cross and
:func:`crossover_lines` says it; :func:`step_ops` counts the ops of one step of each
(NumPy calls by :func:`numpy_calls`, aten ops by :func:`labkit.measure.profiling.dispatch_ops`);
:func:`state_at` puts the envs at any step of their episodes."""
from __future__ import annotations

import gc
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from types import CodeType

import numpy as np
import torch

from ..device import resolve_device, run_metadata
from ..envs.numpy import ForageNumpy
from ..envs.spec import N_ACTIONS, ForageSpec, check_n_envs
from ..envs.torch import ForageTorch
from ..timing import timed
from ..validate import check_int
from .profiling import dispatch_ops

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
