"""Does the production stage learn as well whichever way a warmup choice goes? Three seeds
each, the learning record's budget (262,144 env steps, N=64, T=32), final mean returns with
their mean and standard deviation, for each forced value of one choice:

* ``compile`` (default): always compiled, against kept by timing (``auto``);
* ``conv_math``: the convolutions as conv2d, against as one matmul each (both parts, forced).

    python scripts/learning_seeds.py [--choice compile|conv_math] [SEEDS ...]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

from labkit.app.train import TrainConfig, train

VALUES = {"compile": ("compiled", "auto"), "conv_math": ("conv2d", "matmul")}


def main(choice: str, seeds: list[int]) -> None:
    finals: dict[str, list[float]] = {}
    for value in VALUES[choice]:
        for seed in seeds:
            cfg = TrainConfig.flat(stage="fused_amp", device="cpu", n_envs=64, n_steps=32,
                                   total_steps=262_144, seed=seed, checkpoint_every=0,
                                   **{choice: value})
            with tempfile.TemporaryDirectory() as out:
                s = train(cfg, f"{out}/run", progress=False)
            finals.setdefault(value, []).append(s["final_mean_return"])
            print(f"{choice}={value} seed {seed}: final mean return "
                  f"{s['final_mean_return']:.3f}, model math {s['model_math']}", flush=True)
    for value, found in finals.items():
        sd = f"{statistics.stdev(found):.3f}" if len(found) > 1 else "n/a (one seed)"
        print(f"{choice}={value}: mean {statistics.mean(found):.3f}, sd {sd} over seeds "
              f"{seeds}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--choice", choices=tuple(VALUES), default="compile")
    p.add_argument("seeds", type=int, nargs="*", default=[1, 2, 3])
    args = p.parse_args()
    main(args.choice, args.seeds)
