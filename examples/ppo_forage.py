"""PPO on Forage in one file: the last rung of the labkit ladder, ready to copy.

Everything the cookbook builds up stage by stage, in one readable loop with no labkit import:

* the env lives on the device and steps all N envs with tensor ops (no host reads);
* actions are sampled on the device (Gumbel-max, a seeded ``torch.Generator``);
* rollout storage is preallocated and written at a device-side step counter;
* GAE, then PPO with fused Adam (the LR a device tensor), a sync-free grad clip and bf16
  autocast where the device has bf16; the policy and the loss are ``torch.compile``d;
* on a bf16 CUDA GPU, the rollout step and the minibatch update are replayed as CUDA graphs;
* episode statistics are summed on the device and read once per iteration (the loop's only
  host read).

It computes exactly what labkit's final stage computes (``tests/test_recipe.py``: same seed ->
bit-identical rollout, same parameters after an update). Run it:

    python examples/ppo_forage.py --total-steps 500000            # CPU
    python examples/ppo_forage.py --n-envs 1024 --n-steps 128     # GPU
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn


@dataclass
class Args:
    seed: int = 1
    """Seed of the envs, the model init and the sampling generator."""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda."""
    total_steps: int = 500_000
    """Env steps of the whole run (rounded down to whole iterations)."""
    n_envs: int = 64
    """Envs stepped in parallel (N)."""
    n_steps: int = 32
    """Rollout length per iteration (T)."""
    compile: bool = True
    """torch.compile the policy network and the PPO loss."""
    cuda_graphs: bool = True
    """Replay the rollout step and the minibatch update as CUDA graphs (bf16 CUDA GPUs only)."""
    # the env (Forage)
    height: int = 11
    """Grid rows, the wall border included."""
    width: int = 11
    """Grid columns, the wall border included."""
    n_walls: int = 4
    """Interior walls placed at each reset."""
    n_food: int = 4
    """Food items (+1 when eaten; each respawns on a free cell)."""
    n_poison: int = 3
    """Poison items (-1 when eaten; each respawns on a free cell)."""
    view: int = 7
    """Side of the egocentric observation window (odd)."""
    episode_length: int = 128
    """Steps before an episode is truncated (and reset in the same step)."""
    # PPO (CleanRL's defaults)
    lr: float = 2.5e-4
    """Adam learning rate at the start."""
    anneal_lr: bool = True
    """Anneal the LR linearly to 0 over the run."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE's lambda."""
    update_epochs: int = 4
    """Passes over each rollout."""
    n_minibatches: int = 4
    """Minibatches per pass (must divide n_envs * n_steps)."""
    clip_coef: float = 0.2
    """PPO's ratio clip (also clips the value loss)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus."""
    max_grad_norm: float = 0.5
    """Global gradient norm clip."""
    adam_eps: float = 1e-5
    """Adam's epsilon."""

    def __post_init__(self) -> None:
        if min(self.n_envs, self.n_steps, self.n_minibatches, self.total_steps) < 1:
            raise ValueError("n_envs, n_steps, n_minibatches and total_steps must be >= 1")
        if self.batch_size % self.n_minibatches:
            raise ValueError(f"n_minibatches must divide n_envs * n_steps = {self.batch_size}, "
                             f"got {self.n_minibatches}")

    @property
    def batch_size(self) -> int:
        return self.n_envs * self.n_steps

    @property
    def n_iterations(self) -> int:
        return max(self.total_steps // self.batch_size, 1)


# ---------------------------------------------------------------------------- the env
# REPLACE THIS SECTION WITH YOUR ENV. The rest of the file needs only this of it:
#   Forage(args, device)        args.n_envs envs on `device`, already reset
#   .n_actions, .obs_shape      the number of discrete actions, an observation's (C, H, W)
#   .observation()              the (N, C, H, W) observations
#   .step(actions)              (N,) int64 actions -> (obs, reward, done, episode_return,
#                               episode_length), (N, ...) device tensors; an env whose episode
#                               ends resets in the same step; the last two are 0 where not done
#   .state()                    every tensor step changes, each updated in place
# For CUDA graphs, step must keep its shapes and never read the host (no .item(), no Python
# branch on a tensor's value), and draw any randomness from tensors it owns.

EMPTY, WALL, FOOD, POISON = 0, 1, 2, 3
ACTION_DELTAS = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))  # stay, up, down, left, right
AGENT = -1  # the reset draw that places the agent


