"""labkit's stage against Stable-Baselines3's PPO on the same work: the same vectorized Forage
envs (the stage's own, ``ForageNumpy`` or ``ForageTorch``; N of them, one seed), the same
network (labkit's conv body and two linear heads), the same hyperparameters and threads, all
printed; env steps per second of whole PPO iterations (rollout, GAE, update), timed in
interleaved rounds. ``python -m labkit bench-sb3`` (needs the ``sb3`` extra).

What differs by design: SB3 samples actions with its own
distribution on the host and copies observations to its device each step, and it logs through
its own logger; both are what an SB3 user runs.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..capture import warmup
from ..config import RunConfig
from ..device import run_metadata
from ..envs import ForageNumpy, ForageTorch
from ..executors import describe_model_math
from ..policy import HIDDEN, N_ACTIONS, layer_init
from ..stages import Pipeline, get_stage
from . import tables


def _vec_env(n_envs: int, cfg: RunConfig, env_class: type = ForageNumpy):
    """``env_class`` (ForageNumpy, or ForageTorch on the CPU, its arrays read as NumPy) behind
    SB3's ``VecEnv`` interface (same-step resets: the ended episode's last observation under
    ``terminal_observation``, as SB3 expects)."""
    from gymnasium import spaces
    from stable_baselines3.common.vec_env import VecEnv

    def host(x):
        return x.numpy() if isinstance(x, torch.Tensor) else x

    class ForageVec(VecEnv):
        def __init__(self) -> None:
            self.env = env_class(n_envs, cfg.spec, cfg.seed, final_obs=True)
            obs = host(self.env.reset()[0])
            super().__init__(n_envs, spaces.Box(0.0, 1.0, obs.shape[1:], np.float32),
                             spaces.Discrete(N_ACTIONS))
            self._actions = None

        def reset(self):
            return host(self.env.reset()[0])

        def step_async(self, actions):
            self._actions = actions if env_class is ForageNumpy else torch.from_numpy(actions)

        def step_wait(self):
            obs, reward, terminated, truncated, info = (
                {k: host(v) for k, v in x.items()} if isinstance(x, dict) else host(x)
                for x in self.env.step(self._actions))
            done = terminated | truncated
            infos = [{} for _ in range(self.num_envs)]
            for i in np.flatnonzero(done):
                infos[i] = {"terminal_observation": info["final_observation"][i],
                            "TimeLimit.truncated": bool(truncated[i] and not terminated[i]),
                            "episode": {"r": float(info["episode_return"][i]),
                                        "l": int(info["episode_length"][i]), "t": 0.0}}
            return obs, reward, done, infos

        def close(self):
            pass

        def get_attr(self, attr_name, indices=None):
            return [None] * self.num_envs

        def set_attr(self, attr_name, value, indices=None):
            pass

        def env_method(self, method_name, *args, indices=None, **kwargs):
            return [None] * self.num_envs

        def env_is_wrapped(self, wrapper_class, indices=None):
            return [False] * self.num_envs

    return ForageVec()


def _sb3_model(cfg: RunConfig, env):
    """SB3's PPO with labkit's network and hyperparameters (the LR annealed linearly to 0 over
    the run, as labkit anneals it over ``lr_horizon``)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class ForageBody(BaseFeaturesExtractor):
        def __init__(self, observation_space) -> None:
            super().__init__(observation_space, HIDDEN)
            view = observation_space.shape[-1]
            self.body = torch.nn.Sequential(
                layer_init(torch.nn.Conv2d(observation_space.shape[0], 16, 3)), torch.nn.ReLU(),
                layer_init(torch.nn.Conv2d(16, 32, 3)), torch.nn.ReLU(), torch.nn.Flatten(),
                layer_init(torch.nn.Linear(32 * (view - 4) ** 2, HIDDEN)), torch.nn.ReLU())

        def forward(self, obs):
            return self.body(obs)

    p = cfg.ppo
    return PPO("CnnPolicy", env, n_steps=cfg.n_steps,
               batch_size=cfg.n_envs * cfg.n_steps // p.n_minibatches, n_epochs=p.update_epochs,
               learning_rate=lambda left: p.lr * left, gamma=p.gamma, gae_lambda=p.gae_lambda,
               clip_range=p.clip_coef, clip_range_vf=p.clip_coef if p.clip_vloss else None,
               ent_coef=p.ent_coef, vf_coef=p.vf_coef, max_grad_norm=p.max_grad_norm,
               normalize_advantage=p.norm_adv, seed=cfg.seed, device="cpu", verbose=0,
               policy_kwargs={"features_extractor_class": ForageBody, "net_arch": [],
                              "normalize_images": False, "share_features_extractor": True,
                              "optimizer_kwargs": {"eps": p.adam_eps}})


