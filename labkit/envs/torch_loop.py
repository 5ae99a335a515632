"""ForageTorchLoop: the first port of ForagePy to torch, and why it is slow.

The state lives on the device as ForageNumpy lays it out (flat grids padded with walls, see
``Layout``). ``step`` is ForagePy's step written with tensors: a Python loop over envs with an
``if`` on tensor values per env. Each ``if`` on a device tensor is a host read, a sync that on
a GPU waits for all queued work, several times per env per step. Same outputs as ForagePy and
ForageTorch, bit for bit, and the same ``state_dict``.
"""
from __future__ import annotations

import torch

from .numpy import check_reachable
from .rng import hash32
from .spec import AGENT, EMPTY, FOOD, POISON, WALL, ForageSpec, Layout, check_seed
from .torch import STATE_KEYS, check_actions, check_env_args, check_state, kth_free


class ForageTorchLoop:
    """``n_envs`` Forage envs on ``device``, stepped one env at a time (host syncs and all).
    Built with the same arguments as ForageTorch; env ``i`` uses hash counter env index
    ``env_offset + i``."""

    vectorized_on_device = False
    #: A Python loop steps each env in turn, reading the device inside it.
    one_env_at_a_time = True

    def __init__(self, n_envs: int, spec: ForageSpec | None = None, seed: int = 0,
                 device: str | torch.device = "cpu", final_obs: bool = False,
                 env_offset: int = 0) -> None:
        self.n_envs, self.spec, self.device = check_env_args(n_envs, spec, seed, device)
        self.final_obs = bool(final_obs)
        lay = Layout.of(self.spec)
        dev, n = self.device, self.n_envs

        def on_device(a) -> torch.Tensor:
            return torch.as_tensor(a, device=dev)

        self._base, self._cells = on_device(lay.base), on_device(lay.cells)
        self._window, self._deltas = on_device(lay.window), on_device(lay.deltas)
        self._channel_kinds = on_device(lay.channel_kinds)
        kinds = torch.tensor(lay.placements, dtype=torch.int8)
        self._item_draws = on_device(torch.nonzero(kinds != AGENT).squeeze(1))
        self._item_kinds = on_device(kinds[kinds != AGENT])
        self._agent_draw = lay.placements.index(AGENT)
        self._draws = torch.arange(len(lay.placements), device=dev)
        self._env = torch.arange(env_offset, env_offset + n, device=dev)

        self.seed = torch.tensor(seed, dtype=torch.int64, device=dev)
        self.episode = torch.zeros(n, dtype=torch.int64, device=dev)
        self.t = torch.zeros(n, dtype=torch.int64, device=dev)
        self.grid = torch.empty(n, lay.rows * lay.cols, dtype=torch.int8, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.episode_return = torch.zeros(n, dtype=torch.float32, device=dev)
        self.reset()

    def _free_cell(self, grid: torch.Tensor, pos: torch.Tensor, env: torch.Tensor,
                   episode: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Flat index of the k-th free cell of each env (k from the hash)."""
        cells = self._cells
        free = (grid[:, cells] == EMPTY) & (cells != pos.unsqueeze(1))
        count = free.sum(1).clamp(min=1)
        k = hash32(self.seed, env, episode, step, 0) % count
        return cells[kth_free(free, k).clamp(max=cells.numel() - 1)]

    def _new_episodes(self, env: torch.Tensor, episode: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh flat grids and agent positions for envs ``env`` at episodes ``episode``."""
        n, n_cells = env.shape[0], self._cells.numel()
        h = hash32(self.seed, env.unsqueeze(1), episode.unsqueeze(1), 0, self._draws)
        free = torch.ones(n, n_cells, dtype=torch.bool, device=self.device)
        taken = torch.empty(n, len(self._draws), dtype=torch.int64, device=self.device)
        for d in range(len(self._draws)):
            # Each draw takes one interior cell, so draw d chooses among n_cells - d.
            taken[:, d] = kth_free(free, h[:, d] % (n_cells - d))
            free.scatter_(1, taken[:, d:d + 1], False)
        grid = self._base.repeat(n, 1)
        grid.scatter_(1, self._cells[taken[:, self._item_draws]],
                      self._item_kinds.expand(n, -1))
        return grid, self._cells[taken[:, self._agent_draw]]

    def _observe(self, grid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cells = grid.gather(1, pos.unsqueeze(1) + self._window)
        obs = cells.unsqueeze(1) == self._channel_kinds.view(1, -1, 1)
        return obs.to(torch.float32).view(grid.shape[0], *self.spec.obs_shape)

    def observation(self) -> torch.Tensor:
        return self._observe(self.grid, self.pos)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        if seed is not None:
            self.seed.fill_(check_seed(seed))
        self.episode.zero_()
        grid, pos = self._new_episodes(self._env, self.episode)
        self.grid.copy_(grid)
        self.pos.copy_(pos)
        self.t.zero_()
        self.episode_return.zero_()
        return self.observation(), {}

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, dict]:
        actions = check_actions(actions, self.n_envs, self.device)
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the env state: enough to resume bit-exactly with ``load_state_dict``."""
        return {key: getattr(self, key).clone() for key in STATE_KEYS}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        check_state(state, self.state_dict())
        check_reachable(state, self.spec, Layout.of(self.spec))
        for key in STATE_KEYS:
            getattr(self, key).copy_(state[key])
