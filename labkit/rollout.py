"""Collectors: step N envs for T steps with the policy and fill a rollout on the device.

Three collectors, one per lesson, one interface (``collect() -> Rollout``):

* ``PerEnvCollector`` (stage 0): a Python object per env, a policy forward per env, ``.item()``
  per action.
* ``HostBatchedCollector`` (stage 1): vectorized NumPy envs and one batched forward, but the
  observations go host->device and the actions device->host every step.
* ``DeviceCollector`` (stages 2+): env state already on the device; nothing leaves it unless the
  logger or the metrics read it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from .envs import ForagePy, ForageSpec


@dataclass
class Rollout:
    """Preallocated (T, N, ...) storage on the device. ``dones[t]`` = obs t starts an episode."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor

    @classmethod
    def zeros(cls, n_steps: int, n_envs: int, obs_shape: tuple[int, ...],
              device: torch.device) -> Rollout:
        z = lambda *shape, dtype=torch.float32: torch.zeros(  # noqa: E731
            (n_steps, n_envs, *shape), dtype=dtype, device=device)
        return cls(obs=z(*obs_shape), actions=z(dtype=torch.int64), logprobs=z(), values=z(),
                   rewards=z(), dones=z())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


ActFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Collector:
    """Shared bookkeeping; subclasses implement ``reset`` and ``step(t)``."""

    def __init__(self, n_envs: int, n_steps: int, spec: ForageSpec, seed: int,
                 device: torch.device, act: ActFn, logger, metrics) -> None:
        self.n_envs, self.n_steps, self.spec, self.seed = n_envs, n_steps, spec, seed
        self.device, self.act, self.logger, self.metrics = device, act, logger, metrics
        self.storage = Rollout.zeros(n_steps, n_envs, spec.obs_shape, device)
        self.global_step = 0
        self.make_envs()
        self.reset()

    def make_envs(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the first observation of ``seed`` (used after a warmup iteration)."""
        raise NotImplementedError

    def step(self, t: int) -> None:
        raise NotImplementedError

    def next_obs(self) -> torch.Tensor:
        """The observation after the last step, on the device (for the bootstrap value)."""
        return self.obs

    def collect(self) -> Rollout:
        with torch.no_grad():
            for t in range(self.n_steps):
                self.step(t)
                self.global_step += self.n_envs
        return self.storage

    def _store(self, t: int, obs, action, logprob, value) -> None:
        s = self.storage
        s.obs[t], s.actions[t], s.logprobs[t], s.values[t] = obs, action, logprob, value
        s.dones[t] = self.done


class PerEnvCollector(Collector):
    """Stage 0: one ``ForagePy`` per env, a forward and an ``.item()`` per env per step."""

    def make_envs(self) -> None:
        self.envs = [ForagePy(self.spec, self.seed, env_index=i) for i in range(self.n_envs)]

    def reset(self) -> None:
        self.host_obs = [env.reset(seed=self.seed)[0] for env in self.envs]
        self.done = torch.zeros(self.n_envs, device=self.device)

    def next_obs(self) -> torch.Tensor:
        return torch.tensor(self.host_obs, device=self.device)

    def step(self, t: int) -> None:
        rewards, dones, ep_returns, ep_lengths = [], [], [], []
        for i, env in enumerate(self.envs):
            obs = torch.tensor(self.host_obs[i], device=self.device)
            action, logprob, value = self.act(obs[None])
            a = action.item()  # host read per env: the naive baseline
            self.storage.obs[t, i], self.storage.actions[t, i] = obs, action[0]
            self.storage.logprobs[t, i], self.storage.values[t, i] = logprob[0], value[0]
            self.host_obs[i], reward, term, trunc, info = env.step(a)
            rewards.append(reward)
            dones.append(term or trunc)
            ep_returns.append(info.get("episode_return", 0.0))
            ep_lengths.append(info.get("episode_length", 0))
            self.logger.log(self.global_step + i, reward=reward)
        self.storage.dones[t] = self.done
        self.storage.rewards[t] = torch.tensor(rewards, device=self.device)
        done = torch.tensor(dones, device=self.device)
        self.done = done.float()
        self.metrics.update(done, torch.tensor(ep_returns, device=self.device),
                            torch.tensor(ep_lengths, device=self.device))


class HostBatchedCollector(Collector):
    """Stage 1: vectorized NumPy envs, one batched forward, transfers both ways every step."""

    def make_envs(self) -> None:
        from .envs import ForageNumpy
        self.env = ForageNumpy(self.n_envs, self.spec, self.seed)

    def reset(self) -> None:
        self.host_obs = self.env.reset(seed=self.seed)[0]
        self.done = torch.zeros(self.n_envs, device=self.device)

    def next_obs(self) -> torch.Tensor:
        return torch.from_numpy(self.host_obs).to(self.device)

    def step(self, t: int) -> None:
        obs = torch.from_numpy(self.host_obs).to(self.device)  # host -> device every step
        action, logprob, value = self.act(obs)
        self._store(t, obs, action, logprob, value)
        actions = action.cpu().numpy()  # device -> host every step: stage 1's sync
        self.host_obs, reward, term, trunc, info = self.env.step(actions)
        self.storage.rewards[t] = torch.from_numpy(reward).to(self.device)
        done = torch.from_numpy(np.logical_or(term, trunc)).to(self.device)
        self.done = done.float()
        self.logger.log(self.global_step, reward=self.storage.rewards[t].mean())
        self.metrics.update(done, torch.from_numpy(info["episode_return"]).to(self.device),
                            torch.from_numpy(info["episode_length"]).to(self.device))


class DeviceCollector(Collector):
    """Stages 2+: the env lives on the device (``ForageTorchLoop`` or ``ForageTorch``)."""

    def __init__(self, *args, env_cls=None, **kwargs) -> None:
        self.env_cls = env_cls
        super().__init__(*args, **kwargs)

    def make_envs(self) -> None:
        self.env = self.env_cls(self.n_envs, self.spec, self.seed, device=self.device)

    def reset(self) -> None:
        self.obs = self.env.reset(seed=self.seed)[0]
        self.done = torch.zeros(self.n_envs, device=self.device)

    def step(self, t: int) -> None:
        action, logprob, value = self.act(self.obs)
        self._store(t, self.obs, action, logprob, value)
        self.obs, reward, term, trunc, info = self.env.step(action)
        done = term | trunc
        self.storage.rewards[t] = reward
        self.done = done.float()
        self.logger.log(self.global_step, reward=reward.mean())
        self.metrics.update(done, info["episode_return"], info["episode_length"])
