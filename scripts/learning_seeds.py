"""Does the production stage learn as well when it keeps eager or compiled by timing as when it
always compiles? Three seeds each, the learning record's budget (262,144 env steps, N=64,
T=32), final mean returns with their mean and standard deviation.

    python scripts/learning_seeds.py [SEEDS ...]
"""
from __future__ import annotations

import statistics
import sys
import tempfile

from labkit.app.train import TrainConfig, train


def main(seeds: list[int]) -> None:
    finals: dict[str, list[float]] = {}
    for compile_ in ("compiled", "auto"):
        for seed in seeds:
            cfg = TrainConfig.flat(stage="fused_amp", device="cpu", n_envs=64, n_steps=32,
                                   total_steps=262_144, seed=seed, compile=compile_,
                                   checkpoint_every=0)
            with tempfile.TemporaryDirectory() as out:
                s = train(cfg, f"{out}/run", progress=False)
            finals.setdefault(compile_, []).append(s["final_mean_return"])
            print(f"compile={compile_} seed {seed}: final mean return "
                  f"{s['final_mean_return']:.3f}, model math {s['model_math']}", flush=True)
    for compile_, values in finals.items():
        sd = f"{statistics.stdev(values):.3f}" if len(values) > 1 else "n/a (one seed)"
        print(f"compile={compile_}: mean {statistics.mean(values):.3f}, sd {sd} over seeds "
              f"{seeds}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 3])
