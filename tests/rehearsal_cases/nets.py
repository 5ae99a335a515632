"""Modules and small trainers in the style of RL code bases: the "inside a module's method"
variants call these. A ``# HAZARD`` line here is where a report must point when a case names
the method as its hazard."""
from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

from .helpers import mlp

# ---------------------------------------------------------------- class 1: kernel syncs


class KalmanFilter(nn.Module):
    """A linear Kalman filter tracking a latent state from observations."""

    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.register_buffer("x", torch.zeros(n))
        self.register_buffer("P", torch.eye(n))
        self.register_buffer("H", torch.randn(m, n) / n)
        self.register_buffer("R", 0.1 * torch.eye(m))

    def update(self, z: torch.Tensor) -> torch.Tensor:
        S = self.H @ self.P @ self.H.mT + self.R
        K = self.P @ self.H.mT @ torch.linalg.inv(S)  # HAZARD
        self.x.add_(K @ (z - self.H @ self.x))
        self.P.copy_(self.P - K @ self.H @ self.P)
        return self.x.clone()


class GPCritic(nn.Module):
    """A Gaussian-process value baseline over a fixed set of inducing states."""

    def __init__(self, inducing: torch.Tensor, targets: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("z", inducing)
        self.register_buffer("y", targets)
        self.log_scale = nn.Parameter(torch.zeros(()))

    def kernel(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b).square() * self.log_scale.exp())

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        gram = self.kernel(self.z, self.z) + 0.1 * torch.eye(self.z.shape[0], device=s.device)
        alpha = torch.linalg.solve(gram, self.y)  # HAZARD
        return self.kernel(s, self.z) @ alpha


class FullCovPolicy(nn.Module):
    """A Gaussian policy with a learned full covariance."""

    def __init__(self, obs: int, act: int) -> None:
        super().__init__()
        self.mu = nn.Linear(obs, act)
        self.a = nn.Parameter(torch.eye(act))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        cov = self.a @ self.a.mT + 1e-3 * torch.eye(self.a.shape[0], device=obs.device)
        scale_tril = torch.linalg.cholesky(cov)  # HAZARD
        eps = torch.randn(obs.shape[0], cov.shape[0], device=obs.device)
        return self.mu(obs) + eps @ scale_tril.mT


class ActionHistogram(nn.Module):
    """Logs how often each action bin is taken."""

    def __init__(self, bins: int) -> None:
        super().__init__()
        self.bins = bins

    def forward(self, actions: torch.Tensor) -> torch.Tensor:
        counts = torch.histc(actions.float(), bins=self.bins)  # HAZARD
        return counts / actions.numel()


class SoftmaxPolicy(nn.Module):
    """A discrete policy that samples with torch.multinomial."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.net = mlp(obs, 32, n)

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.net(obs), dim=-1)
        return torch.multinomial(probs, 1).squeeze(-1)


class ActorCritic(nn.Module):
    """CleanRL's PPO agent, with the distribution's validation off."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.critic = mlp(obs, 32, 1)
        self.actor = mlp(obs, 32, n)

    def get_action_and_value(self, obs: torch.Tensor, action: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, ...]:
        dist = Categorical(logits=self.actor(obs), validate_args=False)
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(obs).squeeze(-1)


