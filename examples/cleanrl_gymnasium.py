"""PPO on Forage through Gymnasium, the CleanRL way: ``gymnasium.make_vec`` and a plain loop.

For readers who already train with Gymnasium (CleanRL, SB3): Forage is registered as
``labkit/Forage-v0`` when labkit is imported, its vector env steps all envs in one NumPy call,
and it resets in the same step (Gymnasium's ``AutoresetMode.SAME_STEP``). This file is a
standard host-side loop (observations to the device, actions back, every step): labkit's
chapters show what each of those transfers costs and how the GPU-native pipeline avoids them.

    python examples/cleanrl_gymnasium.py --total-timesteps 200000
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

import labkit.envs  # noqa: F401  (registers labkit/Forage-v0)


@dataclass
class Args:
    seed: int = 1
    """seed of the envs and of torch"""
    total_timesteps: int = 200_000
    """env steps of the whole run"""
    num_envs: int = 64
    """parallel envs"""
    num_steps: int = 32
    """steps per env per rollout"""
    learning_rate: float = 2.5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    cuda: bool = True
    """use CUDA when it is available"""


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_shape: tuple[int, ...], n_actions: int) -> None:
        super().__init__()
        c, v, _ = obs_shape
        self.body = nn.Sequential(
            layer_init(nn.Conv2d(c, 16, 3)), nn.ReLU(), layer_init(nn.Conv2d(16, 32, 3)),
            nn.ReLU(), nn.Flatten(), layer_init(nn.Linear(32 * (v - 4) ** 2, 128)), nn.ReLU())
        self.actor = layer_init(nn.Linear(128, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(128, 1), std=1.0)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.body(x))

    def get_action_and_value(self, x, action=None):
        h = self.body(x)
        dist = torch.distributions.Categorical(logits=self.actor(h))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(h)


def main(args: Args) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    envs = gym.make_vec("labkit/Forage-v0", num_envs=args.num_envs)
    obs_shape = envs.single_observation_space.shape
    agent = Agent(obs_shape, envs.single_action_space.n).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    T, N = args.num_steps, args.num_envs
    batch_size = T * N
    if args.total_timesteps < batch_size or batch_size % args.num_minibatches:
        raise ValueError(f"total_timesteps must be >= num_envs * num_steps = {batch_size}, and "
                         f"num_minibatches must divide it (got {args.num_minibatches})")
    minibatch_size = batch_size // args.num_minibatches
    obs = torch.zeros((T, N, *obs_shape), device=device)
    actions = torch.zeros((T, N), dtype=torch.long, device=device)
    logprobs, rewards, dones, values = (torch.zeros((T, N), device=device) for _ in range(4))

    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(next_obs, device=device)
    next_done = torch.zeros(N, device=device)
    returns_seen: list[float] = []
    n_iterations = args.total_timesteps // batch_size
    start = time.time()
    for iteration in range(n_iterations):
        optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - iteration / n_iterations)
        for t in range(T):
            obs[t], dones[t] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            actions[t], logprobs[t], values[t] = action, logprob, value.flatten()
            next_obs, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
            rewards[t] = torch.as_tensor(reward, device=device)
            next_obs = torch.as_tensor(next_obs, device=device)
            next_done = torch.as_tensor(terminated | truncated, device=device).float()
            returns_seen += info["episode_return"][info["_episode_return"]].tolist()

        with torch.no_grad():  # GAE, CleanRL's convention (dones[t] came with obs[t])
            next_value = agent.get_value(next_obs).flatten()
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nonterminal = 1.0 - (next_done if t == T - 1 else dones[t + 1])
                nextvalues = next_value if t == T - 1 else values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nonterminal - values[t]
                last = delta + args.gamma * args.gae_lambda * nonterminal * last
                advantages[t] = last
            returns = advantages + values

        b_obs, b_actions = obs.reshape(-1, *obs_shape), actions.reshape(-1)
        b_logprobs, b_adv = logprobs.reshape(-1), advantages.reshape(-1)
        b_returns, b_values = returns.reshape(-1), values.reshape(-1)
        for _ in range(args.update_epochs):
            perm = torch.randperm(batch_size, device=device)
            for s in range(0, batch_size, minibatch_size):
                mb = perm[s:s + minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                    b_obs[mb], b_actions[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                adv = b_adv[mb]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(
                    1 - args.clip_coef, 1 + args.clip_coef)).mean()
                newvalue = newvalue.flatten()
                clipped = b_values[mb] + (newvalue - b_values[mb]).clamp(
                    -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2,
                                         (clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
        recent = returns_seen[-4 * N:]
        if recent:
            sps = (iteration + 1) * batch_size / (time.time() - start)
            print(f"iteration {iteration + 1}/{n_iterations}: mean return "
                  f"{np.mean(recent):.2f}, {sps:,.0f} steps/s")
    envs.close()
    return {"episode_returns": returns_seen, "loss": loss.item(), "iterations": n_iterations}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if f.type in (bool, "bool") \
            else type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    main(Args(**vars(parser.parse_args())))
