"""Episode statistics: the eager host-side way and the device-side way (stage 6).

Both are built as ``cls(device=...)``, take, every env step, what the envs put in ``info``:
``done`` bool (N,), ``episode_return`` float32 (N,) (0 where not done) and ``episode_length``
int64 (N,), and both return the same ``summary()`` dict, then start a new window:
``episodes``, ``mean_return``, ``std_return``, ``min_return``, ``max_return``, ``mean_length``
(NaN for the statistics when no episode finished). Their ``state_dict()`` is part of the
pipeline's state (empty at an iteration boundary, where ``summary()`` has just reset it).
"""
from __future__ import annotations

import math

import torch

from .validate import check_state_keys, check_state_tensor


def _summarize(count: float, sum_return: float, sum_sq_return: float, sum_length: float,
               min_return: float, max_return: float) -> dict[str, float]:
    if count == 0:
        nan = math.nan
        return {"episodes": 0, "mean_return": nan, "std_return": nan, "min_return": nan,
                "max_return": nan, "mean_length": nan}
    mean = sum_return / count
    var = max(sum_sq_return / count - mean * mean, 0.0)
    return {"episodes": int(count), "mean_return": mean, "std_return": math.sqrt(var),
            "min_return": min_return, "max_return": max_return,
            "mean_length": sum_length / count}


class EagerEpisodeStats:
    """Reference: copy finished episodes to Python lists every step (host syncs every step).
    ``device`` is unused (the lists live on the host)."""

    reads_host = True  # every step: it cannot run inside a compiled or captured step

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.returns: list[float] = []
        self.lengths: list[int] = []

    def update(self, done: torch.Tensor, episode_return: torch.Tensor,
               episode_length: torch.Tensor) -> None:
        if not done.any():  # host sync
            return
        self.returns.extend(episode_return[done].tolist())  # host sync
        self.lengths.extend(episode_length[done].tolist())  # host sync

    def summary(self) -> dict[str, float]:
        r = self.returns
        stats = _summarize(len(r), sum(r), sum(x * x for x in r), sum(self.lengths),
                           min(r, default=math.nan), max(r, default=math.nan))
        self.clear()
        return stats

    def clear(self) -> None:
        self.returns, self.lengths = [], []

    def state_dict(self) -> dict:
        return {"returns": list(self.returns), "lengths": list(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        check_state_keys("metrics state", state, ("returns", "lengths"))
        returns, lengths = state["returns"], state["lengths"]
        if not isinstance(returns, (list, tuple)) or not isinstance(lengths, (list, tuple)) \
                or len(returns) != len(lengths):
            raise ValueError("metrics state['returns'] and ['lengths'] must be lists of one "
                             "length")
        if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
                   for r in returns):
            raise ValueError("metrics state['returns'] must be finite numbers")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths):
            raise ValueError("metrics state['lengths'] must be episode lengths (ints >= 1)")
        if any(abs(r) > n for r, n in zip(returns, lengths)):  # rewards are -1, 0 or +1
            raise ValueError("metrics state['returns'] must be reachable: each |return| at most "
                             "its episode's length (rewards are -1, 0 or +1)")
        self.returns, self.lengths = list(returns), list(lengths)

    def all_reduce_(self) -> None:
        """Every rank's episodes, in rank order (torch.distributed; lists, so objects)."""
        import torch.distributed as dist

        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.returns, self.lengths))
        self.returns = [r for returns, _ in gathered for r in returns]
        self.lengths = [n for _, lengths in gathered for n in lengths]


