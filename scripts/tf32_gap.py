"""How far apart stage 4's (eager) and stage 5's (compiled) rollout values are on a GPU, with
cuDNN's float32 convolutions as TF32 (torch's default) and without:

    python scripts/tf32_gap.py        # a CUDA machine; PYTHONPATH=. where labkit isn't installed

Measured on an H200 (torch 2.11.0+cu130, N=1024, T=128): the obs, actions, rewards and dones
bit-exact both ways; values up to 3.79e-4 apart with TF32 convolutions, 4.17e-7 without
(results/GPU-RUNS.md). labkit.precision.TF32_TOLERANCE is set from it."""
from __future__ import annotations

import torch

from labkit.config import RunConfig
from labkit.stages import Pipeline, get_stage


def main() -> None:
    if not torch.cuda.is_available():
        print("skipped: needs CUDA")
        return
    device = torch.device("cuda")
    run = RunConfig(n_envs=1024, n_steps=128)
    saved = torch.backends.cudnn.allow_tf32
    try:
        for tf32 in (True, False):
            torch.backends.cudnn.allow_tf32 = tf32
            with Pipeline(get_stage("async_logging"), run, device) as p4, \
                    Pipeline(get_stage("compile_warmup"), run, device) as p5:
                r4 = {k: v.clone() for k, v in p4.collect().tensors().items()}
                r5 = {k: v.clone() for k, v in p5.collect().tensors().items()}
            same = all(torch.equal(r4[k], r5[k]) for k in ("obs", "actions", "rewards", "dones"))
            gap = (r4["values"] - r5["values"]).abs()
            print(f"cudnn.allow_tf32={tf32}: obs/actions/rewards/dones bit-exact {same}; values "
                  f"up to {gap.max().item():.2e} apart (|values| up to "
                  f"{r4['values'].abs().max().item():.2e})")
    finally:
        torch.backends.cudnn.allow_tf32 = saved


if __name__ == "__main__":
    main()
