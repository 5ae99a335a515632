"""PPO on Forage through Gymnasium, the CleanRL way: ``gymnasium.make_vec`` and a plain loop.

For readers who already train with Gymnasium (CleanRL, SB3): Forage is registered as
``labkit/Forage-v0`` when ``labkit.envs.gym`` is imported, its vector env steps all envs in one
NumPy call, and it resets in the same step (Gymnasium's ``AutoresetMode.SAME_STEP``). This file is a
standard host-side loop (observations to the device, actions back, every step): labkit's
chapters show what each of those transfers costs and how the GPU-native pipeline avoids them.
Three of their fixes are switches here, off by default (chapter 12 watches the loop with
``python -m labkit watch`` before and after): ``--sampling gumbel`` (chapter 02),
``--env-backend torch`` (chapter 03, with the episode statistics summed on the device as in
chapter 07) and ``--fused-adam true`` (chapter 08).

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

import labkit.envs.gym  # noqa: F401  (registers labkit/Forage-v0)


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
    sampling: str = "categorical"
    """categorical (torch.distributions: its argument validation reads the device each call) or
    gumbel (argmax(log p - log E), E ~ Exp(1): exact, with no read; chapter 02)"""
    env_backend: str = "numpy"
    """numpy (observations to the device and actions back at every step) or torch (the envs'
    state on the device: no copy either way; chapter 03)"""
    fused_adam: bool = False
    """Adam(fused=True): one kernel for every parameter (chapter 08)"""


def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_shape: tuple[int, ...], n_actions: int, gumbel: bool = False) -> None:
        super().__init__()
        self.gumbel = gumbel
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
        if not self.gumbel:
            dist = torch.distributions.Categorical(logits=self.actor(h))
            if action is None:
                action = dist.sample()
            return action, dist.log_prob(action), dist.entropy(), self.critic(h)
        logp = self.actor(h).log_softmax(-1)
        if action is None:  # Gumbel-max: the argmax of log p perturbed by -log E, E ~ Exp(1)
            action = (logp - torch.empty_like(logp).exponential_().log()).argmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return action, logp.gather(-1, action[:, None]).squeeze(-1), entropy, self.critic(h)


def main(args: Args) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.sampling not in ("categorical", "gumbel") or args.env_backend not in ("numpy",
                                                                                 "torch"):
        raise ValueError("sampling must be categorical or gumbel, env_backend numpy or torch")
    on_device = args.env_backend == "torch"
    envs = gym.make_vec("labkit/Forage-v0", num_envs=args.num_envs, backend=args.env_backend,
                        **({"device": device} if on_device else {}))
    obs_shape = envs.single_observation_space.shape
    agent = Agent(obs_shape, envs.single_action_space.n, args.sampling == "gumbel").to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5,
                                 fused=args.fused_adam or None)

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
    finished = torch.zeros(2, device=device)  # on the device: sum and count of returns
    n_iterations = args.total_timesteps // batch_size
    start = time.time()
    for iteration in range(n_iterations):
        optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - iteration / n_iterations)
        for t in range(T):
            obs[t], dones[t] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            actions[t], logprobs[t], values[t] = action, logprob, value.flatten()
            next_obs, reward, terminated, truncated, info = envs.step(
                action if on_device else action.cpu().numpy())
            rewards[t] = torch.as_tensor(reward, device=device)
            next_obs = torch.as_tensor(next_obs, device=device)
            next_done = torch.as_tensor(terminated | truncated, device=device).float()
            if on_device:  # summed where they are: no read (chapter 07)
                ended = info["_episode_return"]
                finished += torch.stack([(info["episode_return"] * ended).sum(), ended.sum()])
            else:
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
        if on_device:  # one read per iteration, for the line below
            total, count = finished.tolist()
            returns_seen += [total / count] * int(count) if count else []
            finished.zero_()
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