def hash32(seed, env, episode, step, draw):
    """Counter-based RNG: a pure function of its keys (lowbias32 mixing on int64 tensors)."""
    h = 0x9E3779B9
    for key in (seed, env, episode, step, draw):
        x = h ^ (key & 0xFFFFFFFF)
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        h = x ^ (x >> 16)
    return h


def kth_free(free: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Column of the k-th (0-based) True in each row of ``free``."""
    count = free.cumsum(1, dtype=torch.int32)
    return (count <= k.unsqueeze(1).to(torch.int32)).sum(1)


class Forage:
    """N gridworlds on one device: walk (stay/up/down/left/right), eat food (+1), avoid poison
    (-1); items respawn on a random free cell; episodes are truncated after
    ``episode_length`` steps and reset in the same step. Grids are flat and padded with walls
    by ``view // 2``, so a move is an addition and the egocentric view is one gather. The
    next episode's layout is built ahead, a draw or two per step, so a reset is a swap. The
    state is updated in place (a CUDA graph replays these very tensors)."""

    def __init__(self, args: Args, device: torch.device) -> None:
        pad, v, n = args.view // 2, args.view, args.n_envs
        rows, cols = args.height + 2 * pad, args.width + 2 * pad
        base = torch.full((rows, cols), WALL, dtype=torch.int8)
        base[pad + 1:pad + args.height - 1, pad + 1:pad + args.width - 1] = EMPTY
        r, c = torch.meshgrid(torch.arange(1, args.height - 1), torch.arange(1, args.width - 1),
                              indexing="ij")
        i, j = torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij")
        kinds = torch.tensor([WALL] * args.n_walls + [AGENT] + [FOOD] * args.n_food
                             + [POISON] * args.n_poison, dtype=torch.int8)
        self.args, self.device, self.n_envs = args, device, n
        self.n_actions, self.obs_shape = len(ACTION_DELTAS), (3, v, v)  # wall/food/poison
        self.base = base.flatten().to(device)
        self.cells = ((r + pad) * cols + c + pad).flatten().to(device)
        self.window = ((i - pad) * cols + j - pad).flatten().to(device)
        self.deltas = torch.tensor([dr * cols + dc for dr, dc in ACTION_DELTAS], device=device)
        self.channel_kinds = torch.tensor([WALL, FOOD, POISON], dtype=torch.int8, device=device)
        self.item_draws = torch.nonzero(kinds != AGENT).squeeze(1).to(device)
        self.item_kinds = kinds[kinds != AGENT].to(device)
        self.agent_draw = args.n_walls
        self.draws = torch.arange(len(kinds), device=device)
        self.draw_kinds = kinds.to(device)
        self.per_step = -(-len(kinds) // args.episode_length)  # draws built ahead per step
        self.env = torch.arange(n, device=device)
        self.seed = torch.tensor(args.seed, dtype=torch.int64, device=device)
        self.episode = torch.zeros(n, dtype=torch.int64, device=device)
        self.t = torch.zeros(n, dtype=torch.int64, device=device)
        self.grid = torch.empty(n, rows * cols, dtype=torch.int8, device=device)
        self.pos = torch.zeros(n, dtype=torch.int64, device=device)
        self.episode_return = torch.zeros(n, dtype=torch.float32, device=device)
        self.next_grid, self.next_pos = torch.empty_like(self.grid), torch.zeros_like(self.pos)
        self.next_free = torch.empty(n, self.cells.numel(), dtype=torch.bool, device=device)
        self.reset()

    def state(self) -> list[torch.Tensor]:
        """The tensors a snapshot must save (everything ``step`` changes)."""
        return [self.episode, self.t, self.grid, self.pos, self.episode_return,
                self.next_grid, self.next_pos, self.next_free]

    def free_cell(self, grid, pos, episode, step) -> torch.Tensor:
        """The k-th free cell of each env, k from the hash: a placement without a branch."""
        free = (grid[:, self.cells] == EMPTY) & (self.cells != pos.unsqueeze(1))
        k = hash32(self.seed, self.env, episode, step, 0) % free.sum(1).clamp(min=1)
        return self.cells[kth_free(free, k).clamp(max=self.cells.numel() - 1)]

    def new_episodes(self, episode) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh grids and agent cells for every env at ``episode`` (walls, agent, items)."""
        n, n_cells = self.n_envs, self.cells.numel()
        h = hash32(self.seed, self.env.unsqueeze(1), episode.unsqueeze(1), 0, self.draws)
        free = torch.ones(n, n_cells, dtype=torch.bool, device=self.device)
        taken = torch.empty(n, len(self.draws), dtype=torch.int64, device=self.device)
        for d in range(len(self.draws)):
            taken[:, d] = kth_free(free, h[:, d] % (n_cells - d))
            free.scatter_(1, taken[:, d:d + 1], False)
        grid = self.base.repeat(n, 1)
        grid.scatter_(1, self.cells[taken[:, self.item_draws]], self.item_kinds.expand(n, -1))
        return grid, self.cells[taken[:, self.agent_draw]]

    def build_ahead(self) -> None:
        """This step's draws of the next episode's layout: the draws ``new_episodes`` makes,
        spread over the episode (draw ``t * per_step + j``); past the last draw, nothing."""
        n_cells, n_draws = self.cells.numel(), len(self.draw_kinds)
        for j in range(self.per_step):
            d = self.t * self.per_step + j
            todo, d = d < n_draws, d.clamp(max=n_draws - 1)
            h = hash32(self.seed, self.env, self.episode + 1, 0, d)
            col = kth_free(self.next_free, h % (n_cells - d)).clamp(max=n_cells - 1)
            col, cell, kind = col.unsqueeze(1), self.cells[col], self.draw_kinds[d]
            self.next_free.scatter_(1, col, self.next_free.gather(1, col) & ~todo.unsqueeze(1))
            item = (todo & (kind != AGENT)).unsqueeze(1)
            self.next_grid.scatter_(1, cell.unsqueeze(1), torch.where(
                item, kind.unsqueeze(1), self.next_grid.gather(1, cell.unsqueeze(1))))
            self.next_pos.copy_(torch.where(todo & (kind == AGENT), cell, self.next_pos))

    def observation(self) -> torch.Tensor:
        cells = self.grid.gather(1, self.pos.unsqueeze(1) + self.window)
        obs = cells.unsqueeze(1) == self.channel_kinds.view(1, -1, 1)
        return obs.to(torch.float32).view(self.n_envs, 3, self.args.view, self.args.view)

    def reset(self) -> torch.Tensor:
        self.episode.zero_()
        grid, pos = self.new_episodes(self.episode)
        self.grid.copy_(grid)
        self.pos.copy_(pos)
        self.t.zero_()
        self.episode_return.zero_()
        self.next_grid.copy_(self.base.expand_as(self.next_grid))
        self.next_free.fill_(True)
        return self.observation()

    def step(self, actions: torch.Tensor):
        """-> (obs, reward, done, episode_return, episode_length); the last two are 0 where
        no episode ended."""
        grid, pos = self.grid, self.pos
        self.build_ahead()
        target = pos + self.deltas[actions]
        cell = grid.gather(1, target.unsqueeze(1)).squeeze(1)
        moved = cell != WALL
        pos.copy_(torch.where(moved, target, pos))
        cell = torch.where(moved, cell, EMPTY)
        eaten = (cell == FOOD) | (cell == POISON)
        reward = (cell == FOOD).to(torch.float32) - (cell == POISON).to(torch.float32)
        grid.scatter_(1, pos.unsqueeze(1), EMPTY)
        self.t += 1
        spawn = self.free_cell(grid, pos, self.episode, self.t).unsqueeze(1)
        grid.scatter_(1, spawn, torch.where(eaten.unsqueeze(1), cell.unsqueeze(1),
                                            grid.gather(1, spawn)))
        self.episode_return += reward
        done = self.t == self.args.episode_length
        episode_return = torch.where(done, self.episode_return, 0.0)
        episode_length = torch.where(done, self.t, 0)
        self.episode += done  # same-step reset: swap the built-ahead layout in where done
        grid.copy_(torch.where(done.unsqueeze(1), self.next_grid, grid))
        pos.copy_(torch.where(done, self.next_pos, pos))
        self.next_grid.copy_(torch.where(done.unsqueeze(1), self.base, self.next_grid))
        self.next_free.masked_fill_(done.unsqueeze(1), True)
        self.t.masked_fill_(done, 0)
        self.episode_return.masked_fill_(done, 0.0)
        return self.observation(), reward, done, episode_return, episode_length


# ---------------------------------------------------------------------------- the agent


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_shape: tuple[int, int, int], n_actions: int) -> None:
        super().__init__()
        channels, height, width = obs_shape
        self.body = nn.Sequential(
            layer_init(nn.Conv2d(channels, 16, 3)), nn.ReLU(),
            layer_init(nn.Conv2d(16, 32, 3)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(32 * (height - 4) * (width - 4), 128)), nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(128, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(128, 1), std=1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs.float())
        return self.actor(h), self.critic(h).squeeze(-1)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.body(obs.float())).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor):
        logits, value = self(obs)
        logp = logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.long()[:, None]).squeeze(-1), entropy, value


