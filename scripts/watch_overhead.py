"""What ``labkit.watch`` costs: Stable-Baselines3's PPO timed plain, watched, and under a
dispatch mode that does nothing (the floor of any meter that sees each op from Python), in
interleaved rounds on one thread; medians with the min-max spread.

    python scripts/watch_overhead.py [--env CartPole-v1] [--steps 2048] [--rounds 5]

Needs the ``sb3`` extra. A benchmark, not a test: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import watch


class _Nothing(TorchDispatchMode):
    """Sees each op and does nothing: what torch's Python dispatch alone costs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _learn(env: str, steps: int, how: str) -> float:
    from stable_baselines3 import PPO

    import labkit.envs.gym  # noqa: F401 - registers labkit/Forage-v0

    model = PPO("MlpPolicy", env, n_steps=512, batch_size=64, n_epochs=4, seed=0,
                device="cpu", verbose=0)
    start = time.perf_counter()
    if how == "plain":
        model.learn(steps)
    elif how == "watched":
        with watch():
            model.learn(steps)
    else:
        with _Nothing():
            model.learn(steps)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ("plain", "watched", "nothing")
    _learn(args.env, 512, "watched")  # imports and first calls off the clock
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            times[kind].append(_learn(args.env, args.steps, kind))
    plain = statistics.median(times["plain"])
    print(f"SB3 PPO('MlpPolicy', {args.env!r}, n_steps=512, batch_size=64, n_epochs=4)"
          f".learn({args.steps}), 1 thread, {args.rounds} interleaved rounds, "
          f"torch {torch.__version__}")
    for kind in kinds:
        found = times[kind]
        print(f"  {kind:<8} median {statistics.median(found):.3f} s (min {min(found):.3f}, "
              f"max {max(found):.3f})  {statistics.median(found) / plain:.2f}x plain")


if __name__ == "__main__":
    main()
