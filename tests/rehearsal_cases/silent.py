"""The silent failures users report: random numbers frozen into a graph (a policy's action
spread collapsing over replays), outputs kept and read after the next replay overwrote them,
a shape that follows a Python value (one graph per shape), and a capture that never happened
(the work done eagerly only)."""
from __future__ import annotations

import random
from collections import deque

import numpy as np
import torch

from . import helpers, nets
from . import sources as src
from .registry import DEVICE, case

# ---------------------------------------------------------------- frozen random numbers


@case("frozen_rng-unregistered_generator", "silent", "refused", src.UNREGISTERED,
      family="frozen_rng", variant="quoted")
def _unregistered():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    policy = helpers.mlp(4, 16, 2).to(DEVICE)

    def step(obs):
        mu = policy(obs)
        noise = torch.randn(mu.shape, generator=gen, device=mu.device)  # HAZARD
        return mu + 0.2 * noise

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("frozen_rng-python_gauss", "silent", "replays_differ", src.FROZEN,
      family="frozen_rng", variant="spelling")
def _python_gauss():
    rng = random.Random(0)
    policy = helpers.mlp(4, 16, 2).to(DEVICE)

    def step(obs):
        mu = policy(obs)
        return (mu + 0.3 * rng.gauss(0.0, 1.0)).clamp(-1, 1)  # HAZARD

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("frozen_rng-numpy_normal", "silent", "replays_differ", src.FROZEN,
      family="frozen_rng", variant="spelling")
def _numpy_normal():
    rng = np.random.default_rng(0)

    def step(action):
        sigma = float(rng.normal(0.0, 0.1))
        return action + sigma  # HAZARD

    return step, (torch.zeros(8, 2, device=DEVICE),)


@case("frozen_rng-ou_noise", "silent", "replays_differ", src.FROZEN,
      family="frozen_rng", variant="method", hazard=nets.OUNoise.sample)
def _ou():
    noise = nets.OUNoise(2, DEVICE, seed=0)

    def step(action):
        return (action + noise.sample()).clamp(-1, 1)

    return step, (torch.zeros(2, device=DEVICE),)


@case("frozen_rng-helper_exploration", "silent", "replays_differ", src.FROZEN,
      family="frozen_rng", variant="helper", hazard=helpers.gaussian_exploration)
def _exploration_helper():
    rng = random.Random(1)
    actor = helpers.mlp(3, 16, 1).to(DEVICE)

    def step(obs):
        return helpers.gaussian_exploration(actor(obs).tanh(), 0.1, rng)

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("rng-default_generator_sampling", "silent", "capturable", src.RNG_OK)
def _default_rng():
    policy = helpers.mlp(4, 16, 2).to(DEVICE)

    def step(obs):
        mu = policy(obs)
        return mu + 0.2 * torch.randn_like(mu)

    return step, (torch.randn(8, 4, device=DEVICE),)


# ---------------------------------------------------------------- outputs read after replays


@case("overwritten-frame_history", "silent", "replays_differ", src.REBOUND,
      family="output_overwritten", variant="quoted")
def _frame_history():
    frames: deque = deque(maxlen=3)
    h = torch.zeros(4, device=DEVICE)

    def step(obs):
        h.mul_(0.5).add_(obs)
        frames.append(h.clone())
        return torch.stack(list(frames)).mean(0)  # HAZARD

    return step, (torch.randn(4, device=DEVICE),)


@case("overwritten-previous_output", "silent", "replays_differ", src.REBOUND,
      family="output_overwritten", variant="spelling")
def _previous_output():
    value = torch.nn.Linear(3, 1).to(DEVICE)
    last: list = []
    w = torch.zeros(3, device=DEVICE)

    def step(obs):
        w.add_(0.1)
        v = value(obs + w).squeeze(-1)
        delta = v - (last[-1] if last else torch.zeros_like(v))  # HAZARD
        last.append(v.detach())
        return delta

    return step, (torch.randn(8, 3, device=DEVICE),)


