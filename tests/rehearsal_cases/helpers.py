"""Small utilities in the style of RL code bases' ``utils.py``: the "inside a helper from another
file" variants call these. A ``# HAZARD`` line here is where a report must point when a case
names the helper as its hazard; a case that uses a helper cleanly has its hazard elsewhere or
none."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributions import Categorical

# ---------------------------------------------------------------- factories' aids (no hazard)


def spd(n: int, device: torch.device | str, batch: tuple[int, ...] = ()) -> torch.Tensor:
    """A well-conditioned symmetric positive definite matrix (a covariance, a Fisher)."""
    a = torch.randn(*batch, n, n, device=device)
    return a @ a.mT / n + torch.eye(n, device=device)


def mlp(*sizes: int) -> torch.nn.Sequential:
    """Linear layers with tanh between them, the usual small policy or critic."""
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


# ---------------------------------------------------------------- linear algebra, statistics


def mahalanobis(x: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Squared Mahalanobis distance of each row of ``x`` (an anomaly score on observations)."""
    precision = torch.linalg.inv(cov)  # HAZARD
    d = x - mean
    return ((d @ precision) * d).sum(-1)


def ridge_weights(feats: torch.Tensor, targets: torch.Tensor, lam: float) -> torch.Tensor:
    """Closed-form ridge regression, as in a linear value baseline."""
    gram = feats.mT @ feats + lam * torch.eye(feats.shape[-1], device=feats.device)
    return torch.linalg.solve(gram, feats.mT @ targets)  # HAZARD


