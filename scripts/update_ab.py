"""An older reference agent against the current one, in one process, on this CPU: one
minibatch step (PPO loss forward and backward, grad clip, Adam) of the conv body with
``conv_math="matmul"`` under bf16 autocast, eager and compiled, interleaved rounds. The older
agent is read from git into an untracked module first:

    git show 030a045:labkit/policy.py > labkit/_old_policy.py
    python scripts/update_ab.py 512 4096        # minibatch sizes, on 2 threads
    rm labkit/_old_policy.py                    # record refuses untracked code

030a045 built each dense matrix as the convolution of the identity (a conv forward and a
conv backward per step); the current agent gathers it (``labkit.policy.Placed``).
Prints median [min-max] ms of 15 rounds per variant.
"""
import statistics
import sys
from functools import partial

import torch

from labkit import _old_policy as old
from labkit import policy
from labkit.executors import Compiled
from labkit.measure.updatebench import _minibatch
from labkit.ppo import PPOConfig, minibatch_step, ppo_loss
from labkit.precision import Precision
from labkit.timing import timed
from labkit.update import Adam

torch.set_num_threads(2)
cfg, dev = PPOConfig(), torch.device("cpu")
for n in map(int, sys.argv[1:] or ["512", "4096"]):
    mb = _minibatch(n, dev, torch.Generator().manual_seed(0))
    steps = {}
    for name, module in (("old", old), ("new", policy)):
        for ex in ("eager", "compiled"):
            torch.manual_seed(0)
            agent = module.Agent(conv_math="matmul")
            params = list(agent.parameters())
            loss = partial(ppo_loss, agent, cfg=cfg)
            if ex == "compiled":
                loss = Compiled().wrap_model(loss)
            steps[name, ex] = partial(
                minibatch_step, mb, loss_fn=loss, optimizer=Adam()(params, cfg, dev),
                params=params, max_grad_norm=cfg.max_grad_norm, clip_grad=Adam.clip_grad,
                precision=Precision("bf16", "cpu"))
    for step in steps.values():
        step(), step(), step()
    times = {key: [] for key in steps}
    for _ in range(15):
        for key, step in steps.items():
            times[key].append(1e3 * timed(step, dev)[0])
    for (name, ex), found in times.items():
        print(f"minibatch {n:5d} {name} {ex:8s} {statistics.median(found):6.2f} ms "
              f"[{min(found):.2f}-{max(found):.2f}]")
    torch.compiler.reset()