def bench_sb3(cfg: RunConfig, stage: str | int, iterations: int = 3, rounds: int = 5,
              threads: int | None = None) -> dict:
    """Env steps/s of ``iterations`` PPO iterations of SB3 and of labkit's ``stage`` on the
    CPU, ``rounds`` times each, interleaved; each side built and run once off the clock."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    steps = iterations * cfg.n_envs * cfg.n_steps
    times: dict[str, list[float]] = {"sb3": [], "labkit": []}
    env_class = get_stage(stage).env  # SB3 steps the stage's own env where it can
    env_class = env_class if env_class in (ForageNumpy, ForageTorch) else ForageNumpy
    try:
        model = _sb3_model(cfg, _vec_env(cfg.n_envs, cfg, env_class))
        model.learn(cfg.n_envs * cfg.n_steps)  # imports, first calls, allocator: off the clock
        with Pipeline(get_stage(stage), cfg, "cpu") as pipe:
            warmup(pipe)  # compiles (and keeps compile where it pays): off the clock
            for _ in range(rounds):
                start = time.perf_counter()
                model.learn(steps, reset_num_timesteps=False)
                times["sb3"].append(time.perf_counter() - start)
                start = time.perf_counter()
                for _ in range(iterations):
                    pipe.iteration()
                times["labkit"].append(time.perf_counter() - start)
            name, precision = pipe.stage.name, pipe.precision.describe()
            math, made, conv = pipe.math.kinds(), pipe.math.executor_choices, pipe.math.conv_choices
    finally:
        used = torch.get_num_threads()
        torch.set_num_threads(saved)
    rows = [{"who": who, "sps": steps / statistics.median(t), "sps_min": steps / max(t),
             "sps_max": steps / min(t), "seconds": t} for who, t in times.items()]
    rows[1]["x_sb3"] = rows[1]["sps"] / rows[0]["sps"]
    rows[0]["x_sb3"] = 1.0
    return {"meta": run_metadata(torch.device("cpu")), "stage": name, "precision": precision,
            "model_math": math, "executor_choices": made, "conv_math": conv,
            "env": env_class.__name__,
            "threads": used, "iterations": iterations, "rounds": rounds,
            "run": cfg.to_dict(), "rows": rows}


TABLE = tables.Table((
    tables.Column("who", "trainer", lambda r: r["who"], 7, left=True),
    tables.Column("sps", "env steps/s (median)", lambda r: tables.fmt(r["sps"]), 11),
    tables.Column("min", "min", lambda r: tables.fmt(r["sps_min"]), 9),
    tables.Column("max", "max", lambda r: tables.fmt(r["sps_max"]), 9),
    tables.Column("x sb3", "x SB3", lambda r: f"{r['x_sb3']:.2f}", 6),
))


def format_table(result: dict) -> str:
    run, p = result["run"], result["run"]["ppo"]
    return "\n".join([
        TABLE.text(result["rows"]),
        f"labkit {result['stage']} ({result['precision']}) against SB3 PPO, both on "
        f"{result['meta']['device_name']} (cpu), {result['threads']} thread(s), torch "
        f"{result['meta']['torch']}; {result['rounds']} interleaved rounds of "
        f"{result['iterations']} iterations each",
        *(["labkit's model math: "
           + describe_model_math(result["executor_choices"], result.get("conv_math"))]
          if result.get("executor_choices") else []),
        f"same work: {result['env']} x {run['n_envs']} envs, seed {run['seed']}, "
        f"T={run['n_steps']}; "
        f"conv body and linear heads; {p['update_epochs']} epochs x {p['n_minibatches']} "
        f"minibatches, lr {p['lr']:g} annealed, gamma {p['gamma']:g}, lambda {p['gae_lambda']:g},"
        f" clip {p['clip_coef']:g}, ent {p['ent_coef']:g}, vf {p['vf_coef']:g}, max grad norm "
        f"{p['max_grad_norm']:g}, Adam eps {p['adam_eps']:g}"])
