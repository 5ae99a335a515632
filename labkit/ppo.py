"""PPO as pure functions: tensors and modules in, tensors out, no host reads.

Shapes: rollout tensors are (T, N) (time, env); the update works on flattened (T*N, ...) batches.
Nothing here calls ``.item()`` or branches on tensor values, so the pieces can be compiled,
replayed as CUDA graphs, and metered with :class:`labkit.measure.syncmeter.SyncMeter`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch
from torch import nn

from labkit import debug
from labkit.precision import Precision
from labkit.validate import check_float, check_int

FP32 = Precision()  # minibatch_step's default: no autocast, a plain backward and step


@dataclass
class PPOConfig:
    """PPO hyperparameters (CleanRL's defaults for Atari-like discrete control)."""

    gamma: float = 0.99
    """Discount factor, in [0, 1]."""
    gae_lambda: float = 0.95
    """GAE lambda, in [0, 1]."""
    update_epochs: int = 4
    """Passes over the rollout per update."""
    n_minibatches: int = 4
    """Minibatches per epoch; must divide n_envs * n_steps."""
    clip_coef: float = 0.2
    """Clipping range of the probability ratio (and of the value change when clip_vloss)."""
    vf_coef: float = 0.5
    """Weight of the value loss (>= 0)."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus (>= 0)."""
    lr: float = 2.5e-4
    """Adam learning rate at the start (annealed linearly to 0 when anneal_lr)."""
    adam_eps: float = 1e-5
    """Adam epsilon."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip."""
    anneal_lr: bool = True
    """Anneal the learning rate linearly to 0 over the run."""
    norm_adv: bool = True
    """Normalize advantages per minibatch."""
    clip_vloss: bool = True
    """Use the clipped value loss."""

    def __post_init__(self) -> None:
        for name in ("gamma", "gae_lambda"):
            check_float(name, getattr(self, name), 0.0, "in [0, 1]", high=1.0)
        for name in ("clip_coef", "lr", "adam_eps", "max_grad_norm"):
            check_float(name, getattr(self, name), 0.0, "> 0", strict=True)
        for name in ("vf_coef", "ent_coef"):
            check_float(name, getattr(self, name), 0.0, ">= 0")
        check_int("update_epochs", self.update_epochs, 1)
        check_int("n_minibatches", self.n_minibatches, 1)
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")

    def check_batch(self, n_envs: int, n_steps: int) -> int:
        """Return the minibatch size; raise if n_minibatches does not divide n_envs * n_steps,
        or (with norm_adv) leaves one sample per minibatch: the std of one advantage is NaN."""
        batch = n_envs * n_steps
        if batch % self.n_minibatches:
            raise ValueError(f"n_minibatches must divide n_envs * n_steps = {batch}, "
                             f"got n_minibatches={self.n_minibatches}")
        if self.norm_adv and batch == self.n_minibatches:
            raise ValueError(f"n_minibatches={self.n_minibatches} leaves one sample per "
                             f"minibatch of n_envs * n_steps = {batch}, and normalizing one "
                             "advantage divides by a NaN std: use fewer minibatches, more "
                             "envs or steps, or norm_adv=False")
        return batch // self.n_minibatches


@dataclass
class Batch:
    """One rollout flattened to (T*N, ...): what the update consumes.

    ``returns`` and ``values`` are in return space (not normalized); the value head maps them to
    its training space inside the loss.
    """

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor

    @classmethod
    def from_rollout(cls, obs: torch.Tensor, actions: torch.Tensor, logprobs: torch.Tensor,
                     advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor
                     ) -> Batch:
        """Flatten (T, N, ...) rollout tensors."""
        return cls(obs.flatten(0, 1), actions.flatten(0, 1), logprobs.flatten(0, 1),
                   advantages.flatten(0, 1), returns.flatten(0, 1), values.flatten(0, 1))

    def index(self, idx: torch.Tensor) -> Batch:
        """The rows ``idx`` of every field (a minibatch)."""
        return Batch(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor,
        next_value: torch.Tensor, next_done: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns (advantages, returns), both (T, N).

    CleanRL's convention: ``dones[t]`` is the done flag that came *with obs t*, i.e. obs t is
    the first of a new episode (the env reset in the step before), so there is no bootstrap
    from step t-1 into step t. ``next_value``/``next_done`` (N,) belong to the observation after
    the last step. Forage episodes end by truncation only; we treat truncation like termination
    (no bootstrap across the boundary). That biases values near the time limit slightly, the
    same simplification CleanRL makes, and keeps every implementation comparable.
    """
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


def ppo_loss(agent: nn.Module, obs: torch.Tensor, actions: torch.Tensor,
             old_logprobs: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
             old_values: torch.Tensor, cfg: PPOConfig
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO loss on one minibatch; (loss, stats of 0-d tensors).

    ``returns`` and ``old_values`` are in return space; the value loss is taken in the value
    head's training space (``agent.value_head.prepare_targets``).
    """
    logprob, entropy, value = agent.evaluate(obs, actions)
    logratio = logprob - old_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()

    if cfg.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio,
                        -advantages * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()

    head = agent.value_head
    targets = head.prepare_targets(returns)
    if cfg.clip_vloss:
        old = head.prepare_targets(old_values)
        clipped = old + (value - old).clamp(-cfg.clip_coef, cfg.clip_coef)
        v_loss = 0.5 * torch.max((value - targets) ** 2, (clipped - targets) ** 2).mean()
    else:
        v_loss = 0.5 * ((value - targets) ** 2).mean()
    entropy = entropy.mean()
    loss = pg_loss - cfg.ent_coef * entropy + cfg.vf_coef * v_loss
    return loss, {"pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(),
                  "entropy": entropy.detach(), "approx_kl": approx_kl, "clipfrac": clipfrac}


@torch.no_grad()
def fused_clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2) for parameters on one device, without host sync.

    One ``_foreach_norm`` and one ``_foreach_mul_``; the clip coefficient stays a tensor, and
    the grads are always multiplied (by 1 when not clipping) instead of branching on the norm.
    Returns the total norm before clipping.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:  # nothing to clip: a zero norm where the parameters live
        return torch.zeros((), device=params[0].device if params else None)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return total


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def minibatch_step(mb: Batch, *, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                   params: list[torch.Tensor], max_grad_norm: float,
                   clip_grad: Callable[[Iterable[torch.Tensor], float], torch.Tensor]
                   = fused_clip_grad_norm_,
                   precision: Precision = FP32) -> dict[str, torch.Tensor]:
    """One optimizer step on one minibatch: loss, backward, grad clip, optimizer step.

    ``loss_fn(obs, actions, logprobs, advantages, returns, values) -> (loss, stats)`` is
    :func:`ppo_loss` bound to the agent (eager or compiled). ``precision``
    (:class:`labkit.precision.Precision`) runs the forward and loss under its autocast, and the
    backward, the unscaling before the clip and the step its way (through a GradScaler for
    fp16). Returns the loss stats and ``grad_norm`` (before clipping) as 0-d tensors.
    """
    with precision.autocast():
        loss, stats = loss_fn(mb.obs, mb.actions, mb.logprobs, mb.advantages, mb.returns,
                              mb.values)
    debug.check(losses=loss)
    optimizer.zero_grad(set_to_none=True)
    precision.backward(loss)
    precision.unscale_(optimizer, params)
    stats["grad_norm"] = clip_grad(params, max_grad_norm)
    precision.step(optimizer)
    return stats


def ppo_update(agent: nn.Module, batch: Batch, cfg: PPOConfig, *,
               step: Callable[[Batch], dict[str, torch.Tensor]],
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``cfg.update_epochs`` epochs x ``cfg.n_minibatches`` minibatches of optimizer steps.

    Order: first ``agent.value_head.update_stats(batch.returns)`` (PopArt moves its statistics
    and rescales its layer, preserving outputs), then the epochs; each minibatch maps returns
    and old values to training space with the updated statistics. Minibatches are shuffled with
    ``torch.randperm`` on the batch's device (``generator``, on that device, for determinism).
    ``step`` runs one minibatch: :func:`minibatch_step` with its parts bound, the one a stage
    builds (``labkit.update.build_update``: compiled, mixed precision, replayed as a graph).
    Returns the means over all minibatches of the loss stats and ``grad_norm`` (before
    clipping), as 0-d tensors.
    """
    n = batch.obs.shape[0]
    mb = cfg.check_batch(n, 1)
    agent.value_head.update_stats(batch.returns)
    history: list[dict[str, torch.Tensor]] = []
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(n, device=batch.obs.device, generator=generator)
        for start in range(0, n, mb):
            history.append(step(batch.index(perm[start:start + mb])))
    return {k: torch.stack([s[k] for s in history]).mean() for k in history[0]}


def annealed_lr(base_lr: float, iteration: int, n_iterations: int) -> float:
    """Linear annealing: ``base_lr * (1 - iteration / n_iterations)`` with 0-based
    ``iteration`` (CleanRL's schedule), 0 past the horizon. The optimizer component sets it
    (``stage.optimizer.set_lr``): a float, or in place into a device tensor."""
    return base_lr * max(1.0 - iteration / n_iterations, 0.0)