@torch.no_grad()
def act(policy: nn.Module, obs: torch.Tensor, generator: torch.Generator):
    """Sample on the device: Gumbel-max, argmax(logp - log E) with E ~ Exp(1)."""
    logits, value = policy(obs)
    logp = logits.float().log_softmax(-1)
    noise = torch.empty_like(logp).exponential_(generator=generator)
    action = (logp - noise.log()).argmax(-1)
    return action, logp.gather(-1, action[:, None]).squeeze(-1), value


# ---------------------------------------------------------------------------- PPO


def gae(rewards, values, dones, next_value, next_done, gamma: float, lam: float):
    """(advantages, returns), both (T, N); ``dones[t]``: obs t starts a new episode."""
    dones = dones.to(rewards.dtype)
    next_values = torch.cat([values[1:], next_value[None]])
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done.to(rewards.dtype)[None]])
    deltas = rewards + gamma * next_values * next_nonterminal - values
    decay = gamma * lam * next_nonterminal
    last = torch.zeros_like(next_value, dtype=rewards.dtype)
    advantages = []
    for t in range(rewards.shape[0] - 1, -1, -1):
        last = deltas[t] + decay[t] * last
        advantages.append(last)
    advantages = torch.stack(advantages[::-1])
    return advantages, advantages + values


