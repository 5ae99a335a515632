"""ForageNumpy: N Forage envs vectorized with NumPy, bit-exact with ForagePy.

The vectorized versions keep each grid flat and padded with walls by ``view // 2`` on every
side, so the agent's position is one flat index, a move is an addition and the observation
window is a single gather. ``labkit.envs.spec.Layout`` holds those index tables; ForageTorch uses
the same one.
"""
from __future__ import annotations

import numpy as np
import torch

from .rng import hash_np
from .spec import (
    AGENT,
    EMPTY,
    FOOD,
    N_ACTIONS,
    POISON,
    WALL,
    ForageSpec,
    Layout,
    check_n_envs,
    check_seed,
)

STATE_ARRAYS = ("episode", "t", "grid", "pos", "episode_return")


def check_reachable(state: dict, spec: ForageSpec, layout: Layout) -> None:
    """Raise ValueError, naming the key, unless ``state`` (tensors of the right shapes, on any
    device; read on the host, once, at load) is a state ``spec`` can reach: seeds and episode
    counts in range, step counters in [0, episode_length), the agent on an interior cell with
    nothing under it, the spec's walls, food and poison inside a wall border, and episode
    returns finite and within the step counter (each step's reward is -1, 0 or +1). ForageNumpy
    and ForageTorch refuse the same states."""
    from .spec import MAX_SEED

    for key in ("seed", "episode", "t", "pos", "grid", "episode_return"):
        if isinstance(state[key], torch.Tensor) and state[key].is_meta:
            raise ValueError(f"state[{key!r}] is on the meta device: it holds no values to "
                             "load")
    seed, episode = state["seed"], state["episode"].cpu()
    t, pos, grid = state["t"].cpu(), state["pos"].cpu(), state["grid"].cpu()
    ret = state["episode_return"].cpu()
    seed_ok = (not isinstance(seed, bool) and isinstance(seed, int) and 0 <= seed <= MAX_SEED) \
        if not isinstance(seed, torch.Tensor) else not seed.is_floating_point() \
        and bool(((seed >= 0) & (seed <= MAX_SEED)).all())
    if not seed_ok:
        raise ValueError(f"state['seed'] must be integers in [0, {MAX_SEED}]")
    for key, value in (("episode", episode), ("t", t), ("pos", pos), ("grid", grid)):
        if value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(f"state[{key!r}] must hold integers, got {value.dtype}")
    if bool((episode < 0).any()):
        raise ValueError("state['episode'] must be episode counts >= 0")
    if bool(((t < 0) | (t >= spec.episode_length)).any()):
        raise ValueError(f"state['t'] must be steps in [0, {spec.episode_length})")
    interior = torch.zeros(len(layout.base) + 1, dtype=torch.bool)
    interior[torch.as_tensor(layout.cells)] = True
    if bool(((pos < 0) | (pos >= len(layout.base))).any()) or not bool(interior[pos].all()):
        raise ValueError("state['pos'] must be interior cells of the grid (flat indices)")
    if not ret.is_floating_point() or not bool(torch.isfinite(ret).all()) \
            or bool((ret.abs() > t).any()):
        raise ValueError("state['episode_return'] must be finite and at most state['t'] in "
                         "size (each step's reward is -1, 0 or +1)")
    cells = torch.as_tensor(layout.cells)
    inside, outside = grid[:, cells].long(), grid.clone().long()
    outside[:, cells] = WALL
    counts = [(inside == kind).sum(1) for kind in (WALL, FOOD, POISON)]
    if not bool((outside == WALL).all()) \
            or not bool(((inside >= EMPTY) & (inside <= POISON)).all()) \
            or any(bool((c != want).any()) for c, want in zip(counts, (spec.n_walls, spec.n_food,
                                                                       spec.n_poison))) \
            or bool((grid.long().gather(1, pos.long().unsqueeze(1)) != EMPTY).any()):
        raise ValueError(f"state['grid'] must hold this spec's {spec.n_walls} walls, "
                         f"{spec.n_food} food and {spec.n_poison} poison inside a wall border, "
                         "and nothing under the agent (a state of another spec?)")


