"""Forage for Gymnasium users (SB3, CleanRL, ...): ``ForageEnv`` (one env) and
``ForageVectorEnv`` (N envs in one NumPy or torch step), registered as ``labkit/Forage-v0``
when this module is imported (``import labkit.envs`` alone registers nothing), as Gymnasium's
"module:id" form does:

>>> import gymnasium
>>> env = gymnasium.make("labkit.envs.gym:labkit/Forage-v0")
>>> envs = gymnasium.make_vec("labkit/Forage-v0", num_envs=64)  # registered by the line above

``ForageEnv`` follows the single-env API: when an episode is truncated (Forage episodes never
terminate) ``step`` returns its last observation and ``reset()`` starts the next episode of
the seed's stream. ``ForageVectorEnv`` resets in the same step, Gymnasium's
``AutoresetMode.SAME_STEP``: the returned observation of a finished env is the next episode's
first, and the finished one is in ``info["final_obs"]`` (mask ``info["_final_obs"]``). Its
observations and rewards are ForageNumpy's (or ForageTorch's) bit for bit.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from .numpy import ForageNumpy
from .python import ForagePy
from .spec import MAX_SEED, N_ACTIONS, ForageSpec, check_n_envs
from .torch import ForageTorch

ENV_ID = "labkit/Forage-v0"
BACKENDS = ("numpy", "torch")


def _spec(forage: object) -> ForageSpec:
    """The ``forage`` keyword (``gym.make(..., forage=ForageSpec(...))``), checked."""
    if forage is None:
        return ForageSpec()
    if not isinstance(forage, ForageSpec):
        raise TypeError(f"forage must be a ForageSpec (labkit.envs.ForageSpec(height=..., "
                        f"...)), got {type(forage).__name__}")
    return forage


def _observation_space(forage: ForageSpec) -> spaces.Box:
    return spaces.Box(0.0, 1.0, forage.obs_shape, np.float32)


def _seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, {MAX_SEED}] (one seed for all envs; env "
                         f"i is hash counter index i), got {seed!r}")
    return int(seed)


class ForageEnv(gym.Env):
    """One Forage env (``ForagePy`` underneath). ``forage`` is the ``ForageSpec``."""

    metadata = {"render_modes": []}

    def __init__(self, forage: ForageSpec | None = None) -> None:
        self.forage = _spec(forage)
        self.observation_space = _observation_space(self.forage)
        self.action_space = spaces.Discrete(N_ACTIONS)
        self._env = ForagePy(self.forage, seed=0, final_obs=True)
        self._ended = False

    def _obs(self, obs: list) -> np.ndarray:
        return np.asarray(obs, dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        if seed is not None:
            seed = _seed(seed)
        super().reset(seed=seed)
        if seed is not None:
            obs = self._env.reset(seed=seed)[0]
        elif self._ended:  # ForagePy already moved on to the next episode
            obs = self._env.observation()
        else:  # mid-episode: skip to the next episode of the stream
            self._env.episode += 1
            self._env._new_episode()
            obs = self._env.observation()
        self._ended = False
        return self._obs(obs), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action must be an int in [0, {N_ACTIONS}), got {action!r}")
        obs, reward, terminated, truncated, info = self._env.step(int(action))
        if truncated:
            obs = info.pop("final_observation")
            self._ended = True
        return self._obs(obs), float(reward), terminated, truncated, info


class ForageVectorEnv(VectorEnv):
    """``num_envs`` Forage envs stepped together: ``backend="numpy"`` (ForageNumpy, NumPy arrays)
    or ``"torch"`` (ForageTorch on ``device``: tensors in and out, no host reads)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int, forage: ForageSpec | None = None,
                 backend: str = "numpy", device: str | torch.device = "cpu") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.forage = _spec(forage)
        self.num_envs, self.backend = check_n_envs(num_envs, "num_envs"), backend
        self.single_observation_space = _observation_space(self.forage)
        self.single_action_space = spaces.Discrete(N_ACTIONS)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        if backend == "numpy":
            self._env = ForageNumpy(num_envs, self.forage, 0, final_obs=True)
        else:
            self._env = ForageTorch(num_envs, self.forage, 0, device=device, final_obs=True)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            seed = _seed(seed)
        super().reset(seed=seed)
        return self._env.reset(seed=seed)[0], {}

    def step(self, actions):
        obs, reward, terminated, truncated, info = self._env.step(actions)
        final = info.pop("final_observation")
        info["_episode_return"] = info["_episode_length"] = truncated
        # Gymnasium's same-step layout (SyncVectorEnv's): the ended episodes' observations and
        # infos under final_obs / final_info, each with its mask; the statistics stay at the
        # top level too, where CleanRL-style loops read them.
        info["final_info"] = {k: info[k] for k in (
            "episode_return", "_episode_return", "episode_length", "_episode_length")}
        info["final_obs"], info["_final_obs"], info["_final_info"] = final, truncated, truncated
        return obs, reward, terminated, truncated, info


def register() -> None:
    """Register ``labkit/Forage-v0`` (single and vector entry points) with Gymnasium."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point=ForageEnv, vector_entry_point=ForageVectorEnv,
                     disable_env_checker=False)


register()
