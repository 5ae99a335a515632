"""Scripted policies for Forage: uniform random and a greedy "oracle" that says what a good
return is. Both run on the device with no host reads."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..device import resolve_device
from .spec import ACTION_DELTAS, N_ACTIONS, ForageSpec

POLICIES = ("oracle", "random")


def random_actions(n: int, generator: torch.Generator | int | None = None,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """``n`` uniform actions (int64) on ``device``; ``generator`` may be a seed."""
    device = resolve_device(device)
    if isinstance(generator, int):
        generator = torch.Generator(device).manual_seed(generator)
    return torch.randint(0, N_ACTIONS, (n,), generator=generator, device=device)


def _path_distance(food: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """Steps from each window cell to the nearest food, walls and poison in the way.

    Repeated relaxation over the window (a BFS in dense form); ``big`` where no food is
    reachable. It is the Manhattan distance when nothing is in the way."""
    view = food.shape[-1]
    big = view * view
    dist = torch.where(food, 0, big)
    for _ in range(big // 2):
        p = F.pad(dist, (1, 1, 1, 1), value=big)
        near = torch.minimum(torch.minimum(p[:, :-2, 1:-1], p[:, 2:, 1:-1]),
                             torch.minimum(p[:, 1:-1, :-2], p[:, 1:-1, 2:]))
        dist = torch.where(blocked, big, torch.minimum(dist, near + 1))
    return dist


@functools.lru_cache
def _move_cells(view: int, device: torch.device) -> torch.Tensor:
    """Flat window index of the cell each move (up, down, left, right) leads to."""
    r = view // 2
    return torch.tensor([(r + dr) * view + r + dc for dr, dc in ACTION_DELTAS[1:]],
                        device=device)


def oracle_actions(obs: torch.Tensor, step: torch.Tensor | int = 0) -> torch.Tensor:
    """Greedy policy on observations (N, 3, V, V) -> int64 actions (N,), no host reads.

    Moves to the neighbour closest to the nearest visible food by path length (walls and
    poison count as obstacles; ties go to the first of up, down, left, right), never onto a
    wall or poison. With no food reachable in view it explores in a direction that changes
    every few steps, so pass the env step counter ``step`` (an int or (N,) tensor): a fixed
    direction could pin it against a wall for good. Under CUDA graph capture pass ``step`` as
    a device tensor (an int is copied to the device on each call)."""
    wall, food, poison = obs[:, 0] > 0, obs[:, 1] > 0, obs[:, 2] > 0
    n, view = obs.shape[0], obs.shape[-1]
    blocked = wall | poison
    dist = _path_distance(food, blocked).flatten(1)
    moves = _move_cells(view, obs.device)
    safe = ~blocked.flatten(1)[:, moves]
    big = view * view
    score = torch.where(safe, dist[:, moves], big + 1)
    best = score.argmin(1) + 1  # argmin keeps the first of equal scores
    found = score.min(1).values < big

    step = torch.as_tensor(step, device=obs.device)
    # Knuth's multiplicative hash of step // 4: a new pseudo-random heading every 4 steps.
    heading = ((step // 4) * 2654435761 >> 16) % 4
    order = (heading.view(-1, 1) + torch.arange(4, device=obs.device)) % 4
    order = order.expand(n, -1)
    first_safe = safe.gather(1, order).to(torch.int8).argmax(1, keepdim=True)
    explore = torch.where(safe.any(1), order.gather(1, first_safe).squeeze(1) + 1, 0)
    return torch.where(found, best, explore)


def mean_return(policy_name: str, spec: ForageSpec | None = None, n_envs: int = 256,
                episodes: int = 4, seed: int = 0, device: str | torch.device = "cpu") -> float:
    """Mean episode return of ``"oracle"`` or ``"random"`` on ForageTorch over
    ``n_envs * episodes`` episodes."""
    from .torch import ForageTorch

    if policy_name not in POLICIES:
        raise ValueError(f"policy_name must be one of {POLICIES}, got {policy_name!r}")
    env = ForageTorch(n_envs, spec, seed=seed, device=device)
    gen = torch.Generator(env.device).manual_seed(seed)
    obs, _ = env.reset()
    total = torch.zeros((), device=env.device)
    for t in range(episodes * env.spec.episode_length):
        if policy_name == "oracle":
            actions = oracle_actions(obs, t)
        else:
            actions = random_actions(n_envs, gen, env.device)
        obs, _, _, _, info = env.step(actions)
        total += info["episode_return"].sum()
    return total.item() / (n_envs * episodes)  # the one host read, at the end
