"""Env-steps per second of the four Forage implementations with random actions."""
from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
import torch

from ..device import resolve_device, run_metadata, synchronize
from ..envs.numpy import ForageNumpy
from ..envs.python import ForagePy
from ..envs.spec import N_ACTIONS, ForageSpec
from ..envs.torch import ForageTorch
from ..envs.torch_loop import ForageTorchLoop
from ..timing import timed
from ..validate import check_int
from . import tables

IMPLS = ("ForagePy", "ForageNumpy", "ForageTorchLoop", "ForageTorch")


def _time(step: Callable[[int], None], steps: int, warmup: int, repeats: int,
          device: torch.device) -> list[float]:
    """Seconds per repeat of ``steps`` calls of ``step(i)``, after ``warmup`` untimed calls."""
    for i in range(warmup):
        step(i)
    synchronize(device)
    def repeat() -> None:
        for i in range(steps):
            step(i)

    return [timed(repeat, device)[0] for _ in range(repeats)]


def _runners(spec: ForageSpec, device: torch.device, sizes: dict[str, int], n_actions: int,
             seed: int) -> dict[str, tuple[int, Callable[[int], None]]]:
    """Per implementation: (n_envs, step(i)) with the actions drawn beforehand."""
    rng = np.random.default_rng(seed)
    runners = {}

    n = sizes["ForagePy"]
    envs = [ForagePy(spec, seed=seed, env_index=i) for i in range(n)]
    py_actions = rng.integers(0, N_ACTIONS, (n_actions, n)).tolist()

    def step_py(i: int) -> None:
        for env, a in zip(envs, py_actions[i % n_actions], strict=True):
            env.step(a)
    runners["ForagePy"] = (n, step_py)

    n = sizes["ForageNumpy"]
    np_env = ForageNumpy(n, spec, seed)
    np_actions = rng.integers(0, N_ACTIONS, (n_actions, n))
    runners["ForageNumpy"] = (n, lambda i: np_env.step(np_actions[i % n_actions]))

    for cls in (ForageTorchLoop, ForageTorch):
        n = sizes[cls.__name__]
        env = cls(n, spec, seed=seed, device=device)
        gen = torch.Generator(device).manual_seed(seed)
        actions = torch.randint(0, N_ACTIONS, (n_actions, n), generator=gen, device=device)
        runners[cls.__name__] = (n, lambda i, env=env, actions=actions:
                                 env.step(actions[i % n_actions]))
    return runners


def bench_envs(device: str | torch.device = "auto", repeats: int = 5,
               spec: ForageSpec | None = None, sizes: dict[str, int] | None = None,
               steps: dict[str, int] | None = None, warmup: int = 10, seed: int = 0) -> dict:
    """Median env-steps/s over ``repeats`` timed runs per implementation, warmup excluded.

    ``sizes`` / ``steps`` override the number of envs / timed steps per repeat of each
    implementation (keys: ForagePy, ForageNumpy, ForageTorchLoop, ForageTorch); by default
    one episode (``spec.episode_length`` steps) per repeat, 32 steps for ForageTorch on a CPU."""
    dev = resolve_device(device)
    check_int("repeats", repeats, 1)
    check_int("warmup", warmup, 0)
    spec = spec if spec is not None else ForageSpec()
    cuda = dev.type == "cuda"
    sizes = {"ForagePy": 16, "ForageNumpy": 1024, "ForageTorchLoop": 16,
             "ForageTorch": 65536 if cuda else 4096, **(sizes or {})}
    # Whole episodes per repeat, so each timed repeat holds the same share of resets; ForageTorch
    # does the reset work on every step (branch-free), so fewer steps are as fair on the CPU.
    steps = {**dict.fromkeys(sizes, spec.episode_length),
             "ForageTorch": spec.episode_length if cuda else 32, **(steps or {})}
    for name in {**sizes, **steps}:
        if name not in IMPLS:
            raise ValueError(f"sizes and steps keys must be among {IMPLS}, got {name!r}")
        check_int(f"sizes[{name!r}]", sizes[name], 1)
        check_int(f"steps[{name!r}]", steps[name], 1)
    runners = _runners(spec, dev, sizes, max(steps.values()) + warmup, seed)

    rows = []
    for impl, (n, step) in runners.items():
        seconds = _time(step, steps[impl], warmup, repeats, dev)
        rows.append({"impl": impl, "n_envs": n,
                     "steps_per_s": n * steps[impl] / statistics.median(seconds)})
    py = rows[0]["steps_per_s"]
    for row in rows:
        row["ratio_vs_py"] = row["steps_per_s"] / py
    return {
        "meta": run_metadata(dev),
        "rows": rows,
        "repeats": repeats,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "spec": vars(spec),
    }


def format_table(result: dict) -> str:
    """The rows of ``bench_envs`` as a fixed-width text table under a line saying where."""
    m = result["meta"]
    return (f"Forage env-steps/s on {m['device']} ({m['device_name']}), torch {m['torch']}, "
            f"median of {result['repeats']}\n" + tables.ENVS.text(result["rows"]))