def _check_reachable(count: float, sum_return: float, sum_sq: float, sum_length: float,
                     low: float, high: float) -> None:
    """Accumulators some episodes can have made: a whole count, lengths >= 1 each, each
    |return| at most its episode's length (rewards are -1, 0 or +1), squares and extremes
    consistent with the sums (a little slack for float rounding); none at all: zeros and the
    empty extremes (+inf, -inf)."""
    slack = 1e-6 * max(1.0, abs(sum_length))
    if count < 0 or count != int(count):
        bad = "sums[0], the episode count, must be a whole number >= 0"
    elif count == 0:
        bad = None if (sum_return, sum_sq, sum_length, low, high) == (
            0, 0, 0, math.inf, -math.inf) else "with no episode, the sums must be 0 and " \
                                                "min/max +inf/-inf"
    elif sum_length < count:
        bad = "sums[3], the summed lengths, must be at least one step per episode"
    elif abs(sum_return) > sum_length + slack or max(abs(low), abs(high)) > sum_length + slack:
        bad = ("returns must be reachable: each |return| at most its episode's length "
               "(rewards are -1, 0 or +1)")
    elif sum_sq < sum_return ** 2 / count - slack * max(1.0, abs(sum_sq)) \
            or sum_sq > sum_length ** 2 + slack:
        bad = "sums[2], the summed squared returns, do not fit the summed returns and lengths"
    elif not low - slack <= sum_return / count <= high + slack:
        bad = "min and max must bound the mean return"
    else:
        bad = None
    if bad:
        raise ValueError(f"metrics state: {bad}")


class DeviceEpisodeStats:
    """Aggregate on the device with masked reductions: no host read in ``update``, one in
    ``summary``. Fixed memory: six accumulators, whatever the number of episodes.

    Accumulators are float64 so sums of many float32 returns do not lose precision (and
    counts stay exact); the cost is a handful of scalar ops per step.
    """

    reads_host = False  # in update: a compiled rollout step may hold it

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        f64 = torch.float64
        # count, sum of returns, sum of squared returns, sum of lengths
        self._sums = torch.zeros(4, dtype=f64, device=self.device)
        self._min = torch.full((), math.inf, dtype=f64, device=self.device)
        self._max = torch.full((), -math.inf, dtype=f64, device=self.device)

    def update(self, done: torch.Tensor, episode_return: torch.Tensor,
               episode_length: torch.Tensor) -> None:
        if done.dtype != torch.bool:
            raise TypeError(f"done must be a bool tensor, got {done.dtype}")
        ret = torch.where(done, episode_return.to(torch.float64), 0.0)
        length = torch.where(done, episode_length.to(torch.float64), 0.0)
        count = done.sum(dtype=torch.float64)
        self._sums.add_(torch.stack((count, ret.sum(), ret.square().sum(), length.sum())))
        # In place, so the accumulators keep their storage (CUDA-graph friendly).
        torch.minimum(self._min, torch.where(done, ret, math.inf).amin(), out=self._min)
        torch.maximum(self._max, torch.where(done, ret, -math.inf).amax(), out=self._max)

    def summary(self) -> dict[str, float]:
        stacked = torch.cat((self._sums, self._min.view(1), self._max.view(1)))
        values = stacked.tolist()  # the single deliberate host sync per update
        self.clear()
        return _summarize(*values)

    def clear(self) -> None:
        self._sums.zero_()
        self._min.fill_(math.inf)
        self._max.fill_(-math.inf)

    def state_dict(self) -> dict:
        return {"sums": self._sums.clone(), "min": self._min.clone(), "max": self._max.clone()}

    def load_state_dict(self, state: dict) -> None:
        check_state_keys("metrics state", state, ("sums", "min", "max"))
        check_state_tensor("metrics state['sums']", state["sums"], self._sums)
        for key, like in (("min", self._min), ("max", self._max)):  # inf: no episode yet
            check_state_tensor(f"metrics state[{key!r}]", state[key], like, finite=False)
            if bool(state[key].detach().cpu().isnan().any()):
                raise ValueError(f"metrics state[{key!r}] must not hold NaN")
        _check_reachable(*state["sums"].tolist(), float(state["min"]), float(state["max"]))
        # In place: a captured rollout step holds these accumulators.
        self._sums.copy_(state["sums"])
        self._min.copy_(state["min"])
        self._max.copy_(state["max"])

    def all_reduce_(self) -> None:
        """Sum the accumulators over the ranks, on the device (torch.distributed)."""
        import torch.distributed as dist

        dist.all_reduce(self._sums)
        dist.all_reduce(self._min, op=dist.ReduceOp.MIN)
        dist.all_reduce(self._max, op=dist.ReduceOp.MAX)
