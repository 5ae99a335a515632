"""The recipe's env (examples/ppo_forage.py's Forage) against labkit's ForageTorch: env steps/s
of 128 steps with the same random actions, in interleaved rounds, medians and min-max.

    python scripts/recipe_env_bench.py [N ...]      # default 256 4096, 2 threads
"""
from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from labkit.envs import ForageSpec, ForageTorch

ROUNDS, STEPS = 5, 128


def main(argv: list[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "ppo_forage.py"
    spec = importlib.util.spec_from_file_location("ppo_forage", path)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["ppo_forage"] = recipe
    spec.loader.exec_module(recipe)
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    for n in [int(a) for a in argv] or [256, 4096]:
        envs = {"recipe Forage": recipe.Forage(recipe.Args(n_envs=n, device="cpu"), cpu),
                "labkit ForageTorch": ForageTorch(n, ForageSpec(), seed=1)}
        gen = torch.Generator().manual_seed(0)
        actions = [torch.randint(0, 5, (n,), generator=gen) for _ in range(STEPS)]
        seconds: dict[str, list[float]] = {name: [] for name in envs}
        for _ in range(ROUNDS):
            for name, env in envs.items():
                start = time.perf_counter()
                for a in actions:
                    env.step(a)
                seconds[name].append(time.perf_counter() - start)
        line = [f"{name} {n * STEPS / statistics.median(s):,.0f} env steps/s "
                f"({n * STEPS / max(s):,.0f}-{n * STEPS / min(s):,.0f})"
                for name, s in seconds.items()]
        print(f"N={n}, 2 threads, {ROUNDS} rounds: " + "; ".join(line))


if __name__ == "__main__":
    main(sys.argv[1:])
