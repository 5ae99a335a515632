"""ForagePy: one Forage env in plain Python (lists and ints). The reference implementation."""
from __future__ import annotations

from ..validate import check_int
from .rng import hash32
from .spec import (
    ACTION_DELTAS,
    CHANNEL_OF,
    EMPTY,
    FOOD,
    N_ACTIONS,
    N_CHANNELS,
    POISON,
    WALL,
    ForageSpec,
    check_n_envs,
    check_seed,
)

STATE_KEYS = ("seed", "episode", "t", "grid", "pos", "episode_return")


class ForagePy:
    """One environment: ``reset() -> (obs, info)``, ``step(a) -> (obs, r, term, trunc, info)``.

    ``obs`` is a nested list ``[channel][row][col]`` of floats. ``env_index`` is this env's
    index in the hash counter, so a list of ForagePy reproduces a vectorized env.
    """

    def __init__(self, spec: ForageSpec | None = None, seed: int = 0, env_index: int = 0,
                 final_obs: bool = False) -> None:
        self.spec = spec if spec is not None else ForageSpec()
        if not isinstance(self.spec, ForageSpec):
            raise TypeError(f"spec must be a ForageSpec, got {type(self.spec).__name__}")
        self.seed = check_seed(seed)
        self.env_index = check_int("env_index", env_index, 0)
        self.final_obs = final_obs
        self.reset()

    def _draw(self, step: int, draw: int) -> int:
        return hash32(self.seed, self.env_index, self.episode, step, draw)

    def _place(self, kind: int, step: int, draw: int) -> None:
        free = [(r, c) for r in range(self.spec.height) for c in range(self.spec.width)
                if self.grid[r][c] == EMPTY and (r, c) != self.pos]
        r, c = free[self._draw(step, draw) % len(free)]
        if kind == -1:
            self.pos = (r, c)
        else:
            self.grid[r][c] = kind

    def _new_episode(self) -> None:
        s = self.spec
        self.grid = [[WALL if r in (0, s.height - 1) or c in (0, s.width - 1) else EMPTY
                      for c in range(s.width)] for r in range(s.height)]
        self.pos = (-1, -1)
        kinds = [WALL] * s.n_walls + [-1] + [FOOD] * s.n_food + [POISON] * s.n_poison
        for draw, kind in enumerate(kinds):
            self._place(kind, 0, draw)
        self.t = 0
        self.episode_return = 0.0

    def reset(self, seed: int | None = None) -> tuple[list, dict]:
        if seed is not None:
            self.seed = check_seed(seed)
        self.episode = 0
        self._new_episode()
        return self.observation(), {}

    def observation(self) -> list:
        s, (ar, ac), rad = self.spec, self.pos, self.spec.radius
        obs = [[[0.0] * s.view for _ in range(s.view)] for _ in range(N_CHANNELS)]
        for i in range(s.view):
            for j in range(s.view):
                r, c = ar + i - rad, ac + j - rad
                inside = 0 <= r < s.height and 0 <= c < s.width
                cell = self.grid[r][c] if inside else WALL
                if cell != EMPTY:
                    obs[CHANNEL_OF[cell]][i][j] = 1.0
        return obs

    def step(self, action: int) -> tuple[list, float, bool, bool, dict]:
        if isinstance(action, bool) or not isinstance(action, int):
            raise TypeError(f"action must be an int, got {type(action).__name__}")
        if not 0 <= action < N_ACTIONS:
            raise ValueError(f"action must be in [0, {N_ACTIONS}), got {action}")
        dr, dc = ACTION_DELTAS[action]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if self.grid[r][c] != WALL:
            self.pos = (r, c)
        cell = self.grid[r][c] if self.pos == (r, c) else EMPTY
        reward = 0.0
        if cell in (FOOD, POISON):
            reward = 1.0 if cell == FOOD else -1.0
            self.grid[r][c] = EMPTY
            self._place(cell, self.t + 1, 0)
        self.t += 1
        self.episode_return += reward
        info: dict = {}
        truncated = self.t == self.spec.episode_length
        if truncated:
            info = {"episode_return": self.episode_return, "episode_length": self.t}
            if self.final_obs:
                info["final_observation"] = self.observation()
            self.episode += 1
            self._new_episode()
        return self.observation(), reward, False, truncated, info

    def state_dict(self) -> dict:
        """Plain-data copy of the env state: enough to resume bit-exactly."""
        return {"seed": self.seed, "episode": self.episode, "t": self.t,
                "grid": [list(row) for row in self.grid], "pos": list(self.pos),
                "episode_return": self.episode_return}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must have keys {sorted(STATE_KEYS)}, got {got}")
        self._check_reachable(state)
        self.seed, self.episode, self.t = state["seed"], state["episode"], state["t"]
        self.grid = [list(row) for row in state["grid"]]
        self.pos = tuple(state["pos"])
        self.episode_return = state["episode_return"]


    def _check_reachable(self, state: dict) -> None:
        """The vectorized envs' check (:func:`labkit.envs.numpy.check_reachable`) on this
        env's plain-data state, laid out as theirs: the same states are refused."""
        import torch

        from .numpy import check_reachable
        from .spec import Layout

        s, lay = self.spec, Layout.of(self.spec)
        for key in ("episode", "t"):
            check_int(f"state[{key!r}]", state[key], 0)
        ret = state["episode_return"]
        if isinstance(ret, bool) or not isinstance(ret, (int, float)):
            raise ValueError("state['episode_return'] must be a number")
        try:
            grid = torch.tensor(state["grid"], dtype=torch.int64)
            r, c = (int(v) for v in state["pos"])
        except (TypeError, ValueError, OverflowError):
            raise ValueError("state['grid'] must be rows of cell kinds and state['pos'] a (row, "
                             "column) pair") from None
        if tuple(grid.shape) != (s.height, s.width) or not (0 <= r < s.height and 0 <= c < s.width):
            raise ValueError(f"state['grid'] must be {s.height} x {s.width} and state['pos'] "
                             "a cell of it")
        pad = s.radius
        padded = torch.as_tensor(lay.base, dtype=torch.int64).view(lay.rows, lay.cols).clone()
        padded[pad:pad + s.height, pad:pad + s.width] = grid
        check_reachable({"seed": state["seed"], "episode": torch.tensor([state["episode"]]),
                         "t": torch.tensor([state["t"]]), "grid": padded.view(1, -1),
                         "pos": torch.tensor([(r + pad) * lay.cols + c + pad]),
                         "episode_return": torch.tensor([float(ret)])}, s, lay)


class ForagePyList(list):
    """``n_envs`` independent ForagePy objects, env ``i`` with hash counter index ``i``: the
    per-env Python objects of stage 0. It takes the same arguments as the vectorized envs
    (``device`` is unused: plain Python lives on the host) and checkpoints as one env."""

    #: A Python loop steps each env in turn: the cost grows with N on the host.
    one_env_at_a_time = True

    def __init__(self, n_envs: int, spec: ForageSpec | None = None, seed: int = 0,
                 device: object = None, env_offset: int = 0) -> None:
        super().__init__(ForagePy(spec, seed, env_index=env_offset + i)
                         for i in range(check_n_envs(n_envs)))
        self.n_envs, self.spec = n_envs, self[0].spec

    def reset(self, seed: int | None = None) -> tuple[list, dict]:
        return [env.reset(seed)[0] for env in self], {}

    def observation(self) -> list:
        return [env.observation() for env in self]

    def state_dict(self) -> dict:
        return {"envs": [env.state_dict() for env in self]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("envs", ())) != self.n_envs:
            raise ValueError(f"state must hold {self.n_envs} env states")
        for env, s in zip(self, state["envs"]):
            env.load_state_dict(s)
