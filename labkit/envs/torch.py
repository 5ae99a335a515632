"""ForageTorch: N Forage envs as tensors on any device, stepped with zero host reads.

State lives on the device (grids flat and wall-padded as in ``Layout``); every branch of
ForagePy becomes a ``torch.where``, every placement the "k-th free cell" computed for all envs
and kept where needed. Shapes are static and state is updated in place, so ``step`` can be
compiled or captured in a CUDA graph.

Action range errors use ``torch._assert_async``: on the CPU it raises at once (re-raised here
as ValueError); on CUDA it is a device-side assert that fails a later call and poisons the CUDA
context, the price of not syncing to check.
"""
from __future__ import annotations

import torch

from ..device import resolve_device
from .numpy import AGENT, Layout
from .rng import hash32
from .spec import EMPTY, FOOD, N_ACTIONS, POISON, WALL, ForageSpec, check_n_envs, check_seed

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
STATE_KEYS = ("seed", "episode", "t", "grid", "pos", "episode_return")


def kth_free(free: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Column of the k-th (0-based) True in each row of ``free`` (len(row) where k >= count)."""
    count = free.cumsum(1, dtype=torch.int32)  # int32: the counts fit and it is faster
    return (count <= k.unsqueeze(1).to(torch.int32)).sum(1)


class ForageTorch:
    """``n_envs`` Forage envs on ``device``; env ``i`` uses hash counter env index
    ``env_offset + i`` (ranks of a distributed run take disjoint ranges).

    Same API and outputs as ForageNumpy, with tensors on ``device``. ``state_dict()`` /
    ``load_state_dict()`` checkpoint the whole env (grids are flat and wall-padded).
    """

    #: One batch of tensor ops steps every env: the cost grows with N only through the device.
    vectorized_on_device = True

    def __init__(self, n_envs: int, spec: ForageSpec | None = None, seed: int = 0,
                 device: str | torch.device = "cpu", final_obs: bool = False,
                 env_offset: int = 0) -> None:
        self.n_envs = check_n_envs(n_envs)
        self.spec = spec if spec is not None else ForageSpec()
        if not isinstance(self.spec, ForageSpec):
            raise TypeError(f"spec must be a ForageSpec, got {type(self.spec).__name__}")
        check_seed(seed)
        self.device = torch.empty(0, device=resolve_device(device)).device  # with its index
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
        """Flat index of the k-th free cell of each env (k from the hash), branch-free.

        Envs with no free cell get an arbitrary valid index; callers mask them out."""
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

    def _check_actions(self, actions: object) -> torch.Tensor:
        allowed = f"integers in [0, {N_ACTIONS})"
        if not isinstance(actions, torch.Tensor) or actions.dtype not in INT_DTYPES:
            kind = getattr(actions, "dtype", type(actions).__name__)
            raise TypeError(f"actions must be a tensor of {allowed}, got {kind}")
        if actions.shape != (self.n_envs,):
            raise ValueError(f"actions must have shape ({self.n_envs},), got "
                             f"{tuple(actions.shape)}")
        if actions.device != self.device:
            raise ValueError(f"actions must be on {self.device}, got {actions.device}")
        msg = f"actions must be {allowed}"
        try:  # checked on the device, no host read (see the module docstring)
            torch._assert_async(((actions >= 0) & (actions < N_ACTIONS)).all(), msg)
        except RuntimeError:
            raise ValueError(msg) from None
        return actions.long()

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, dict]:
        actions = self._check_actions(actions)
        grid, pos = self.grid, self.pos
        target = pos + self._deltas[actions]
        cell = grid.gather(1, target.unsqueeze(1)).squeeze(1)
        moved = cell != WALL
        pos.copy_(torch.where(moved, target, pos))
        cell = torch.where(moved, cell, EMPTY)
        eaten = (cell == FOOD) | (cell == POISON)
        reward = (cell == FOOD).to(torch.float32) - (cell == POISON).to(torch.float32)
        grid.scatter_(1, pos.unsqueeze(1), EMPTY)  # the agent's cell is empty after any step
        self.t += 1
        spawn = self._free_cell(grid, pos, self._env, self.episode, self.t).unsqueeze(1)
        grid.scatter_(1, spawn, torch.where(eaten.unsqueeze(1), cell.unsqueeze(1),
                                            grid.gather(1, spawn)))
        self.episode_return += reward

        truncated = self.t == self.spec.episode_length
        info = {"episode_return": torch.where(truncated, self.episode_return, 0.0),
                "episode_length": torch.where(truncated, self.t, 0)}
        final = self.observation() if self.final_obs else None
        # Same-step reset, computed for every env and kept where truncated: no branch on data.
        self.episode += truncated
        new_grid, new_pos = self._new_episodes(self._env, self.episode)
        grid.copy_(torch.where(truncated.unsqueeze(1), new_grid, grid))
        pos.copy_(torch.where(truncated, new_pos, pos))
        self.t.masked_fill_(truncated, 0)
        self.episode_return.masked_fill_(truncated, 0.0)
        obs = self.observation()
        if final is not None:
            info["final_observation"] = torch.where(truncated.view(-1, 1, 1, 1), final, obs)
        return obs, reward, torch.zeros_like(truncated), truncated, info

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the env state: enough to resume bit-exactly with ``load_state_dict``."""
        return {key: getattr(self, key).clone() for key in STATE_KEYS}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(STATE_KEYS):
            raise ValueError(f"state must have keys {sorted(STATE_KEYS)}, got {sorted(state)}")
        for key in STATE_KEYS:
            mine, value = getattr(self, key), state[key]
            if not isinstance(value, torch.Tensor) or value.shape != mine.shape \
                    or value.dtype != mine.dtype:
                raise ValueError(f"state[{key!r}] must be a {mine.dtype} tensor of shape "
                                 f"{tuple(mine.shape)}")
        for key in STATE_KEYS:
            getattr(self, key).copy_(state[key])  # in place: compiled code and graphs keep it
