"""ForageTorchLoop: the first port of ForagePy to torch, and why it is slow.

The state is ForageTorch's, on the device, and reset/observation are shared with it. ``step``
is ForagePy's step written with tensors: a Python loop over envs with an ``if`` on tensor
values per env. Each ``if`` on a device tensor is a host read, a sync that on a GPU waits for
all queued work, several times per env per step. Same outputs as ForageTorch, bit for bit.
"""
from __future__ import annotations

import torch

from .spec import EMPTY, FOOD, POISON, WALL
from .torch import ForageTorch


class ForageTorchLoop(ForageTorch):
    """``n_envs`` Forage envs on ``device``, stepped one env at a time (host syncs and all)."""

    vectorized_on_device = False

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, dict]:
        actions = self._check_actions(actions)
        n, dev = self.n_envs, self.device
        reward = torch.zeros(n, dtype=torch.float32, device=dev)
        truncated = torch.zeros(n, dtype=torch.bool, device=dev)
        ep_return = torch.zeros(n, dtype=torch.float32, device=dev)
        ep_length = torch.zeros(n, dtype=torch.int64, device=dev)
        finals = {}
        for i in range(n):
            grid, one = self.grid[i:i + 1], slice(i, i + 1)  # views: writes land in self.grid
            target = self.pos[i] + self._deltas[actions[i]]
            cell = grid[0, target].clone()
            if cell != WALL:
                self.pos[i] = target
                if cell == FOOD or cell == POISON:
                    reward[i] = 1.0 if cell == FOOD else -1.0
                    grid[0, target] = EMPTY
                    spawn = self._free_cell(grid, self.pos[one], self._env[one],
                                            self.episode[one], self.t[one] + 1)
                    grid[0, spawn] = cell
            self.t[i] += 1
            self.episode_return[i] += reward[i]
            if self.t[i] == self.spec.episode_length:
                truncated[i] = True
                ep_return[i], ep_length[i] = self.episode_return[i], self.t[i]
                if self.final_obs:
                    finals[i] = self._observe(grid, self.pos[one])[0]
                self.episode[i] += 1
                new_grid, new_pos = self._new_episodes(self._env[one], self.episode[one])
                grid.copy_(new_grid)
                self.pos[i] = new_pos[0]
                self.t[i] = 0
                self.episode_return[i] = 0.0
        obs = self.observation()
        info = {"episode_return": ep_return, "episode_length": ep_length}
        if self.final_obs:
            info["final_observation"] = obs.clone()
            for i, final in finals.items():
                info["final_observation"][i] = final
        return obs, reward, torch.zeros_like(truncated), truncated, info