@case("overwritten-feature_history", "silent", "replays_differ", src.REBOUND,
      family="output_overwritten", variant="method", hazard=nets.FeatureHistory.forward)
def _feature_history():
    return nets.FeatureHistory(4, 2).to(DEVICE), (torch.randn(2, 4, device=DEVICE),)


@case("overwritten-helper_smooth", "silent", "replays_differ", src.REBOUND,
      family="output_overwritten", variant="helper", hazard=helpers.smooth_over_history)
def _smooth_helper():
    history: list = []
    acc = torch.zeros(3, device=DEVICE)

    def step(x):
        acc.add_(x)
        return helpers.smooth_over_history(history, acc)

    return step, (torch.randn(3, device=DEVICE),)


# ---------------------------------------------------------------- a shape from Python


@case("python_shape-top_returns", "silent", "replays_differ", src.SHAPE,
      family="python_shape", variant="quoted", says=("best_returns",))
def _top_returns():
    calls: list = []

    def step(returns):
        calls.append(None)
        return {"best_returns": returns.topk(len(calls)).values}  # HAZARD

    return step, (torch.randn(16, device=DEVICE),)


@case("python_shape-episode_tracker", "silent", "replays_differ", src.SHAPE,
      family="python_shape", variant="method", hazard=nets.EpisodeTracker.forward,
      says=("finished",))
def _episode_tracker():
    return nets.EpisodeTracker(), (torch.randn(16, device=DEVICE),)


@case("python_shape-helper_window", "silent", "replays_differ", src.SHAPE,
      family="python_shape", variant="helper", hazard=helpers.recent_window,
      says=("window",))
def _window_helper():
    seen: list = []

    def step(values):
        return helpers.recent_window(values * 2, seen)

    return step, (torch.randn(16, device=DEVICE),)


@case("python_shape-padded_batch", "silent", "replays_differ", src.SHAPE,
      family="python_shape", variant="spelling", says=("padded",))
def _padded():
    lengths = [3, 5, 4, 6, 7, 2]

    def step(tokens):
        n = lengths.pop(0)
        return {"padded": tokens[:, :n] * 1.0}  # HAZARD

    return step, (torch.randn(4, 8, device=DEVICE),)


# ---------------------------------------------------------------- capture that never happened


@case("eager_fallback-capturing_guard", "silent", "replays_differ", src.CAPTURE_FLAG,
      family="eager_fallback", variant="quoted")
def _guard():
    stats = torch.zeros(4, device=DEVICE)

    def step(x):
        if not torch.cuda.is_current_stream_capturing():  # HAZARD
            stats.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - stats

    return step, (torch.randn(8, 4, device=DEVICE),)


@case("eager_fallback-try_host_read", "silent", "refused", src.INVALIDATED,
      family="eager_fallback", variant="spelling")
def _try_read():
    def step(values, valid):
        try:
            n = int(valid.sum())  # HAZARD
        except RuntimeError:
            n = valid.numel()
        return values.sum() / max(n, 1)

    return step, (torch.randn(8, device=DEVICE), torch.rand(8, device=DEVICE) < 0.5)


@case("eager_fallback-safe_normalizer", "silent", "replays_differ", src.CAPTURE_FLAG,
      family="eager_fallback", variant="method", hazard=nets.SafeNormalizer.forward)
def _guard_method():
    return nets.SafeNormalizer(4).to(DEVICE), (torch.randn(8, 4, device=DEVICE) + 1.0,)


@case("eager_fallback-helper_guard", "silent", "replays_differ", src.CAPTURE_FLAG,
      family="eager_fallback", variant="helper", hazard=helpers.update_unless_capturing)
def _guard_helper():
    stats = torch.zeros(4, device=DEVICE)

    def step(x):
        return helpers.update_unless_capturing(stats, x)

    return step, (torch.randn(8, 4, device=DEVICE) + 2.0,)