class ValidatedPolicy(nn.Module):
    """The same policy with torch's default argument validation."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.head = mlp(obs, 32, n)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = Categorical(logits=self.head(obs))  # HAZARD
        action = dist.sample()
        return action, dist.log_prob(action)


# ---------------------------------------------------------------- class 2: optimizers


class DQNAgent:
    """A Q-network and its optimizer; ``update`` is the step a graph captures."""

    def __init__(self, obs: int, n: int, make_opt: Callable[..., torch.optim.Optimizer]
                 ) -> None:
        self.q = mlp(obs, 32, n)
        self.opt = make_opt(self.q.parameters())

    def update(self, obs: torch.Tensor, action: torch.Tensor, target: torch.Tensor
               ) -> torch.Tensor:
        q = self.q(obs).gather(1, action.unsqueeze(1)).squeeze(1)
        loss = F.smooth_l1_loss(q, target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()  # HAZARD
        return loss.detach()


class AnnealedCritic:
    """A critic trained by a fused capturable Adam whose learning rate a schedule anneals
    between updates, the tensor kept on the host."""

    def __init__(self, obs: int, lr: float) -> None:
        self.v = mlp(obs, 32, 1)
        self.lr = torch.tensor(lr, device="cpu")
        self.opt = torch.optim.Adam(self.v.parameters(), lr=self.lr, fused=True,
                                    capturable=True)

    def anneal(self, frac: float) -> None:
        self.lr.fill_(3e-4 * (1.0 - frac))

    def update(self, obs: torch.Tensor, ret: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.v(obs).squeeze(-1), ret)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()  # HAZARD
        return loss.detach()


# ---------------------------------------------------------------- class 3: frozen values


class ReplayBuffer:
    """A ring buffer with a Python write pointer (the usual NumPy port)."""

    def __init__(self, capacity: int, obs: int, device: torch.device) -> None:
        self.obs = torch.zeros(capacity, obs, device=device)
        self.capacity, self.ptr = capacity, 0

    def add(self, obs: torch.Tensor) -> None:
        self.obs[self.ptr] = obs  # HAZARD
        self.ptr = (self.ptr + 1) % self.capacity


class DeviceRingBuffer:
    """A ring buffer whose write pointer lives on the device."""

    def __init__(self, capacity: int, obs: int, device: torch.device) -> None:
        self.obs = torch.zeros(capacity, obs, device=device)
        self.ptr = torch.zeros(1, dtype=torch.long, device=device)

    def add(self, obs: torch.Tensor) -> None:
        self.obs.index_copy_(0, self.ptr, obs.unsqueeze(0))
        self.ptr.add_(1).remainder_(self.obs.shape[0])


class DecayingSGD:
    """A trainer that decays a Python-float learning rate each step."""

    def __init__(self, net: nn.Module, lr: float, decay: float) -> None:
        self.net, self.lr, self.decay = net, lr, decay

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.lr *= self.decay
        loss = F.mse_loss(self.net(x), y)
        grads = torch.autograd.grad(loss, list(self.net.parameters()))
        with torch.no_grad():
            for p, g in zip(self.net.parameters(), grads):
                p.add_(g, alpha=-self.lr)  # HAZARD
        return loss.detach(), self.net(x).detach()


class EMANormalizer(nn.Module):
    """Observation normaliser whose mean is rebound to a new tensor each call."""

    def __init__(self, n: int, device: torch.device, momentum: float = 0.01) -> None:
        super().__init__()
        self.mean = torch.zeros(n, device=device)
        self.momentum = momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = self.mean + self.momentum * (x.mean(0) - self.mean)  # HAZARD
        return x - self.mean


class GRUPolicy(nn.Module):
    """A recurrent policy that keeps its hidden state as an attribute it rebinds."""

    def __init__(self, obs: int, hidden: int, n: int, batch: int, device: torch.device
                 ) -> None:
        super().__init__()
        self.cell = nn.GRUCell(obs, hidden)
        self.head = nn.Linear(hidden, n)
        self.h = torch.zeros(batch, hidden, device=device)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        self.h = self.cell(obs, self.h).detach()  # HAZARD
        return self.head(self.h)


class RunningMeanStd(nn.Module):
    """Observation statistics updated in place (the capturable way)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("var", torch.ones(n))
        self.register_buffer("count", torch.full((), 1e-4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        delta = x.mean(0) - self.mean
        total = self.count + b
        new_mean = self.mean + delta * b / total
        m2 = self.var * self.count + x.var(0, unbiased=False) * b \
            + delta.square() * self.count * b / total
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / total)
        self.count.copy_(total)
        return (x - self.mean) / (self.var + 1e-8).sqrt()


class LSTMCellPolicy(nn.Module):
    """A recurrent policy whose state is updated in place."""

    def __init__(self, obs: int, hidden: int, n: int, batch: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(obs, hidden)
        self.head = nn.Linear(hidden, n)
        self.register_buffer("h", torch.zeros(batch, hidden))
        self.register_buffer("c", torch.zeros(batch, hidden))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h, c = self.cell(obs, (self.h, self.c))
        self.h.copy_(h.detach())
        self.c.copy_(c.detach())
        return self.head(h)


class EpsilonGreedy(nn.Module):
    """A DQN actor with a Python coin for exploration."""

    def __init__(self, eps: float, seed: int) -> None:
        super().__init__()
        self.eps, self.rng = eps, random.Random(seed)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if self.rng.random() < self.eps:  # HAZARD
            return torch.randint(0, q.shape[-1], q.shape[:-1], device=q.device)
        return q.argmax(-1)


class ReseededNoise(nn.Module):
    """Evaluation noise made reproducible by reseeding every call."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed

    def forward(self, mu: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(self.seed)  # HAZARD
        return mu + 0.1 * torch.randn_like(mu)


# ---------------------------------------------------------------- class 4: stream syncs


class ProfiledPolicy(nn.Module):
    """A policy that times its forward pass."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.net = mlp(obs, 32, n)
        self.times: list[float] = []

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.net(obs)
        torch.cuda.synchronize()  # HAZARD
        self.times.append(time.perf_counter() - start)
        return out


class DrainingCritic(nn.Module):
    """A critic that waits for its stream before returning."""

    def __init__(self, obs: int) -> None:
        super().__init__()
        self.net = mlp(obs, 32, 1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        v = self.net(obs).squeeze(-1)
        torch.cuda.current_stream(obs.device).synchronize()  # HAZARD
        return v


# ---------------------------------------------------------------- class 5: host memory


class MetricsLogger(nn.Module):
    """Copies loss terms into a host buffer that a logger thread reads."""

    def __init__(self) -> None:
        super().__init__()
        self.host = torch.zeros(3, device="cpu")

    def forward(self, pg: torch.Tensor, vf: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        terms = torch.stack([pg, vf, ent])
        self.host.copy_(terms)  # HAZARD
        return terms.sum()


class BiasCorrectedEMA(nn.Module):
    """Adam-style first moment with a step counter kept on the host."""

    def __init__(self, n: int, beta: float = 0.9) -> None:
        super().__init__()
        self.register_buffer("m", torch.zeros(n))
        self.steps = torch.zeros((), device="cpu")
        self.beta = beta

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)  # HAZARD
        self.m.mul_(self.beta).add_(g, alpha=1 - self.beta)
        return self.m / (1 - self.beta ** self.steps)


class HostLRSGD:
    """SGD whose learning rate is a host tensor decayed in place."""

    def __init__(self, net: nn.Module, lr: float, gamma: float) -> None:
        self.net, self.gamma = net, gamma
        self.lr = torch.tensor(lr, device="cpu")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)
        grads = torch.autograd.grad(loss, list(self.net.parameters()))
        self.lr.mul_(self.gamma)  # HAZARD
        with torch.no_grad():
            for p, g in zip(self.net.parameters(), grads):
                p.sub_(g * self.lr)
        return loss.detach(), self.net(x).detach()


# ---------------------------------------------------------------- class 6: clean, and twins


class DiscreteCritic(nn.Module):
    """Q(s, a) by a one-hot mask of the taken action."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.q, self.n = mlp(obs, 32, n), n

    def q_of(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        mask = F.one_hot(action, num_classes=self.n).to(obs.dtype)
        return (self.q(obs) * mask).sum(-1)


class InferredOneHot(nn.Module):
    """The same, sizing the one-hot by the data."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.q = mlp(obs, 32, n)

    def q_of(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        mask = F.one_hot(action).to(obs.dtype)  # HAZARD
        return (self.q(obs) * mask).sum(-1)


class ActionMasker(nn.Module):
    """Invalid actions get a large negative logit by a boolean mask."""

    def forward(self, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[~valid] = -1e9
        return logits.log_softmax(-1)


class MeanFiller(nn.Module):
    """Missing features get the batch mean by a boolean mask."""

    def forward(self, x: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[missing] = x.mean()  # HAZARD
        return x


class TDTarget(nn.Module):
    """A one-step TD target with the discount made as a 0-d tensor."""

    def __init__(self, gamma: float) -> None:
        super().__init__()
        self.gamma = gamma

    def forward(self, r: torch.Tensor, done: torch.Tensor, v_next: torch.Tensor
                ) -> torch.Tensor:
        return r + torch.tensor(self.gamma) * (1.0 - done) * v_next


class SegmentExpander(nn.Module):
    """Repeats per-episode values over their steps, the total known."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(x, lengths, dim=0, output_size=self.total)


class DynamicExpander(nn.Module):
    """The same without the total."""

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(x, lengths, dim=0)  # HAZARD


class PortablePolicy(nn.Module):
    """A policy that moves its input to the device it picked at construction."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.net = mlp(obs, 32, n)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.to(self.device, dtype=torch.float32))


class LoggingCritic(nn.Module):
    """A critic that keeps its last mean value for a progress bar, from eager calls only."""

    def __init__(self, obs: int) -> None:
        super().__init__()
        self.net = mlp(obs, 32, 1)
        self.last_value = float("nan")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        value = self.net(obs).squeeze(-1)
        if not torch.cuda.is_current_stream_capturing():
            self.last_value = value.mean().item()
        return value


class HostCopyPolicy(nn.Module):
    """A policy that keeps a host copy of its last output for a dashboard."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.net = mlp(obs, 32, n)
        self.last: torch.Tensor | None = None

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.net(obs)
        self.last = out.detach().cpu()  # HAZARD
        return out


class SizedHead(nn.Module):
    """Returns its output and its (constant) width."""

    def __init__(self, obs: int, width: int) -> None:
        super().__init__()
        self.net, self.width = nn.Linear(obs, width), width

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.net(obs), self.width


class EpochReporter(nn.Module):
    """Returns its loss and a Python counter that grows every call."""

    def __init__(self, obs: int) -> None:
        super().__init__()
        self.net, self.calls = nn.Linear(obs, 1), 0

    def forward(self, obs: torch.Tensor) -> dict:
        self.calls += 1
        return {"loss": self.net(obs).square().mean(), "calls": self.calls}  # HAZARD


# ---------------------------------------------------------------- class 7: inputs to model


class RecurrentPolicy(nn.Module):
    """An LSTM encoder over an observation history, then a policy head."""

    def __init__(self, obs: int, hidden: int, n: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(obs, hidden, batch_first=True)
        self.head = nn.Linear(hidden, n)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(seq)
        return self.head(out[:, -1])


class InferenceActor(nn.Module):
    """An actor whose acting path runs under inference_mode."""

    def __init__(self, obs: int, n: int) -> None:
        super().__init__()
        self.net = mlp(obs, 32, n)

    @torch.inference_mode()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


class GraphConv(nn.Module):
    """A graph convolution over a sparse adjacency built from an edge list."""

    def __init__(self, n: int, features: int) -> None:
        super().__init__()
        self.n, self.lin = n, nn.Linear(features, features)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, weight: torch.Tensor
                ) -> torch.Tensor:
        adj = torch.sparse_coo_tensor(edges, weight, (self.n, self.n))
        return torch.sparse.mm(adj, self.lin(x))  # HAZARD


class SetEncoder(nn.Module):
    """A DeepSets-style encoder applied to a nested batch of ragged sets."""

    def forward(self, sets: torch.Tensor) -> torch.Tensor:
        return sets.relu().mul(2.0)


# ---------------------------------------------------------------- class 8: messages


class NumpyEnvBridge:
    """Copies the observation a NumPy env wrote into a device tensor."""

    def __init__(self, obs: int, device: torch.device) -> None:
        self.obs_np = np.ones(obs, dtype=np.float32)
        self.device = device

    def observe(self, scale: torch.Tensor) -> torch.Tensor:
        obs = torch.from_numpy(self.obs_np).to(self.device)  # HAZARD
        return obs * scale


class RewardTracker:
    """Turns rewards collected in a Python list into a tensor."""

    def __init__(self, device: torch.device) -> None:
        self.rewards = [1.0, 0.0, 0.5, 1.0]
        self.device = device

    def returns(self, values: torch.Tensor) -> torch.Tensor:
        r = torch.as_tensor(self.rewards, device=self.device)  # HAZARD
        return r + 0.99 * values


class FeatureOffsets(nn.Module):
    """Adds fixed offsets made with new_tensor."""

    def __init__(self, offsets: list) -> None:
        super().__init__()
        self.offsets = offsets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.new_tensor(self.offsets)  # HAZARD


class RolloutStorage:
    """Rollout storage whose step index is a 0-d device tensor."""

    def __init__(self, steps: int, obs: int, device: torch.device) -> None:
        self.obs = torch.zeros(steps, obs, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)

    def insert(self, obs: torch.Tensor) -> None:
        self.obs[self.step] = obs  # HAZARD
        self.step.add_(1).remainder_(self.obs.shape[0])


# ---------------------------------------------------------------- silent failures


class OUNoise:
    """Ornstein-Uhlenbeck exploration noise driven by Python's random."""

    def __init__(self, n: int, device: torch.device, seed: int) -> None:
        self.state = torch.zeros(n, device=device)
        self.rng = random.Random(seed)

    def sample(self) -> torch.Tensor:
        self.state.add_(-0.15 * self.state + 0.2 * self.rng.gauss(0.0, 1.0))  # HAZARD
        return self.state.clone()


class FeatureHistory(nn.Module):
    """Averages the encoder's features over the last three calls."""

    def __init__(self, obs: int, batch: int) -> None:
        super().__init__()
        self.enc = nn.Linear(obs, 8)
        self.register_buffer("h", torch.zeros(batch, 8))
        self.history: list[torch.Tensor] = []

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        self.h.mul_(0.5).add_(self.enc(obs).detach())
        self.history.append(self.h.clone())
        return torch.stack(self.history[-3:]).mean(0)  # HAZARD


class EpisodeTracker(nn.Module):
    """Returns the returns of the episodes finished so far."""

    def __init__(self) -> None:
        super().__init__()
        self.done = 0

    def forward(self, returns: torch.Tensor) -> dict:
        self.done += 1
        return {"finished": returns[: self.done].clone()}  # HAZARD


class SafeNormalizer(nn.Module):
    """Updates its statistics only when no graph is being captured."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():  # HAZARD
            self.mean.lerp_(x.mean(0), 0.1)
        return x - self.mean
