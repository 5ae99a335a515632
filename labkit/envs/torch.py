"""ForageTorch: N Forage envs as tensors on any device, stepped with zero host reads.

Every branch of ForagePy becomes a ``torch.where`` or a write routed to a cell where it changes
nothing; shapes are static and the state is updated in place, so ``step`` can be compiled or
captured in a CUDA graph. A step is 48 non-view ops (dispatches, each but one allocation a
kernel launch or more on a GPU; the default spec, no final observations) whatever N is and
whichever episodes end. What makes it fast is what it does *not* do on every step:

* **The reset is built ahead.** The next episode's layout depends only on (seed, env, episode),
  so it is built one placement draw per step while the current episode runs, in a second grid
  (lane 1), and shifted in (with lane 2, an empty grid, shifted into lane 1) by one
  ``torch.where`` over int64 words where the episode ended. Each step does the same small
  amount of layout work whether 0 or N episodes end. Where an episode is shorter than the
  number of draws, each step makes ``ceil(draws / episode_length)`` of them.
* **One search finds both cells.** The respawn of an eaten item (lane 0) and the layout draw
  (lane 1) are each "the k-th free cell" of their lane: one ``cumsum`` over both lanes' free
  masks and one ``searchsorted`` find them. The number of free cells at a respawn is the same
  on every step (interior - walls - items, a constant of the spec), so k needs no count; one
  table row, looked up by (the kind of cell moved to, the draw), holds both lanes' moduli, the
  values written and the reward.
* **One hash level per step.** ``hash32`` mixes (seed, env, episode, step, draw) in turn, ten
  ops a level. The per-env and per-episode prefixes are kept, and the first level of the next
  step's respawn is mixed one step ahead, so one ``mix`` over the keys xored with the counters
  makes every hash the step needs and every key of the next step (``_placements``).
* **The grid is the interior only**, one int8 per cell plus one wall column that stands for
  every cell outside (moves and observation windows go through index tables), and the agent's
  cell holds ``AGENT_CELL``, so "free" is a single comparison.
* **Nothing is made per step but what it returns.** Every intermediate the step writes
  (free masks and counts, the looked-up table rows, the hash mixes, the window) lives in
  scratch allocated once and written with ``out=`` or in place, and every view of state or
  scratch the step uses (a lane, a row of counters, a column) is made once in ``_scratch``.
  In eager each view is a dispatch of its own, and each fresh intermediate is memory the
  allocator may have to map again: on the 2-core CPU this step was timed on, the two made
  the step 1.5x faster at N=32 and 256 and 1.2x at N=4096 (``scripts/env_ab.py`` against
  commit 8107e85).

All of this is state derived from (seed, env, episode, t) and the grid: ``state_dict`` holds
ForageNumpy's layout (flat grids padded with walls, flat positions), the same as
ForageTorchLoop's, and ``load_state_dict`` rebuilds the rest, so checkpoints written before this
design load unchanged, and envs may be at different steps of their episodes.

An action out of range fails the gather that looks it up in the move table: an eager step on
the CPU raises at once, before any write (re-raised here as ValueError); compiled code raises
its own index error; on CUDA it is a device-side assert that fails a later call and poisons the
CUDA context, the price of not syncing to check.
"""
from __future__ import annotations

import numpy as np
import torch

from ..device import resolve_device
from .numpy import check_reachable
from .rng import GOLDEN, MASK, chain, mix, mix_
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

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
STATE_KEYS = ("seed", "episode", "t", "grid", "pos", "episode_return")
AGENT_CELL = 4
"""What ForageTorch's grid holds under the agent (ForagePy keeps the position apart). The
observation shows it as empty; it makes the agent's cell not free without a comparison."""
assert EMPTY == 0, "ForageTorch empties a lane by multiplying it by 0"


def check_env_args(n_envs: object, spec: object, seed: object, device: object
                   ) -> tuple[int, ForageSpec, torch.device]:
    """The checked ``n_envs``, spec (default ``ForageSpec()``) and device (with its index) of
    a torch Forage; ``seed`` is checked too."""
    spec = spec if spec is not None else ForageSpec()
    if not isinstance(spec, ForageSpec):
        raise TypeError(f"spec must be a ForageSpec, got {type(spec).__name__}")
    check_seed(seed)
    device = torch.empty(0, device=resolve_device(device)).device  # with its index
    return check_n_envs(n_envs), spec, device


