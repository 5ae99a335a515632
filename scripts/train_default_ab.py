"""Which stage finishes ``python -m labkit train``'s default run first on this CPU, timed as
whole processes: each stage's command started in turn (A B A B ...), from the process's start
to its exit, set-up included, and what each run's ``summary.json`` says of its set-up
(``setup_s``), its training time (``wall_s``) and its rate. What
``labkit.stages.DEFAULT_STAGE["cpu"]`` is chosen by; a test holds the constant to the file.

    python scripts/train_default_ab.py --out results     # 3 rounds, inductor's cache as it is
    python scripts/train_default_ab.py --fresh-cache     # each compiling run in an empty cache

``--fresh-cache`` gives every run its own empty ``TORCHINDUCTOR_CACHE_DIR``: what a first run
on a new machine meets. Without it the runs share the user's cache, warmed by the round the
script runs first and does not count. Writes ``train_default_cpu.json`` (``--fresh-cache``:
``train_default_cpu_fresh.json``) in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from labkit.device import run_metadata

STAGES = ("fused_amp", "numpy_vec")


def run_once(stage: str, fresh_cache: bool) -> dict:
    """One whole ``train`` process with default settings but ``--stage``; its seconds from the
    outside and its summary's."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if fresh_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor-cache")
        # --fresh-choices: every run times its warm-up choices, as these files were recorded
        # before runs remembered them (labkit.app.remembered)
        cmd = [sys.executable, "-m", "labkit", "train", "--no-progress", "--fresh-choices",
               "--stage", stage, "--out", str(Path(tmp) / "run")]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        process_s = time.perf_counter() - start
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"process_s": process_s, "setup_s": summary["setup_s"], "wall_s": summary["wall_s"],
            "steps": summary["steps"], "steps_per_s": summary["steps_per_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fresh-cache", action="store_true")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    if not args.fresh_cache:  # the cache warmed, not counted
        for stage in STAGES:
            run_once(stage, False)
    runs: dict[str, list[dict]] = {s: [] for s in STAGES}
    for r in range(args.rounds):
        for stage in STAGES if r % 2 == 0 else STAGES[::-1]:
            runs[stage].append(run_once(stage, args.fresh_cache))
            print(stage, {k: round(v, 1) for k, v in runs[stage][-1].items()}, flush=True)
    result = {"meta": run_metadata(torch.device("cpu")), "fresh_cache": args.fresh_cache,
              "command": "python -m labkit train --no-progress --fresh-choices --stage STAGE "
                         "--out DIR",
              "stages": {s: {"process_s_median": statistics.median(x["process_s"] for x in rs),
                             "process_s_spread": [min(x["process_s"] for x in rs),
                                                  max(x["process_s"] for x in rs)],
                             "runs": rs} for s, rs in runs.items()}}
    name = "train_default_cpu_fresh.json" if args.fresh_cache else "train_default_cpu.json"
    path = Path(args.out) / name
    path.write_text(json.dumps(result, indent=1) + "\n")
    for s, found in result["stages"].items():
        lo, hi = found["process_s_spread"]
        print(f"{s}: {found['process_s_median']:.1f} s ({lo:.1f}-{hi:.1f}) whole process")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
