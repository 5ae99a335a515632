"""The Forage specification: one place for cells, actions, observation layout and defaults.

Every implementation (Python, NumPy, torch loop, vectorized torch) follows the rules written
here, and the parity tests prove they agree bit for bit.

Rules
-----
* The grid is ``height x width`` with a wall border. Cells hold one of EMPTY, WALL, FOOD, POISON;
  the agent's position is kept apart from the grid.
* Episode reset (env ``i``, episode ``e``), each placement on "the k-th free cell" in row-major
  order, with ``k = hash(seed, i, e, 0, draw) mod (number of free cells)``:
  ``n_walls`` interior walls (draws ``0..n_walls-1``), then the agent (draw ``n_walls``), then
  ``n_food`` food and ``n_poison`` poison cells (the following draws). A cell is free when it is
  EMPTY and not under the agent.
* Step ``t`` (0-based step within the episode): the agent moves by ``ACTION_DELTAS[a]`` unless
  the target is a WALL. Stepping on FOOD gives +1, on POISON -1; the item is removed and respawns
  on the k-th free cell with ``k = hash(seed, i, e, t + 1, 0) mod (free cells)`` (the agent's new
  cell is not free). At most one item is eaten per step.
* After ``episode_length`` steps the episode is truncated (never terminated) and the env resets
  in the same step: the returned observation is the next episode's first.
* Observation: the ``view x view`` window centred on the agent, 3 channels
  (wall, food, poison) as float32; cells off the grid count as wall.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validate import check_int

EMPTY, WALL, FOOD, POISON = 0, 1, 2, 3
N_ACTIONS = 5
#: (row delta, column delta) per action: stay, up, down, left, right.
ACTION_DELTAS = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))
N_CHANNELS = 3
#: Observation channel per cell type.
CHANNEL_OF = {WALL: 0, FOOD: 1, POISON: 2}

MAX_SIDE = 256
MAX_SEED = 2**32 - 1
MAX_ENVS = 2**24


@dataclass(frozen=True)
class ForageSpec:
    """Fixed dynamics of one Forage world. Validated on construction."""

    height: int = 11
    """Grid rows, wall border included."""
    width: int = 11
    """Grid columns, wall border included."""
    n_walls: int = 4
    """Random interior walls placed at each episode reset."""
    n_food: int = 4
    """Food cells (+1 when stepped on, then respawn)."""
    n_poison: int = 3
    """Poison cells (-1 when stepped on, then respawn)."""
    view: int = 7
    """Side of the egocentric observation window (odd)."""
    episode_length: int = 128
    """Steps per episode; then truncation and same-step reset."""

    def __post_init__(self) -> None:
        check_int("height", self.height, 3, MAX_SIDE)
        check_int("width", self.width, 3, MAX_SIDE)
        check_int("view", self.view, 1, 2 * max(self.height, self.width) + 1)
        if self.view % 2 == 0:
            raise ValueError(f"view must be odd (the agent sits in the centre), got {self.view}")
        check_int("episode_length", self.episode_length, 1, 2**31 - 1)
        for name in ("n_walls", "n_food", "n_poison"):
            check_int(name, getattr(self, name), 0)
        needed = self.n_walls + self.n_food + self.n_poison + 1
        if needed > self.interior_cells:
            raise ValueError(
                f"n_walls + n_food + n_poison + 1 (agent) must be <= {self.interior_cells} "
                f"interior cells of a {self.height}x{self.width} grid, got {needed}"
            )

    @property
    def interior_cells(self) -> int:
        return (self.height - 2) * (self.width - 2)

    @property
    def obs_shape(self) -> tuple[int, int, int]:
        return (N_CHANNELS, self.view, self.view)

    @property
    def radius(self) -> int:
        return self.view // 2


def check_n_envs(n_envs: object, name: str = "n_envs") -> int:
    """The one bounds check for a number of parallel envs."""
    return check_int(name, n_envs, 1, MAX_ENVS)


def check_seed(seed: object) -> int:
    return check_int("seed", seed, 0, MAX_SEED)


AGENT = -1
"""Marks the reset draw that places the agent rather than a cell kind."""


@dataclass(frozen=True, eq=False)
class Layout:
    """Flat index tables for a spec's wall-padded grid (row-major, ``rows x cols``)."""

    rows: int
    cols: int
    base: np.ndarray
    """(rows*cols,) int8: WALL on the border and the padding, EMPTY inside."""
    cells: np.ndarray
    """(interior,) int64 flat indices of the interior cells, in row-major order."""
    window: np.ndarray
    """(view*view,) int64 offsets of the observation window from the agent's flat index."""
    deltas: np.ndarray
    """(N_ACTIONS,) int64 flat offset of each action."""
    channel_kinds: np.ndarray
    """(3,) int8 cell kind shown by each observation channel (wall, food, poison)."""
    placements: tuple[int, ...]
    """Kind placed by each reset draw; AGENT for the agent."""

    @classmethod
    def of(cls, spec: ForageSpec) -> Layout:
        pad, v = spec.radius, spec.view
        rows, cols = spec.height + 2 * pad, spec.width + 2 * pad
        base = np.full((rows, cols), WALL, dtype=np.int8)
        base[pad + 1:pad + spec.height - 1, pad + 1:pad + spec.width - 1] = EMPTY
        r, c = np.meshgrid(np.arange(1, spec.height - 1), np.arange(1, spec.width - 1),
                           indexing="ij")
        cells = ((r + pad) * cols + c + pad).ravel()
        i, j = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
        window = ((i - pad) * cols + j - pad).ravel()
        deltas = np.array([dr * cols + dc for dr, dc in ACTION_DELTAS], dtype=np.int64)
        kinds = ([WALL] * spec.n_walls + [AGENT] + [FOOD] * spec.n_food
                 + [POISON] * spec.n_poison)
        return cls(rows, cols, base.ravel(), cells.astype(np.int64), window.astype(np.int64),
                   deltas, np.array([WALL, FOOD, POISON], dtype=np.int8), tuple(kinds))