ACTIONS_ALLOWED = f"integers in [0, {N_ACTIONS})"


def check_actions(actions: object, n_envs: int, device: torch.device, in_range: bool = True
                  ) -> torch.Tensor:
    """``actions`` as int64, after checking type, shape, device and (``in_range``: on the
    device, four ops) range."""
    allowed = ACTIONS_ALLOWED
    if not isinstance(actions, torch.Tensor) or actions.dtype not in INT_DTYPES:
        kind = getattr(actions, "dtype", type(actions).__name__)
        raise TypeError(f"actions must be a tensor of {allowed}, got {kind}")
    if actions.shape != (n_envs,):
        raise ValueError(f"actions must have shape ({n_envs},), got {tuple(actions.shape)}")
    if actions.device != device:
        raise ValueError(f"actions must be on {device}, got {actions.device}")
    msg = f"actions must be {allowed}"
    if not in_range:
        return actions.long()
    try:  # checked on the device, no host read (see the module docstring)
        torch._assert_async(actions.clamp(0, N_ACTIONS - 1).eq(actions).all(), msg)
    except RuntimeError:
        raise ValueError(msg) from None
    return actions.long()


def check_state(state: object, like: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``state`` has the keys of ``like`` and tensors of its shapes and
    dtypes."""
    if not isinstance(state, dict) or set(state) != set(like):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state must have keys {sorted(like)}, got {got}")
    for key, mine in like.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.shape != mine.shape \
                or value.dtype != mine.dtype:
            raise ValueError(f"state[{key!r}] must be a {mine.dtype} tensor of shape "
                             f"{tuple(mine.shape)}")


def nth_free(free: torch.Tensor, n: torch.Tensor, dtype: torch.dtype = torch.int32
             ) -> torch.Tensor:
    """Column of the ``n``-th (1-based) nonzero in each row of ``free`` (0/1 or bool, shape
    ``[..., C]``; ``n`` has the leading shape), or C where the row has fewer: a running count,
    then a binary search for the first column where it reaches n. ``dtype`` must hold
    C + 1, and ``n`` must be in [1, C + 1] (larger values would wrap in that dtype)."""
    cols = free.shape[-1]
    count = free.reshape(-1, cols).cumsum(1, dtype=dtype).view(free.shape)
    return torch.searchsorted(count, n.to(dtype).unsqueeze(-1)).squeeze(-1)


def kth_free(free: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Column of the k-th (0-based) True in each row of ``free`` (len(row) where k >= count)."""
    return nth_free(free, (k + 1).clamp(max=free.shape[-1] + 1))


class ForageTorch:
    """``n_envs`` Forage envs on ``device``; env ``i`` uses hash counter env index
    ``env_offset + i`` (ranks of a distributed run take disjoint ranges).

    Same API and outputs as ForageNumpy, with tensors on ``device``. ``state_dict()`` /
    ``load_state_dict()`` checkpoint the whole env in ForageNumpy's layout.
    """

    #: One batch of tensor ops steps every env: the cost grows with N only through the device.
    vectorized_on_device = True

    def __init__(self, n_envs: int, spec: ForageSpec | None = None, seed: int = 0,
                 device: str | torch.device = "cpu", final_obs: bool = False,
                 env_offset: int = 0) -> None:
        self.n_envs, self.spec, self.device = check_env_args(n_envs, spec, seed, device)
        self.final_obs = bool(final_obs)
        self._tables(Layout.of(self.spec))
        dev, n, k = self.device, self.n_envs, self._draws_per_step
        self._env = torch.arange(env_offset, env_offset + n, device=dev)
        self._zero = torch.zeros(n, dtype=torch.int64, device=dev)
        self._zero_f = torch.zeros((), dtype=torch.float32, device=dev)

        self.seed = torch.tensor(seed, dtype=torch.int64, device=dev)
        #: Counters, one row each, [6 + k, N] int64: episode, (episode + 3) & MASK, 1, 0, 0,
        #: t, t + 2, then k - 1 zeros. Rows 1 to 5 + k are what the hash keys are xored with
        #: (``_placements``); ``episode`` and ``t`` are rows 0 and 5.
        self._ctr = torch.zeros(6 + k, n, dtype=torch.int64, device=dev)
        self.episode, self.t = self._ctr[0], self._ctr[5]
        self.episode_return = torch.zeros(n, dtype=torch.float32, device=dev)
        #: [3, N, cells + 1 + padding] int8: lane 0 the current grids, lane 1 the next
        #: episodes', built ahead, lane 2 empty grids (never written); column ``cells`` is
        #: WALL and stands for every cell outside the interior. The padding, never read, makes
        #: a grid whole int64 words, so the episode end moves grids 8 cells at a time.
        self.lanes = torch.empty(3, n, len(self._fresh), dtype=torch.int8, device=dev)
        #: Interior index of the agent's cell (lane 0), and of its next-episode cell (lane 1;
        #: column 1 takes the writes of the other draws).
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self._next_pos = torch.zeros(n, 2, dtype=torch.int64, device=dev)
        #: Hash keys and their mixes, one row each, [2 * (5 + k), N] int64: the keys S, F, G,
        #: P, F0, E and k - 1 more copies of F0, then their mixes after the xor with the
        #: counters' rows 1 to 5 + k (the copies of F0 with the step's draws: ``_placements``).
        self._keys = torch.zeros(2 * (5 + k), n, dtype=torch.int64, device=dev)
        self._scratch(n, k)
        self.reset()

    def _scratch(self, n: int, k: int) -> None:
        """What each step writes and throws away, allocated once (nothing is allocated for it
        per step but the tensors it returns), and the views of state and scratch the step
        uses, made once: in eager each view is a dispatch of its own (50 of the step's 93
        dispatches were views; 8 are now)."""
        dev, w, cells = self.device, 5 + k, self._n_cells
        self._free = torch.empty(2, n, cells, dtype=torch.int8, device=dev)
        self._count = torch.empty(2, n, cells, dtype=self._count_dtype, device=dev)
        self._count_rows = self._count.view(2 * n, cells)
        self._free_rows = self._free.view(2 * n, cells)
        #: Per placement pass: the rows of ``_rows`` and ``_values`` looked up, and n.
        self._row = torch.empty(k, len(self._rows), n, dtype=torch.int64, device=dev)
        self._value = torch.empty(k, 2, n, 1, dtype=torch.int8, device=dev)
        self._n = torch.zeros(k, 2, n, 1, dtype=self._count_dtype, device=dev)
        self._rolled = torch.empty(len(self._roll), n, dtype=torch.int64, device=dev)
        self._shifted = torch.empty(w, n, dtype=torch.int64, device=dev)  # mix_'s shifts
        self._moves = torch.empty(n, len(self._layout.deltas), dtype=torch.int64, device=dev)
        #: The observation's window (interior columns) and the cells seen through it.
        self._window_at = torch.empty(n, len(self._window_offsets), dtype=torch.int64,
                                      device=dev)
        self._seen = torch.empty(n, len(self._window_offsets), dtype=torch.int8, device=dev)
        lanes, ctr, keys = self.lanes, self._ctr, self._keys
        self._views = {
            "here": lanes[0], "free_lanes": lanes[:2, :, :cells],
            "pos_col": self.pos.unsqueeze(1), "next_agent": self._next_pos[:, 0],
            "kinds": self._channel_kinds.view(1, -1, 1), "seen": self._seen.unsqueeze(1),
            "ctr_xor": ctr[1:w + 1], "ctr_t": ctr[5:7], "ctr_end": ctr[:7], "ctr_ep3": ctr[1],
            "keys": keys[:w], "mixed": keys[w:], "rolled": (self._rolled[:w], self._rolled[w:]),
            # Per pass: the row looked up, its moduli, offsets and _next_pos column, the
            # values (flat and as a column), n (flat and as a column), and the pass's hashes.
            "passes": [(self._row[j], self._row[j, :2], self._row[j, 2:4],
                        self._row[j, 4].unsqueeze(1), self._value[j].view(2, n), self._value[j],
                        self._n[j].view(2, n), self._n[j],
                        keys[w + 3:w + 5] if j == 0 else keys[w + 4 + j:w + 6 + j])
                       for j in range(k)],
        }

    def _tables(self, lay: Layout) -> None:
        """Index tables of the interior-only grid, and the tables of the placement passes."""
        s, cells = self.spec, lay.cells
        n_cells = self._n_cells = len(cells)
        interior = np.full(lay.rows * lay.cols, n_cells, dtype=np.int64)  # else: wall column
        interior[cells] = np.arange(n_cells)
        draws = self._n_draws = len(lay.placements)
        k = self._draws_per_step = -(-draws // s.episode_length)
        self._layout = lay
        self._count_dtype = next(dtype for dtype in (torch.int8, torch.int16, torch.int32)
                                 if n_cells + 1 <= torch.iinfo(dtype).max)
        free_at_respawn = n_cells - s.n_walls - s.n_food - s.n_poison  # >= 1 (spec check)
        # One row per (kind of the cell moved to c, layout draw d; d == draws: the layout is
        # done), at c * (draws + 1) + d: the moduli and the offsets that turn each lane's hash
        # into a 1-based free-cell number (past every cell: a WALL write on the wall column,
        # for "nothing eaten" and "layout done"), the _next_pos column of the draw's cell (0
        # for the agent's), the values written, and the step's reward.
        rows, values, rewards = [], [], []
        for c in range(AGENT_CELL + 1):
            eaten = c in (FOOD, POISON)
            for d in range(draws + 1):
                kind = lay.placements[d] if d < draws else WALL
                rows.append((free_at_respawn if eaten else 1, n_cells - d if d < draws else 1,
                             1 if eaten else n_cells + 1, 1 if d < draws else n_cells + 1,
                             0 if kind == AGENT else 1))
                values.append((c if eaten else WALL, AGENT_CELL if kind == AGENT else kind))
                rewards.append(1.0 if c == FOOD else -1.0 if c == POISON else 0.0)

        def on_device(a, dtype=None) -> torch.Tensor:
            return torch.as_tensor(a, dtype=dtype, device=self.device)

        self._rows = on_device(rows, torch.int64).T.contiguous()  # one row per field
        self._values = on_device(values, torch.int8).T.contiguous()
        self._rewards = on_device(rewards, torch.float32)
        self._draw_kind = on_device([AGENT_CELL if kind == AGENT else kind
                                     for kind in lay.placements], torch.int8)
        self._draw_offsets = on_device(range(k), torch.int64)
        # What an episode's end adds to the counters' rows 0 to 6 (see __init__).
        self._end_delta = on_device([1, 1, 0, 0, 0, -s.episode_length, -s.episode_length]
                                    ).unsqueeze(1)
        # The keys' columns after a step (see _placements), in the order: ended, going on.
        w = 5 + k
        self._roll = on_device([0, 2, w, w + 1, w + 2, 1, *[w + 2] * (k - 1),
                                0, 1, 2, w + 5, *range(4, w)])
        self._move = on_device(interior[cells[:, None] + lay.deltas[None, :]])
        # The window table costs cells x view^2 int64: kept up to 4M entries (32 MiB); beyond,
        # the observation maps padded offsets to interior columns on each call.
        self._window_offsets = on_device(lay.window)
        self._window = on_device(interior[cells[:, None] + lay.window[None, :]]) \
            if n_cells * len(lay.window) <= 2**22 else None
        self._interior, self._cells = on_device(interior), on_device(cells)
        self._base = on_device(lay.base)
        self._channel_kinds = on_device(lay.channel_kinds)
        self._fresh = on_device([EMPTY] * n_cells + [WALL] + [EMPTY] * (7 - n_cells % 8),
                                torch.int8)

    # --------------------------------------------------------------------- layout and state

    def _set_keys(self) -> None:
        """Hash keys from seed, env, episode and t (off the step path): the env's prefix S,
        the prefixes E, F, G of this episode and the two after, P = mix(E ^ (t + 1)) (the
        next respawn's first level) and F0 = mix(F) (the next layout's step-0 prefix)."""
        ep, k, ctr = self.episode, self._draws_per_step, self._ctr
        s = chain(GOLDEN, self.seed, self._env)
        e, f, g = (chain(s, ep + i) for i in range(3))
        p, f0 = chain(e, self.t + 1), mix(f)
        self._keys[:5 + k].copy_(torch.stack((s, f, g, p, f0, e, *[f0] * (k - 1))))
        ctr[1] = (ep + 3) & MASK
        ctr[2], ctr[3:5], ctr[7:] = 1, 0, 0
        ctr[6] = self.t + 2

    def _place(self, n: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write ``values[l]`` on the ``n[l]``-th free cell of lane ``l`` (each ``[2, N, 1]``,
        ``n`` of ``_count_dtype``), both lanes in one search (``nth_free``, inlined into
        scratch); an ``n`` past the free cells writes on the wall column (so the value must be
        WALL). Returns the columns written, ``[2, N, 1]``."""
        # The comparison writes int8, not bool: 7x faster on the 2-core x86 CPU it was timed on.
        torch.eq(self._views["free_lanes"], EMPTY, out=self._free)
        torch.cumsum(self._free_rows, 1, dtype=self._count_dtype, out=self._count_rows)
        col = torch.searchsorted(self._count, n)
        self.lanes.scatter_(2, col, values)
        return col

    def _build(self, done: torch.Tensor) -> None:
        """Layout draws ``0 .. done[l] - 1`` on lane ``l`` (lane 0: this episode, lane 1: the
        next); the lanes must hold the draws before those. Not on the step path."""
        start = torch.stack((mix(self._keys[5]), self._keys[4]))
        for d, kind in enumerate(self._layout.placements):
            draw = done > d
            n = torch.where(draw, mix(start ^ d) % (self._n_cells - d) + 1, self._n_cells + 1)
            values = torch.where(draw, self._draw_kind[d], WALL).to(torch.int8)
            col = self._place(n.to(self._count_dtype).unsqueeze(2), values.unsqueeze(2))[..., 0]
            if kind == AGENT:
                self.pos.copy_(torch.where(draw[0], col[0], self.pos))
                self._next_pos[:, 0].copy_(torch.where(draw[1], col[1], self._next_pos[:, 0]))

    def _built_ahead(self) -> torch.Tensor:
        """How many draws of the next layout a step at ``t`` finds made (per env)."""
        return (self.t * self._draws_per_step).clamp(max=self._n_draws)

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        if seed is not None:
            self.seed.fill_(check_seed(seed))
        self.episode.zero_()
        self.t.zero_()
        self.episode_return.zero_()
        self._set_keys()
        self.lanes.copy_(self._fresh.expand_as(self.lanes))
        self._build(torch.stack((torch.full_like(self.t, self._n_draws), self._zero)))
        return self.observation(), {}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor of env state the step reads or writes in place. Compiled code and CUDA
        graphs hold these very tensors, so ``reset`` and ``load_state_dict`` write into them
        (``episode`` and ``t`` are views of ``_ctr``). Change the state through those two only:
        the hash keys are derived from ``t`` and ``episode`` there, not on every step."""
        return {name: getattr(self, name) for name in (
            "seed", "episode", "t", "episode_return", "lanes", "pos", "_next_pos", "_ctr",
            "_keys", "_free", "_count", "_row", "_value", "_n", "_rolled", "_shifted", "_moves",
            "_window_at", "_seen")}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the env state in ForageNumpy's layout: enough to resume bit-exactly with
        ``load_state_dict`` (here or in ForageTorchLoop)."""
        here = self.lanes[0, :, :self._n_cells]
        grid = self._base.repeat(self.n_envs, 1)
        grid[:, self._cells] = torch.where(here == AGENT_CELL, EMPTY, here)
        return {"seed": self.seed.clone(), "episode": self.episode.clone(),
                "t": self.t.clone(), "grid": grid, "pos": self._cells[self.pos],
                "episode_return": self.episode_return.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a ``state_dict`` (this env's, ForageNumpy's as tensors, or ForageTorchLoop's),
        after checking on the host that it is a state this spec can reach: the step relies on
        the spec's counts of walls and items (a state of another spec is refused)."""
        check_state(state, self.state_dict())
        check_reachable(state, self.spec, self._layout)
        pos = self._interior[state["pos"].to(self.device)]
        for key in ("seed", "episode", "t", "episode_return"):
            getattr(self, key).copy_(state[key])  # in place: compiled code and graphs keep it
        self.pos.copy_(pos)
        self._set_keys()
        self.lanes.copy_(self._fresh.expand_as(self.lanes))
        self.lanes[0, :, :self._n_cells] = state["grid"].to(self.device)[:, self._cells]
        self.lanes[0].scatter_(1, pos.unsqueeze(1), AGENT_CELL)
        self._build(torch.stack((self._zero, self._built_ahead())))

    # --------------------------------------------------------------------- the step

    def observation(self, pos: torch.Tensor | None = None) -> torch.Tensor:
        """The (N, 3, view, view) observations, around ``pos`` (default: the agents')."""
        pos = self.pos if pos is None else pos
        if self._window is not None:
            window = torch.index_select(self._window, 0, pos, out=self._window_at)
        else:
            window = self._interior[self._cells[pos].unsqueeze(1) + self._window_offsets]
        torch.gather(self._views["here"], 1, window, out=self._seen)
        obs = torch.empty(self.n_envs, len(self._channel_kinds), self._seen.shape[1],
                          dtype=torch.float32, device=self.device)
        torch.eq(self._views["seen"], self._views["kinds"], out=obs)  # straight into float32
        return obs.view(self.n_envs, *self.spec.obs_shape)

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, dict]:
        actions = check_actions(actions, self.n_envs, self.device, in_range=False)
        cell = self._walk(actions)
        reward, passes = self._placements(cell)
        for n, values, column in passes:  # one pass, or more if episodes are short
            col = self._place(n, values)
            self._next_pos.scatter_(1, column, col[1])
        truncated, info = self._end_episodes(reward)
        obs = self.observation()
        if self.final_obs:
            info["final_observation"] = torch.where(truncated.view(-1, 1, 1, 1),
                                                    info["final_observation"], obs)
        return obs, reward, torch.zeros_like(truncated), truncated, info

    def _walk(self, actions: torch.Tensor) -> torch.Tensor:
        """Move unless the target is a wall (AGENT_CELL moves with the agent); the kind of the
        cell moved to, before the move. The actions' range is checked by the gather that
        looks them up: eager on the CPU it raises (re-raised as ValueError) before any write."""
        here, pos = self._views["here"], self._views["pos_col"]  # [N, cells + 1], [N, 1]
        moves = torch.index_select(self._move, 0, self.pos, out=self._moves)
        if torch.compiler.is_compiling():  # compiled code checks indices with device asserts
            target = moves.gather(1, actions.unsqueeze(1))
        else:
            try:
                target = moves.gather(1, actions.unsqueeze(1))
            except RuntimeError:
                raise ValueError(f"actions must be {ACTIONS_ALLOWED}") from None
        cell = here.gather(1, target)
        here.scatter_(1, pos, EMPTY)
        torch.where(cell != WALL, target, pos, out=pos)
        here.scatter_(1, pos, AGENT_CELL)
        return cell.squeeze(1)

    def _placements(self, cell: torch.Tensor
              ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """The step's reward, and per placement pass the 1-based free-cell numbers (the
        respawn, the next layout's draw), the values to write and the draw's ``_next_pos``
        column; moves ``t`` on. One ``mix`` of the keys xored with the counters makes every
        hash the step needs and every key of the next step (t before the step; S =
        chain(GOLDEN, seed, env), E, F, G = chain(S, episode + 0, 1, 2), P = mix(E ^ (t +
        1)), F0 = mix(F)):

        ====  =====================  ==============================================
        key   xored with             mixed, it is
        ====  =====================  ==============================================
        S     (episode + 3) & MASK   G of the next episode
        F     1                      P of the next episode's first step
        G     0                      F0 of the next episode
        P     0                      the respawn's hash, chain(E, t + 1, 0)
        F0    t (the draw d)         the layout draw's hash, chain(F, 0, d)
        E     t + 2                  P of the next step
        ====  =====================  ==============================================

        ``_end_episodes`` keeps the keys, P moved on, or rolls them (E <- F, F <- G, ...) with
        one ``where``. When episodes are shorter than the layout, a step makes k draws, t * k
        + j, from k copies of F0."""
        k, draws, t, views = self._draws_per_step, self._n_draws, self.t, self._views
        keys, x = views["keys"], views["mixed"]
        torch.bitwise_xor(keys, views["ctr_xor"], out=x)
        if k > 1:  # the draws t * k + j, xored into the copies of F0
            d = torch.add(self._draw_offsets.unsqueeze(1), t, alpha=k)
            x[4] = keys[4] ^ d[0]
            x[6:] = keys[6:] ^ d[1:]
            d = d.clamp(max=draws)
        else:
            d = (t.clamp(max=draws),)
        mix_(x, self._shifted)
        views["ctr_t"].add_(1)
        passes = []
        # After the first pass, the rows of "nothing eaten" (c = EMPTY); row 4 + j of the
        # mixes: any (mod 1). Everything is written into scratch, through views made once.
        for j, (row, moduli, offsets, column, value, values, n, n_col, hashes) in enumerate(
                views["passes"]):
            at = torch.add(d[0], cell, alpha=draws + 1) if j == 0 else d[j]
            torch.index_select(self._rows, 1, at, out=row)
            torch.remainder(hashes, moduli, out=n).add_(offsets)
            torch.index_select(self._values, 1, at, out=value)
            passes.append((n_col, values, column))
            if j == 0:
                reward = self._rewards.index_select(0, at)
        return reward, passes

    def _end_episodes(self, reward: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Episode statistics, then the same-step reset where ``t`` reached the episode length:
        the next layout is ready in lane 1; shift lanes 1 and 2 (empty) into 0 and 1 there,
        roll the keys, restart the counters."""
        t, pos, lanes = self.t, self.pos, self.lanes
        length = self.spec.episode_length
        self.episode_return += reward
        truncated = t == length
        info = {"episode_return": torch.where(truncated, self.episode_return, self._zero_f),
                "episode_length": torch.where(truncated, t, self._zero)}
        if self.final_obs:
            # The agents' cells found in the grid, not read from ``pos``: the same cells, but
            # torch 2.11's inductor fuses this read of ``pos`` with the walk's write into one
            # kernel that reads it before the write (a compiled step's final observations
            # were taken from before the move; tests/test_envs.py, torch 2.13 is right).
            agent = lanes[0, :, :self._n_cells] == AGENT_CELL
            info["final_observation"] = self.observation(agent.to(torch.int8).argmax(1))
        # Lane by lane in place (lane 1 is read for lane 0 before it is written), over int64
        # words: where() on int8 is 4x slower per cell on a CPU. (A view of another dtype is
        # made here, not once: compiled code cannot take one that it writes as an input.)
        views, column = self._views, truncated.view(-1, 1)
        now, ahead, empty = lanes.view(torch.int64).unbind()
        torch.where(column, ahead, now, out=now)
        torch.where(column, empty, ahead, out=ahead)
        torch.where(truncated, views["next_agent"], pos, out=pos)
        ended, (rolled, kept) = truncated.unsqueeze(0), views["rolled"]
        torch.index_select(self._keys, 0, self._roll, out=self._rolled)
        torch.where(ended, rolled, kept, out=views["keys"])
        views["ctr_end"].addcmul_(self._end_delta, ended)  # episode + 1; t, t + 2 back to 0, 2
        views["ctr_ep3"].bitwise_and_(MASK)
        self.episode_return.masked_fill_(truncated, 0.0)
        return truncated, info