def kth_free(free: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Column of the k-th (0-based) True in each row of ``free`` (len(row) where k >= count)."""
    return (free.cumsum(1) <= k[:, None]).sum(1)


class ForageNumpy:
    """``n_envs`` Forage envs; env ``i`` uses hash counter env index ``env_offset + i``.

    ``reset() -> (obs, info)``, ``step(actions) -> (obs, reward, terminated, truncated, info)``
    with obs float32 (N, 3, V, V), reward float32 (N,), terminated/truncated bool (N,) and
    info ``episode_return`` float32 / ``episode_length`` int64 (0 where no episode ended), plus
    ``final_observation`` when ``final_obs`` is set. ``device`` is unused (NumPy arrays live on
    the host); it is accepted so that every vectorized Forage is built with the same arguments.
    """

    def __init__(self, n_envs: int, spec: ForageSpec | None = None, seed: int = 0,
                 *, device: object = None, final_obs: bool = False,
                 env_offset: int = 0) -> None:
        self.n_envs = check_n_envs(n_envs)
        self.spec = spec if spec is not None else ForageSpec()
        if not isinstance(self.spec, ForageSpec):
            raise TypeError(f"spec must be a ForageSpec, got {type(self.spec).__name__}")
        self.seed = check_seed(seed)
        self.final_obs = bool(final_obs)
        self.layout = Layout.of(self.spec)
        self.env_index = np.arange(env_offset, env_offset + self.n_envs, dtype=np.int64)
        self.reset()

    def _free_cell(self, grid: np.ndarray, pos: np.ndarray, episode: np.ndarray,
                   step: np.ndarray) -> np.ndarray:
        """Flat index of the k-th free cell of every env (k from the hash), branch-free.

        Envs with no free cell get an arbitrary valid index; callers mask them out."""
        cells = self.layout.cells
        free = (grid[:, cells] == EMPTY) & (cells != pos[:, None])
        count = np.maximum(free.sum(1), 1).astype(np.uint64)
        k = (hash_np(self.seed, self.env_index, episode, step, 0) % count).astype(np.int64)
        return cells[np.minimum(kth_free(free, k), len(cells) - 1)]

    def _new_episodes(self, episode: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fresh grids and agent positions for every env at episode ``episode``."""
        lay, n = self.layout, self.n_envs
        draws = np.arange(len(lay.placements))
        h = hash_np(self.seed, self.env_index[:, None], episode[:, None], 0, draws)
        free = np.ones((n, len(lay.cells)), dtype=bool)
        taken = np.empty((n, len(draws)), dtype=np.int64)
        rows = np.arange(n)
        for d in draws:
            # Each draw takes one interior cell, so draw d chooses among len(cells) - d.
            k = (h[:, d] % np.uint64(len(lay.cells) - d)).astype(np.int64)
            taken[:, d] = kth_free(free, k)
            free[rows, taken[:, d]] = False
        grid = np.tile(lay.base, (n, 1))
        kinds = np.array(lay.placements, dtype=np.int8)
        items = kinds != AGENT
        grid[rows[:, None], lay.cells[taken[:, items]]] = kinds[items]
        return grid, lay.cells[taken[:, lay.placements.index(AGENT)]]

    def observation(self) -> np.ndarray:
        cells = np.take_along_axis(self.grid, self.pos[:, None] + self.layout.window, 1)
        obs = cells[:, None, :] == self.layout.channel_kinds[None, :, None]
        return obs.astype(np.float32).reshape(self.n_envs, *self.spec.obs_shape)

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.seed = check_seed(seed)
        self.episode = np.zeros(self.n_envs, dtype=np.int64)
        self.grid, self.pos = self._new_episodes(self.episode)
        self.t = np.zeros(self.n_envs, dtype=np.int64)
        self.episode_return = np.zeros(self.n_envs, dtype=np.float32)
        return self.observation(), {}

    def _check_actions(self, actions: object) -> np.ndarray:
        allowed = f"integers in [0, {N_ACTIONS})"
        if not isinstance(actions, np.ndarray) or not np.issubdtype(actions.dtype, np.integer):
            kind = getattr(actions, "dtype", type(actions).__name__)
            raise TypeError(f"actions must be a NumPy array of {allowed}, got {kind}")
        if actions.shape != (self.n_envs,):
            raise ValueError(f"actions must have shape ({self.n_envs},), got {actions.shape}")
        if actions.min() < 0 or actions.max() >= N_ACTIONS:
            raise ValueError(f"actions must be {allowed}, got values in "
                             f"[{actions.min()}, {actions.max()}]")
        return actions.astype(np.int64)

    def step(self, actions: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        actions = self._check_actions(actions)
        rows = np.arange(self.n_envs)
        target = self.pos + self.layout.deltas[actions]
        cell = self.grid[rows, target]
        moved = cell != WALL
        self.pos = np.where(moved, target, self.pos)
        cell = np.where(moved, cell, EMPTY)
        eaten = (cell == FOOD) | (cell == POISON)
        reward = (cell == FOOD).astype(np.float32) - (cell == POISON).astype(np.float32)
        self.grid[rows, self.pos] = EMPTY  # the agent's cell is empty after any step
        self.t += 1
        spawn = self._free_cell(self.grid, self.pos, self.episode, self.t)
        self.grid[rows, spawn] = np.where(eaten, cell, self.grid[rows, spawn])
        self.episode_return += reward

        truncated = self.t == self.spec.episode_length
        info = {"episode_return": np.where(truncated, self.episode_return, 0).astype(np.float32),
                "episode_length": np.where(truncated, self.t, 0)}
        final = self.observation() if self.final_obs else None
        # Same-step reset. The arrays live on the host, so this branch costs no sync and skips
        # the reset work on the steps where no episode ends.
        if truncated.any():
            self.episode += truncated
            grid, pos = self._new_episodes(self.episode)
            self.grid = np.where(truncated[:, None], grid, self.grid)
            self.pos = np.where(truncated, pos, self.pos)
            self.t[truncated] = 0
            self.episode_return[truncated] = 0
        obs = self.observation()
        if final is not None:
            info["final_observation"] = np.where(truncated[:, None, None, None], final, obs)
        return obs, reward, np.zeros_like(truncated), truncated, info

    def state_dict(self) -> dict:
        """Copies of the env state (as CPU tensors, so checkpoints load with weights_only)."""
        return {"seed": self.seed,
                **{k: torch.from_numpy(getattr(self, k).copy()) for k in STATE_ARRAYS}}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"seed", *STATE_ARRAYS}:
            raise ValueError(f"state must have keys {sorted(['seed', *STATE_ARRAYS])}, "
                             f"got {sorted(state)}")
        for key in STATE_ARRAYS:
            mine, value = getattr(self, key), state[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != mine.shape:
                raise ValueError(f"state[{key!r}] must be a tensor of shape {mine.shape}")
        check_reachable(state, self.spec, self.layout)
        self.seed = check_seed(state["seed"])
        for key in STATE_ARRAYS:
            setattr(self, key, state[key].numpy().astype(getattr(self, key).dtype))
