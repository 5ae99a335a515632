"""ForageTorch against a JAX env on the same CPU, in one run: gymnax's MinAtar Breakout, the
cross-env reference issue 40 names (outside CI: JAX is not a labkit dependency).

Setup (a venv of its own; JAX's CPU wheels and gymnax come from the package registry):

    python -m venv /tmp/gx && /tmp/gx/bin/pip install gymnax "jax[cpu]" six torch==2.13.0
    PYTHONPATH=. /tmp/gx/bin/python scripts/gymnax_reference.py --n-envs 4096

Each round times one whole 128-step episode of every env in turn (random actions drawn
beforehand, warmup and JAX's compile excluded): ForageTorch stepped eagerly, ForageNumpy, and
gymnax's ``env.step`` vmapped over the envs and jitted, called once per step (as ForageTorch's
``step`` is; its auto-reset is part of the step). Also ForageTorch's step through
``torch.compile`` (one call per step), and gymnax's 128 steps in one ``lax.scan``, one call per
episode, the form JAX training loops use. Env steps/s, median and range over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import gymnax
from labkit.envs import ForageNumpy, ForageTorch

STEPS = 128


def gymnax_runners(n: int, seed: int):
    env, params = gymnax.make("Breakout-MinAtar")
    step = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    key = jax.random.PRNGKey(seed)
    keys = jax.random.split(key, (STEPS, n))
    actions = jax.random.randint(key, (STEPS, n), 0, env.num_actions)
    _, state = jax.vmap(env.reset, in_axes=(0, None))(keys[0], params)
    one = jax.jit(lambda k, s, a: step(k, s, a, params)[1])

    @jax.jit
    def episode(state):
        def body(s, xs):
            return step(xs[0], s, xs[1], params)[1], None
        return jax.lax.scan(body, state, (keys, actions))[0]

    box = {"step": state, "scan": state}

    def per_step():
        s = box["step"]
        for i in range(STEPS):
            s = one(keys[i], s, actions[i])
        jax.block_until_ready(s)
        box["step"] = s

    def scanned():
        box["scan"] = jax.block_until_ready(episode(box["scan"]))

    return {"gymnax Breakout (jit per step)": per_step, "gymnax Breakout (scan)": scanned}


def forage_runners(n: int, seed: int):
    acts = np.random.default_rng(seed).integers(0, 5, (STEPS, n))
    t_acts = torch.as_tensor(acts)
    numpy_env, torch_env = ForageNumpy(n, seed=seed), ForageTorch(n, seed=seed)
    compiled_env = ForageTorch(n, seed=seed)
    compiled_step = torch.compile(compiled_env.step, fullgraph=True)

    def torch_episode():
        for i in range(STEPS):
            torch_env.step(t_acts[i])

    def compiled_episode():
        for i in range(STEPS):
            compiled_step(t_acts[i])

    def numpy_episode():
        for i in range(STEPS):
            numpy_env.step(acts[i])
    return {"ForageTorch (eager)": torch_episode, "ForageTorch (compiled step)": compiled_episode,
            "ForageNumpy": numpy_episode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-envs", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.n_envs
    runners = {**forage_runners(n, args.seed), **gymnax_runners(n, args.seed)}
    for fn in runners.values():  # warm up: JAX compiles here
        fn()
    rates = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, fn in runners.items():
            start = time.perf_counter()
            fn()
            rates[name].append(n * STEPS / (time.perf_counter() - start))
    print(f"N={n}, {args.rounds} rounds of one {STEPS}-step episode each; torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__} "
          f"({jax.devices()[0].platform})")
    for name, r in rates.items():
        print(f"  {name:<32} {statistics.median(r):>12,.0f} env steps/s "
              f"[{min(r):,.0f} - {max(r):,.0f}]")
    for mine in ("ForageTorch (eager)", "ForageTorch (compiled step)"):
        for name in ("gymnax Breakout (jit per step)", "gymnax Breakout (scan)"):
            ratio = statistics.median(rates[mine]) / statistics.median(rates[name])
            print(f"{mine} / {name}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
