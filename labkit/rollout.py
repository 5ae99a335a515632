"""Collectors: one env step with the policy at a time, written into rollout storage on the device.

Three collectors, one per lesson, one interface. Each is built with keywords only (an env
*instance*, the rollout length, the policy's ``act``, the metrics component, the device, the
phase clock) and each ``step()`` does one env step for all N envs: policy, env, storage writes,
episode statistics. The pipeline calls ``step`` T times per rollout (eagerly, or replayed as a
CUDA graph by its rollout executor) and logs after each.

* ``PerEnvCollector`` (stage 0): a Python object per env, a policy forward per env, ``.item()``
  per action.
* ``HostBatchedCollector`` (stage 1): vectorized NumPy envs and one batched forward, but the
  observations go host->device and the actions device->host every step.
* ``DeviceCollector`` (stages 2+): env state already on the device; nothing leaves it unless
  the env, the logger or the metrics read it. Its step is written capture-safe: static
  buffers updated in place, storage rows written at a device-side step counter. Its work past
  the sampling noise is one function, :meth:`DeviceCollector.advance`, that a stage may
  compile whole (``RunConfig.compile_unit="step"``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from . import debug
from .envs import ForageNumpy, ForagePyList, ForageTorch, ForageTorchLoop
from .envs.spec import N_ACTIONS
from .timing import PhaseClock
from .validate import check_state_keys, check_state_tensor


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
              device: torch.device, obs_dtype: torch.dtype = torch.float32) -> Rollout:
        def z(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros((n_steps, n_envs, *shape), dtype=dtype, device=device)
        return cls(obs=z(*obs_shape, dtype=obs_dtype), actions=z(dtype=torch.int64),
                   logprobs=z(), values=z(), rewards=z(), dones=z())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def write(self, t: torch.Tensor, **rows: torch.Tensor) -> None:
        """Write one (N, ...) row per field at step ``t``, a (1,) device tensor: no host read,
        and the same kernels whatever ``t`` is (so a CUDA graph can replay them). A row is cast
        to its field's dtype (observations stored as uint8, ``RunConfig.obs_storage``)."""
        for name, row in rows.items():
            field = getattr(self, name)
            field.index_copy_(0, t, row.unsqueeze(0).to(field.dtype))


#: ``act(obs, generator=..., noise=...)``: (actions, log-probabilities, values), as
#: :func:`labkit.policy.sample_action` with the policy bound.
ActFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Collector:
    """Storage, the done flags that came with the current observation, the step counter, the
    mean reward of the last step (what the pipeline logs) and the state to checkpoint.
    ``accepts``: the env classes a collector can step (a stage pairing it with another env
    says so in its skip reason)."""

    accepts: tuple[type, ...] = ()

    def __init__(self, *, env, n_steps: int, act: ActFn, metrics, device: torch.device,
                 clock: PhaseClock | None = None,
                 generator: torch.Generator | None = None,
                 obs_dtype: torch.dtype = torch.float32) -> None:
        self.env, self.n_envs, self.n_steps = env, env.n_envs, n_steps
        self.act, self.metrics, self.device = act, metrics, device
        self.generator = generator  # the sampling noise's
        self.clock = clock if clock is not None else PhaseClock(device)
        self.storage = Rollout.zeros(n_steps, self.n_envs, env.spec.obs_shape, device, obs_dtype)
        self.t = torch.zeros(1, dtype=torch.int64, device=device)
        self.done = torch.zeros(self.n_envs, device=device)
        self.reward_mean = torch.zeros((), device=device)
        self._observe()  # the env was built reset

    def restart_envs(self) -> None:
        """Every env back to the first observation of its seed."""
        self.env.reset()
        self.done.zero_()
        self.t.zero_()
        self._observe()

    def _observe(self) -> None:
        """Refresh the current observation from the env's state."""
        raise NotImplementedError

    def next_obs(self) -> torch.Tensor:
        """The observation after the last step, on the device (for the bootstrap value)."""
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def _finish_step(self, reward: torch.Tensor, done: torch.Tensor) -> None:
        debug.check(rewards=reward)
        self.storage.write(self.t, rewards=reward)
        self.done.copy_(done)
        self.reward_mean.copy_(reward.mean())
        self.t.add_(1).remainder_(self.n_steps)

    def state_dict(self) -> dict:
        return {"env": self.env.state_dict(), "done": self.done.clone(), "t": self.t.clone()}

    def load_state_dict(self, state: dict) -> None:
        check_state_keys("collector state", state, ("env", "done", "t"))
        check_state_tensor("collector state['done']", state["done"], self.done, 0, 1)
        check_state_tensor("collector state['t']", state["t"], self.t, 0, self.n_steps - 1)
        self.env.load_state_dict(state["env"])
        self.done.copy_(state["done"])
        self.t.copy_(state["t"])
        self._observe()