def correlated_noise(cov: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` Gaussian exploration vectors with covariance ``cov``."""
    chol = torch.linalg.cholesky(cov)  # HAZARD
    return torch.randn(n, cov.shape[-1], device=cov.device) @ chol.mT


def value_histogram(values: torch.Tensor) -> torch.Tensor:
    """A normalised histogram of value predictions for logging."""
    counts = values.histc(bins=32)  # HAZARD
    return counts / values.numel()


def bounded_histogram(values: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """The same, over a fixed range."""
    return torch.histc(values, bins=32, min=lo, max=hi) / values.numel()


# ---------------------------------------------------------------- sampling


def sample_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """One action per row of a probability table."""
    return torch.multinomial(probs, 1).squeeze(-1)


def categorical_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An action and its log-probability, without argument validation."""
    dist = Categorical(logits=logits, validate_args=False)
    action = dist.sample()
    return action, dist.log_prob(action)


def policy_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean entropy of a categorical policy, for the entropy bonus."""
    return Categorical(logits=logits).entropy().mean()  # HAZARD


def explore(q: torch.Tensor, eps: float, rng: random.Random) -> torch.Tensor:
    """Epsilon-greedy over a batch, one coin for the batch."""
    if rng.random() < eps:  # HAZARD
        return torch.randint(0, q.shape[-1], q.shape[:-1], device=q.device)
    return q.argmax(-1)


def seeded_noise(like: torch.Tensor, seed: int) -> torch.Tensor:
    """Reproducible noise for an evaluation rollout."""
    torch.manual_seed(seed)  # HAZARD
    return torch.randn_like(like)


def gaussian_exploration(action: torch.Tensor, sigma: float, rng: random.Random) -> torch.Tensor:
    """TD3-style exploration with a Python-side draw."""
    return action + sigma * rng.gauss(0.0, 1.0)  # HAZARD


# ---------------------------------------------------------------- optimisation


def apply_gradients(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """Backward and one optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()  # HAZARD


def sgd_update(params: Sequence[torch.Tensor], lr: float) -> None:
    """Plain SGD on parameters whose ``.grad`` is filled."""
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-lr)  # HAZARD


def cosine_lr(step: int, total: int, base: float) -> float:
    """A cosine learning-rate schedule."""
    return 0.5 * base * (1.0 + float(np.cos(np.pi * min(step, total) / total)))


def soft_update(target: Sequence[torch.Tensor], online: Sequence[torch.Tensor],
                tau: float) -> None:
    """Polyak averaging of target parameters."""
    with torch.no_grad():
        torch._foreach_lerp_(list(target), list(online), tau)


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor,
        last_value: torch.Tensor, gamma: float = 0.99, lam: float = 0.95) -> torch.Tensor:
    """Generalised advantage estimation over a fixed horizon (time first)."""
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(last_value)
    for t in reversed(range(rewards.shape[0])):
        next_value = last_value if t == rewards.shape[0] - 1 else values[t + 1]
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv


def normalize(adv: torch.Tensor) -> torch.Tensor:
    """Advantage normalisation."""
    return (adv - adv.mean()) / (adv.std() + 1e-8)


# ---------------------------------------------------------------- state, buffers


def write_slot(buf: torch.Tensor, cursor: dict, row: torch.Tensor) -> None:
    """Write one row of a ring buffer at a Python cursor."""
    buf[cursor["i"] % buf.shape[0]] = row  # HAZARD
    cursor["i"] += 1


def ema_into(state: dict, key: str, x: torch.Tensor, decay: float = 0.99) -> torch.Tensor:
    """An exponential moving average kept in a dict."""
    state[key] = decay * state[key] + (1 - decay) * x  # HAZARD
    return state[key]


def lerp_into(mean: torch.Tensor, x: torch.Tensor, weight: float = 0.01) -> torch.Tensor:
    """The same average, updated in place."""
    return mean.lerp_(x, weight)


def advance_counter(counter: torch.Tensor) -> torch.Tensor:
    """Count one more step."""
    return counter.add_(1)  # HAZARD


def decay_lr(lr: torch.Tensor, gamma: float) -> torch.Tensor:
    """Exponential learning-rate decay, in place."""
    return lr.mul_(gamma)  # HAZARD


def smooth_over_history(history: list, x: torch.Tensor) -> torch.Tensor:
    """Mean of the last three values seen."""
    history.append(x.clone())
    return torch.stack(history[-3:]).mean(0)  # HAZARD


def recent_window(values: torch.Tensor, seen: list) -> dict:
    """The values of the episodes finished so far."""
    seen.append(None)
    return {"window": values[-len(seen):].clone()}  # HAZARD


def update_unless_capturing(stats: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Keep running statistics, but not inside a graph."""
    if not torch.cuda.is_current_stream_capturing():  # HAZARD
        stats.mul_(0.9).add_(x.mean(0), alpha=0.1)
    return x - stats


def log_unless_capturing(log: list, name: str, value: torch.Tensor) -> None:
    """Log a tensor's value from eager calls; a capture cannot wait for the read."""
    if not torch.cuda.is_current_stream_capturing():
        log.append((name, value.detach().float().mean().item()))


# ---------------------------------------------------------------- host and device


def stopwatch(device: torch.device) -> float:
    """Wall time once the device is done (a profiling helper)."""
    torch.cuda.synchronize(device)  # HAZARD
    return time.perf_counter()


def drain_stream() -> None:
    """Wait for the work queued so far."""
    torch.cuda.current_stream().synchronize()  # HAZARD


def stash_on_host(host_buf: torch.Tensor, values: torch.Tensor) -> None:
    """Copy metrics into a host buffer for the logger."""
    host_buf.copy_(values)  # HAZARD


def log_scalar(log: list, value: torch.Tensor) -> None:
    """Append a scalar to a Python log."""
    log.append(value.item())  # HAZARD


def to_device(batch: dict, device: torch.device | str) -> dict:
    """Move a batch to the training device."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy for numpy code."""
    return t.to("cpu")  # HAZARD


def obs_from_numpy(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """An observation from a numpy env."""
    return torch.from_numpy(arr).to(device)  # HAZARD


def rewards_as_tensor(rewards: list, device: torch.device) -> torch.Tensor:
    """Rewards gathered in Python."""
    return torch.as_tensor(rewards, dtype=torch.float32, device=device)  # HAZARD


def bias_like(x: torch.Tensor, values: list) -> torch.Tensor:
    """Per-feature offsets on ``x``'s device."""
    return x + x.new_tensor(values)  # HAZARD


def scale_by(x: torch.Tensor, values: list) -> torch.Tensor:
    """Per-feature scales."""
    return x * torch.tensor(values)  # HAZARD


# ---------------------------------------------------------------- indexing, shapes


def q_of_action(q: torch.Tensor, action: torch.Tensor, n: int) -> torch.Tensor:
    """Q(s, a) by a one-hot mask."""
    return (q * F.one_hot(action, n).to(q.dtype)).sum(-1)


def one_hot_auto(action: torch.Tensor) -> torch.Tensor:
    """A one-hot encoding sized by the data."""
    return F.one_hot(action).float()  # HAZARD


def zero_negatives(y: torch.Tensor) -> torch.Tensor:
    """Clip negative values to zero by a mask."""
    y = y.clone()
    y[y < 0] = 0.0
    return y


def fill_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Replace masked entries by the mean."""
    x = x.clone()
    x[mask] = x.mean()  # HAZARD
    return x


def discount(values: torch.Tensor, gamma: float) -> torch.Tensor:
    """Scale by a discount made as a 0-d tensor."""
    return torch.tensor(gamma) * values


def expand_by_counts(x: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """Repeat rows by counts whose sum is known."""
    return x.repeat_interleave(counts, dim=0, output_size=total)


def expand_by_counts_dynamic(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Repeat rows by counts whose sum is not given."""
    return x.repeat_interleave(counts, dim=0)  # HAZARD


def gather_row(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One row at a 0-d index tensor."""
    return buf[index]  # HAZARD


def loss_and_count(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss and the batch size it averaged over."""
    return F.mse_loss(pred, target), pred.shape[0]


# ---------------------------------------------------------------- inputs the tool must model


def encode_sequence(lstm: torch.nn.LSTM, x: torch.Tensor) -> torch.Tensor:
    """The last layer's final hidden state."""
    _, (h, _) = lstm(x)
    return h[-1]


def greedy_action(net: torch.nn.Module, obs: torch.Tensor) -> torch.Tensor:
    """An evaluation action without autograd."""
    with torch.inference_mode():
        return net(obs).argmax(-1)


def coalesce_adjacency(index: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """A sparse adjacency with duplicate edges summed."""
    return torch.sparse_coo_tensor(index, weight, (n, n)).coalesce()  # HAZARD


def nested_relu(nt: torch.Tensor) -> torch.Tensor:
    """An elementwise op over a batch of ragged sequences."""
    return nt.relu()