def ppo_loss(agent: Agent, obs, actions, old_logprobs, advantages, returns, old_values,
             args: Args):
    logprob, entropy, value = agent.evaluate(obs, actions)
    logratio = logprob - old_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio,
                        -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    clipped = old_values + (value - old_values).clamp(-args.clip_coef, args.clip_coef)
    v_loss = 0.5 * torch.max((value - returns) ** 2, (clipped - returns) ** 2).mean()
    entropy = entropy.mean()
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    return loss, {"pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(),
                  "entropy": entropy.detach(), "approx_kl": approx_kl, "clipfrac": clipfrac}


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` without a branch on the norm: always multiply."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def minibatch_step(*mb: torch.Tensor, loss_fn, optimizer, params, max_grad_norm, autocast):
    """Loss (under autocast), backward, grad clip, one fused Adam step; stats stay tensors."""
    with autocast():
        loss, stats = loss_fn(*mb)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    stats["grad_norm"] = clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return stats


# ---------------------------------------------------------------------------- CUDA graphs
# The one-line alternative: torch.compile(fn, mode="reduce-overhead") replays compiled code as
# CUDA graphs, torch managing the static buffers. This class captures the whole step (env,
# sampling and storage writes included), which is what removes the remaining launches.


class CudaGraphStep:
    """Run ``fn(*tensors)`` as a CUDA graph: warm it up on a side stream, restore the state
    the warmup changed, capture one call, then each call copies its arguments into the static
    inputs and replays the whole step in one launch. Capturable means: static shapes, state
    updated in place, no host reads, random numbers from a registered generator."""

    def __init__(self, fn, runner: Runner) -> None:
        self.fn, self.runner, self.graph = fn, runner, None

    def __call__(self, *args: torch.Tensor):
        if self.graph is None:
            self.static = [a.clone() for a in args]
            saved = snapshot(self.runner)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # lazy init and autotuning must not happen in the capture
                    self.fn(*self.static)
            torch.cuda.current_stream().wait_stream(side)
            restore(self.runner, saved)
            self.graph = torch.cuda.CUDAGraph()
            self.graph.register_generator_state(self.runner.generator)
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = self.fn(*self.static)
        for static, a in zip(self.static, args):
            static.copy_(a)
        self.graph.replay()
        return None if self.out is None else {k: v.clone() for k, v in self.out.items()}


# ---------------------------------------------------------------------------- the loop


@dataclass
class Runner:
    """Everything the loop owns (PureJaxRL's runner state)."""

    args: Args
    device: torch.device
    env: Forage
    agent: Agent
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    storage: dict[str, torch.Tensor]
    obs: torch.Tensor
    done: torch.Tensor
    t: torch.Tensor
    episodes: torch.Tensor


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def has_bf16(device: torch.device) -> bool:
    """Native bf16 (else emulated, slower): sm 8.0+ GPUs, x86 AMX or AVX-512 BF16, Arm bf16."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    cpu, info = torch.cpu, Path("/proc/cpuinfo")
    arm = info.exists() and "bf16" in info.read_text().split()
    return cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported() or arm


def uses_graphs(args: Args, device: torch.device) -> bool:  # the graphed update: bf16 GPUs
    return args.cuda_graphs and device.type == "cuda" and has_bf16(device)


def make_runner(args: Args) -> Runner:
    device = resolve_device(args.device)
    env = Forage(args, device)
    with torch.random.fork_rng(devices=[]):  # the init, without touching the global RNG
        torch.manual_seed(args.seed)
        agent = Agent(env.obs_shape, env.n_actions).to(device)
    lr = torch.tensor(args.lr, dtype=torch.float32, device=device)  # updated in place
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=args.adam_eps, fused=True,
                                 capturable=uses_graphs(args, device))  # only captured steps
    T, N = args.n_steps, args.n_envs
    storage = {"obs": torch.zeros(T, N, *env.obs_shape, device=device),
               "actions": torch.zeros(T, N, dtype=torch.int64, device=device),
               **{k: torch.zeros(T, N, device=device)
                  for k in ("logprobs", "values", "rewards", "dones")}}
    return Runner(args, device, env, agent, optimizer,
                  torch.Generator(device).manual_seed(args.seed), storage,
                  obs=env.observation(), done=torch.zeros(N, device=device),
                  t=torch.zeros(1, dtype=torch.int64, device=device),
                  episodes=torch.zeros(3, dtype=torch.float64, device=device))


def make_steps(r: Runner):
    """The rollout step and the minibatch step as they run on ``r.device``: compiled, bf16
    autocast where the device has bf16, replayed as CUDA graphs on a GPU; a line saying which."""
    a, bf16, graphs = r.args, has_bf16(r.device), uses_graphs(r.args, r.device)
    autocast = (partial(torch.autocast, r.device.type, dtype=torch.bfloat16,
                        cache_enabled=False) if bf16 else contextlib.nullcontext)  # or fp16
    policy = torch.compile(r.agent, fullgraph=True) if a.compile else r.agent
    loss_fn = partial(ppo_loss, r.agent, args=a)
    loss_fn = torch.compile(loss_fn, fullgraph=True) if a.compile else loss_fn
    step = partial(rollout_step, r, policy)
    train_step = partial(minibatch_step, loss_fn=loss_fn, optimizer=r.optimizer,
                         params=list(r.agent.parameters()), max_grad_norm=a.max_grad_norm,
                         autocast=autocast)
    if graphs:
        step, train_step = CudaGraphStep(step, r), CudaGraphStep(train_step, r)
    why = "" if graphs or not a.cuda_graphs else " (they need a bf16 CUDA GPU)"
    on = (f"compile {'on' if a.compile else 'off'}, CUDA graphs {'on' if graphs else 'off'}"
          f"{why}, precision {'bf16' if bf16 else 'fp32'}")
    return step, train_step, on


def state_tensors(r: Runner) -> list[torch.Tensor]:
    """What a step changes, besides the optimizer and the generator."""
    return [*r.agent.parameters(), *r.env.state(), r.obs, r.done, r.t, r.episodes]


def snapshot(r: Runner) -> dict:
    """Device-side copies of what a warmup call changes."""
    opt = {id(t): t.clone() for s in r.optimizer.state.values() for t in s.values()}
    return {"tensors": [t.detach().clone() for t in state_tensors(r)], "optimizer": opt,
            "generator": r.generator.get_state()}


@torch.no_grad()
def restore(r: Runner, saved: dict) -> None:
    """Copy ``saved`` back in place (captured graphs hold these very tensors). Optimizer
    state created after the snapshot is zeroed: zero moments and step = a fresh Adam."""
    for t, s in zip(state_tensors(r), saved["tensors"], strict=True):
        t.copy_(s)
    for state in r.optimizer.state.values():
        for t in state.values():
            if id(t) in saved["optimizer"]:
                t.copy_(saved["optimizer"][id(t)])
            else:
                t.zero_()
    r.generator.set_state(saved["generator"])


def write(r: Runner, **rows: torch.Tensor) -> None:
    """Store one (N, ...) row per field at step ``r.t``, a (1,) device tensor: no host read,
    and the same kernels whatever the step (so a CUDA graph can replay them)."""
    for name, row in rows.items():
        r.storage[name].index_copy_(0, r.t, row.unsqueeze(0))


def rollout_step(r: Runner, policy: nn.Module) -> None:
    """One env step for all N envs: sample, store at the device-side counter ``t``, step."""
    action, logprob, value = act(policy, r.obs, r.generator)
    write(r, obs=r.obs, actions=action, logprobs=logprob, values=value, dones=r.done)
    obs, reward, done, episode_return, episode_length = r.env.step(action)
    r.obs.copy_(obs)
    write(r, rewards=reward)
    r.done.copy_(done)
    r.t.add_(1).remainder_(r.args.n_steps)
    r.episodes.add_(torch.stack((done.sum(dtype=torch.float64),
                                 episode_return.to(torch.float64).sum(),
                                 episode_length.to(torch.float64).sum())))


def collect(r: Runner, step) -> dict[str, torch.Tensor]:
    """T steps with the policy; returns the (T, N, ...) storage."""
    with torch.no_grad():
        for _ in range(r.args.n_steps):
            step()
    return r.storage


def compute_batch(r: Runner) -> list[torch.Tensor]:
    """GAE on the collected storage, flattened to (T*N, ...) tensors in the order the loss
    takes them: obs, actions, logprobs, advantages, returns, values."""
    s, a = r.storage, r.args
    with torch.no_grad():
        next_value = r.agent.get_value(r.obs)
        adv, ret = gae(s["rewards"], s["values"], s["dones"], next_value, r.done, a.gamma,
                       a.gae_lambda)
    return [x.flatten(0, 1) for x in (s["obs"], s["actions"], s["logprobs"], adv, ret,
                                       s["values"])]


def update(r: Runner, train_step, batch: list[torch.Tensor], iteration: int
           ) -> dict[str, torch.Tensor]:
    """Anneal the LR (in place), then epochs x minibatches of optimizer steps on shuffles
    drawn on the device."""
    a = r.args
    if a.anneal_lr:
        r.optimizer.param_groups[0]["lr"].fill_(a.lr * max(1.0 - iteration / a.n_iterations,
                                                           0.0))
    n = batch[0].shape[0]
    mb = n // a.n_minibatches
    history = []
    for _ in range(a.update_epochs):
        perm = torch.randperm(n, device=r.device, generator=r.generator)
        for start in range(0, n, mb):
            idx = perm[start:start + mb]
            history.append(train_step(*(x[idx] for x in batch)))
    return {k: torch.stack([h[k] for h in history]).mean() for k in history[0]}


def main(args: Args) -> None:
    r = make_runner(args)
    step, train_step, on = make_steps(r)
    print(f"{args.n_iterations} iterations of {args.n_envs} envs x {args.n_steps} steps on "
          f"{r.device}: {on} (the first iteration compiles and captures)")
    for iteration in range(args.n_iterations):
        start = time.perf_counter()
        collect(r, step)
        stats = update(r, train_step, compute_batch(r), iteration)
        # The loop's one host read per iteration (it also waits for the GPU: the clock is
        # honest): episode sums and update statistics together.
        values = torch.cat([r.episodes, torch.stack(list(stats.values())).double()]).tolist()
        r.episodes.zero_()
        count, ret_sum, len_sum, *stat_values = values
        sps = args.batch_size / (time.perf_counter() - start)
        print(f"iter {iteration + 1:>5}  {sps:>9,.0f} steps/s  episodes {int(count):>5}  "
              f"mean return {ret_sum / count if count else math.nan:6.2f}  "
              f"mean length {len_sum / count if count else math.nan:5.1f}  "
              + "  ".join(f"{k} {v:.3f}" for k, v in zip(stats, stat_values)))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (its --help)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(Args)
    for f in dataclasses.fields(Args):
        flag, text = "--" + f.name.replace("_", "-"), docs[f.name]
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=text)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=text)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse_args())
