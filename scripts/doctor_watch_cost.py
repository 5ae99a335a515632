"""What the doctor's watched iteration costs: one eager iteration of stage 7 (N=16, T=16, on
the CPU) under the doctor's meters against the same iteration with none, 7 interleaved rounds.

    python scripts/doctor_watch_cost.py                 # this checkout
    git worktree add /tmp/old 09ab7c5^ && python scripts/doctor_watch_cost.py /tmp/old
                                                        # the doctor before it counted through
                                                        # labkit.watch (meters.Watch)
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit.capture import warmup  # noqa: E402
from labkit.config import RunConfig  # noqa: E402
from labkit.stages import Pipeline, get_stage  # noqa: E402

try:
    from labkit.doctor.checkup import watched  # noqa: E402
except ImportError:  # before 09ab7c5
    from labkit.doctor.meters import watched  # noqa: E402

if not labkit.__file__.startswith(str(root)):
    sys.exit(f"imported labkit from {labkit.__file__}, not {root}")
cfg = RunConfig(n_envs=16, n_steps=16, compile="compiled", conv_math="conv2d")
with Pipeline(get_stage("fused_amp"), cfg, torch.device("cpu")) as pipe:
    warmup(pipe)

    def plain() -> None:
        with torch.compiler.set_stance("force_eager"):
            pipe.learn(pipe.rollout())

    plain()
    watched(pipe)
    eager, metered = [], []
    for _ in range(7):
        t = time.perf_counter()
        plain()
        eager.append(time.perf_counter() - t)
        t = time.perf_counter()
        watched(pipe)
        metered.append(time.perf_counter() - t)
e, m = statistics.median(eager), statistics.median(metered)
print(f"{root}: eager iteration {1e3 * e:.0f} ms (min {1e3 * min(eager):.0f}), watched "
      f"{1e3 * m:.0f} ms (min {1e3 * min(metered):.0f}): {m / e:.2f}x")
