"""What one ``log`` call costs the training thread, per logger: a loop of small torch ops (about a
rollout step's worth at N=64 on a CPU) timed alone, with a ``SyncLogger`` and with an
``AsyncLogger`` logging one 0-d tensor per step (each logger closed, its records written,
after the timing). Prints microseconds per step, and each logger's extra over the bare loop.

    python scripts/logger_cost.py [steps] [rounds]

Run it at two commits to compare two versions of a logger (the AsyncLogger writer's rest
between bursts was measured this way: about 110 us a call before, about 30 after, 2-core CPU).
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from labkit.logging import AsyncLogger, SyncLogger

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
folder = Path(tempfile.mkdtemp(prefix="logger-cost-"))
x = torch.randn(64)


def work() -> torch.Tensor:
    y = x
    for _ in range(60):
        y = y * 1.0001 + 0.1
    return y.mean()


def per_step_us(make) -> float:
    logger = make()
    start = time.perf_counter()
    for step in range(steps):
        value = work()
        if logger is not None:
            logger.log(step, reward=value)
    seconds = time.perf_counter() - start
    if logger is not None:
        logger.close()
    return 1e6 * seconds / steps


makers = {"none": lambda: None,
          "SyncLogger": lambda: SyncLogger(folder / "sync.jsonl"),
          "AsyncLogger": lambda: AsyncLogger(folder / "async.jsonl")}
times = {name: [] for name in makers}
for _ in range(rounds):  # interleaved
    for name, make in makers.items():
        times[name].append(per_step_us(make))
bare = statistics.median(times["none"])
print(f"{steps} steps, {rounds} interleaved rounds, torch {torch.__version__}, "
      f"{torch.get_num_threads()} thread(s); microseconds per step, median [min-max]")
for name, t in times.items():
    extra = "" if name == "none" else f", +{statistics.median(t) - bare:.0f} for the log call"
    print(f"  {name:<12} {statistics.median(t):7.1f} [{min(t):.1f}-{max(t):.1f}]{extra}")
