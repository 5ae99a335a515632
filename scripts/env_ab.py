"""An older ForageTorch against the current one, in one process, on one device: bit-exact
outputs first, then env steps/s in interleaved rounds (the figures of results/GPU-RUNS.md's
fourth run, old = ad94143's 76-op step). The older env is read from git into an untracked
module first:

    git show ad94143:labkit/envs/torch.py > labkit/envs/_old_torch.py
    python scripts/env_ab.py cuda 256 1024 4096 65536     # device, then the N values
    rm labkit/envs/_old_torch.py                           # record refuses untracked code

Each round times one whole 128-step episode of each (after 16 warmup steps), 5 rounds,
median [min-max]; ForageNumpy joins the rounds up to N=4096.
"""
import statistics
import sys
import time

import torch

from labkit.envs import ForageNumpy, ForageSpec
from labkit.envs._old_torch import ForageTorch as Old
from labkit.envs.torch import ForageTorch

dev = sys.argv[1]
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
for spec, n in ((ForageSpec(), 64), (ForageSpec(episode_length=5), 32)):
    a = Old(n, spec, seed=3, device=dev, final_obs=True)
    b = ForageTorch(n, spec, seed=3, device=dev, final_obs=True)
    g = torch.Generator(dev).manual_seed(0)
    for i in range(300):
        act = torch.randint(0, 5, (n,), device=dev, generator=g)
        x, y = a.step(act), b.step(act)
        assert all(torch.equal(p, q) for p, q in zip(x[:4], y[:4], strict=True)), i
        assert all(torch.equal(x[4][k], y[4][k]) for k in x[4]), i
print("old == new, bit-exact, 300 steps, 2 specs, final_obs, on", dev)
for n in [int(v) for v in sys.argv[2:]]:
    envs = {"old": Old(n, seed=1, device=dev), "new": ForageTorch(n, seed=1, device=dev)}
    if n <= 4096:
        envs["numpy"] = ForageNumpy(n, seed=1)
    acts = torch.randint(0, 5, (128, n), device=dev)
    host = acts.cpu().numpy()
    for key, env in envs.items():
        for i in range(16):
            env.step(host[i] if key == "numpy" else acts[i])
    rates = {key: [] for key in envs}
    for _ in range(5):
        for key, env in envs.items():
            these = host if key == "numpy" else acts
            sync()
            start = time.perf_counter()
            for i in range(128):
                env.step(these[i])
            sync()
            rates[key].append(n * 128 / (time.perf_counter() - start))
    med = {key: statistics.median(r) for key, r in rates.items()}
    print(f"N={n}: " + ", ".join(f"{key} {med[key]:,.0f} [{min(r):,.0f}-{max(r):,.0f}]"
                                 for key, r in rates.items())
          + f"; new/old {med['new'] / med['old']:.2f}")