class PerEnvCollector(Collector):
    """Stage 0: a ``ForagePyList``; a forward and an ``.item()`` per env per step."""

    accepts = (ForagePyList,)

    def _observe(self) -> None:
        self.host_obs = self.env.observation()

    def next_obs(self) -> torch.Tensor:
        return torch.tensor(self.host_obs, device=self.device)

    def step(self) -> None:
        clock, dev = self.clock, self.device
        obs_rows, actions, logprobs, values = [], [], [], []
        rewards, dones, ep_returns, ep_lengths = [], [], [], []
        for i, env in enumerate(self.env):
            obs = torch.tensor(self.host_obs[i], device=dev)  # one env's obs, host -> device
            clock.lap("io")
            action, logprob, value = self.act(obs[None], generator=self.generator)
            a = action.item()  # host read per env: the naive baseline
            clock.lap("policy")
            self.host_obs[i], reward, term, trunc, info = env.step(a)
            clock.lap("env")
            obs_rows.append(obs)
            actions.append(action[0])
            logprobs.append(logprob[0])
            values.append(value[0])
            rewards.append(reward)
            dones.append(term or trunc)
            ep_returns.append(info.get("episode_return", 0.0))
            ep_lengths.append(info.get("episode_length", 0))
        self.storage.write(self.t, obs=torch.stack(obs_rows), actions=torch.stack(actions),
                           logprobs=torch.stack(logprobs), values=torch.stack(values),
                           dones=self.done)
        done = torch.tensor(dones, device=dev)
        self._finish_step(torch.tensor(rewards, device=dev), done)
        clock.lap("io")
        self.metrics.update(done, torch.tensor(ep_returns, device=dev),
                            torch.tensor(ep_lengths, device=dev))
        clock.lap("metrics")


class HostBatchedCollector(Collector):
    """Stage 1: vectorized NumPy envs, one batched forward, transfers both ways every step."""

    accepts = (ForageNumpy,)

    def _observe(self) -> None:
        self.host_obs = self.env.observation()

    def next_obs(self) -> torch.Tensor:
        return torch.from_numpy(self.host_obs).to(self.device)

    def step(self) -> None:
        clock, dev = self.clock, self.device
        obs = torch.from_numpy(self.host_obs).to(dev)  # host -> device every step
        clock.lap("io")
        action, logprob, value = self.act(obs, generator=self.generator)
        self.storage.write(self.t, obs=obs, actions=action, logprobs=logprob, values=value,
                           dones=self.done)
        clock.lap("policy")
        actions = action.cpu().numpy()  # device -> host every step: stage 1's sync
        clock.lap("io")
        self.host_obs, reward, term, trunc, info = self.env.step(actions)
        clock.lap("env")
        done = torch.from_numpy(np.logical_or(term, trunc)).to(dev)
        self._finish_step(torch.from_numpy(reward).to(dev), done)
        episode_return = torch.from_numpy(info["episode_return"]).to(dev)
        episode_length = torch.from_numpy(info["episode_length"]).to(dev)
        clock.lap("io")
        self.metrics.update(done, episode_return, episode_length)
        clock.lap("metrics")


class DeviceCollector(Collector):
    """Stages 2+: the env lives on the device (``ForageTorchLoop`` or ``ForageTorch``).

    ``step`` is capture-safe whenever its env and metrics are: fixed shapes, the observation
    and done flags updated in place, storage written at the device-side counter ``t``. It draws
    the sampling noise into a fixed buffer from the generator, then runs :meth:`advance`, the
    rest of the step: eagerly, phase by phase, or as one region an executor wrapped
    (:meth:`fuse`: ``torch.compile`` of the whole step, so the policy, the sampling, the storage
    writes, the env step and, where they read nothing on the host, the episode statistics
    become a few fused kernels instead of one launch per op). A generator cannot enter a
    compiled region (dynamo does not trace it); drawn outside, the numbers are the ones the
    eager step draws.
    """

    accepts = (ForageTorchLoop, ForageTorch)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.noise = torch.empty(self.n_envs, N_ACTIONS, device=self.device)
        #: The step past the noise as one wrapped region (None: eager, phase by phase).
        self.region: Callable[[], tuple | None] | None = None
        # Episode statistics that read nothing on the host run inside a fused step.
        self._metrics_inside = not getattr(self.metrics, "reads_host", True)

    def _observe(self) -> None:
        obs = self.env.observation()
        if not hasattr(self, "obs"):
            self.obs = torch.empty_like(obs)
        self.obs.copy_(obs)  # in place: a captured step reads this very buffer

    def next_obs(self) -> torch.Tensor:
        return self.obs

    def fuse(self, wrap: Callable[[Callable], Callable]) -> Callable:
        """Run :meth:`advance` as ``wrap(advance)`` from now on (an executor's ``wrap_model``:
        compiled, or chosen by timing); its clock then marks one ``step`` phase for it."""
        self.region = wrap(self.advance)
        return self.region

    def step(self) -> None:
        clock = self.clock
        self.noise.exponential_(generator=self.generator)
        if self.region is None:
            action = self._act()
            clock.lap("policy")
            ended = self._env(action)
            clock.lap("env")
        else:
            ended = self.region()
            clock.lap("step")
        if ended is not None:
            self.metrics.update(*ended)
            clock.lap("metrics")

    def advance(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The step past the noise, with no clock: the policy and the storage writes, the env
        step, and the episode statistics where a fused step holds them; otherwise returns
        what they are updated with (done, episode return, episode length)."""
        ended = self._env(self._act())
        if self.region is not None and self._metrics_inside:
            self.metrics.update(*ended)
            return None
        return ended

    def _act(self) -> torch.Tensor:
        action, logprob, value = self.act(self.obs, noise=self.noise)
        self.storage.write(self.t, obs=self.obs, actions=action, logprobs=logprob, values=value,
                           dones=self.done)
        return action

    def _env(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, reward, term, trunc, info = self.env.step(action)
        done = term | trunc
        self.obs.copy_(obs)
        self._finish_step(reward, done)
        return done, info["episode_return"], info["episode_length"]
