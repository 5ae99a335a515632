"""The reference agent: a small conv net with a policy head and a swappable value head.

The architecture is fixed so that FLOP counts and timings compare across stages; its body is
the conv net (``"conv"``) or, where a reader wants attention, one self-attention layer over the
view's cells through ``F.scaled_dot_product_attention`` (``"attention"``, :class:`AttentionBody`:
the same heads, the same ``act``/``evaluate``). The two value heads share one interface, so
the update calls the same methods whichever head is in use:

* ``forward(h)`` / ``get_training_value(h)``: the value in *training space* (what the value loss
  sees; normalized for PopArt),
* ``denormalize(v)``: training space -> return space (what GAE needs),
* ``prepare_targets(returns)``: return space -> training space,
* ``update_stats(returns)``: refresh normalization statistics (a no-op for the plain head).

Nothing here reads tensor data on the host: sampling is a Gumbel-max on the device.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit import debug
from labkit.envs.spec import N_ACTIONS, N_CHANNELS

HIDDEN = 128
VALUE_HEADS = ("plain", "popart")
BODIES = ("conv", "attention")
#: The attention body's width and heads (head dim 8: inside every fused kernel's limits).
ATTENTION_DIM, ATTENTION_HEADS = 32, 4


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    """Orthogonal weights, constant bias (CleanRL's ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def check_view(view: object) -> int:
    if isinstance(view, bool) or not isinstance(view, int) or view < 5:
        raise ValueError(f"view must be an int >= 5 (two unpadded 3x3 convs), got {view!r}")
    return view


def flops_per_sample(view: int = 7, body: str = "conv") -> dict[str, int]:
    """FLOPs of the reference agent per observation.

    Convention: 2 FLOPs per multiply-add of the convolutions, linear layers and attention's two
    matmuls (policy and value heads included); biases, ReLUs, softmax and the optimizer are not
    counted. ``train`` is forward + backward, taken as 3x forward (backward = grads w.r.t.
    inputs + w.r.t. weights).
    """
    check_view(view)
    check_body(body)
    if body == "conv":
        s1, s2 = view - 2, view - 4
        macs = (s1 * s1 * 16 * N_CHANNELS * 9      # conv1
                + s2 * s2 * 32 * 16 * 9            # conv2
                + 32 * s2 * s2 * HIDDEN)           # linear
    else:
        tokens, d = view * view, ATTENTION_DIM
        macs = (tokens * N_CHANNELS * d            # embedding
                + tokens * d * 4 * d               # q, k, v and the output projection
                + 2 * tokens * tokens * d          # QK^T and (softmax) V, all heads
                + tokens * d * HIDDEN)             # linear
    macs += HIDDEN * N_ACTIONS + HIDDEN            # policy and value heads
    return {"forward": 2 * macs, "train": 6 * macs}


def check_body(body: object) -> str:
    if body not in BODIES:
        raise ValueError(f"model must be one of {', '.join(BODIES)}; got {body!r}")
    return body


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(Q K^T / sqrt(d)) V`` written out: what ``F.scaled_dot_product_attention``
    computes, materializing the (..., L, L) score matrix that fused kernels never store."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


class AttentionBody(nn.Module):
    """The view's V*V cells as tokens (each cell's channels embedded, plus a learned position),
    one multi-head self-attention layer with a residual, then flatten -> linear(128) -> ReLU:
    the conv body's output shape, so the heads and the PPO code are the same.

    ``attend`` is the attention itself: ``F.scaled_dot_product_attention`` (fused kernels,
    chosen by torch per call; ``torch.nn.attention.sdpa_kernel`` restricts the choice), or
    :func:`attention_reference` to compare against."""

    def __init__(self, view: int = 7, dim: int = ATTENTION_DIM, heads: int = ATTENTION_HEADS,
                 attend=F.scaled_dot_product_attention) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.tokens, self.dim, self.heads = view * view, dim, heads
        self.embed = layer_init(nn.Linear(N_CHANNELS, dim))
        self.position = nn.Parameter(torch.empty(self.tokens, dim).normal_(std=0.02))
        self.qkv = layer_init(nn.Linear(dim, 3 * dim), std=1.0)
        self.out = layer_init(nn.Linear(dim, dim), std=1.0)
        self.linear = layer_init(nn.Linear(self.tokens * dim, HIDDEN))
        self.attend = attend

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """obs (B, 3, V, V) float -> features (B, 128)."""
        b = obs.shape[0]
        x = self.embed(obs.flatten(2).transpose(1, 2)) + self.position       # (B, L, dim)
        q, k, v = (self.qkv(x).view(b, self.tokens, 3, self.heads, self.dim // self.heads)
                   .permute(2, 0, 3, 1, 4))                                  # 3 x (B, H, L, d)
        a = self.attend(q, k, v).transpose(1, 2).reshape(b, self.tokens, self.dim)
        return F.relu(self.linear((x + self.out(a)).flatten(1)))


class ValueHead(nn.Module):
    """Plain value head: training space is return space."""

    def __init__(self, in_features: int = HIDDEN) -> None:
        super().__init__()
        self.linear = layer_init(nn.Linear(in_features, 1), std=1.0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h).squeeze(-1)

    def get_training_value(self, h: torch.Tensor) -> torch.Tensor:
        return self(h)

    def denormalize(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def prepare_targets(self, returns: torch.Tensor) -> torch.Tensor:
        return returns

    def update_stats(self, returns: torch.Tensor) -> None:
        pass


class PopArtValueHead(ValueHead):
    """PopArt value head (van Hasselt et al. 2016; Hessel et al. 2019).

    The linear layer predicts the *normalized* value; ``denormalize`` maps it back with running
    statistics of the returns. ``update_stats`` moves the statistics and rescales the layer so
    that the un-normalized outputs are unchanged ("preserving outputs precisely").

    Statistics: running first and second moments, updated once per call with the mean of the
    batch, weight ``max(1/count, beta)``: an exact running average for the first ``1/beta``
    calls (so the first batch sets them, without a start-up bias), an EMA afterwards. The update
    calls this once per PPO iteration over all N*T returns, so ``beta`` is per iteration, larger
    than the per-SGD-step 3e-4 of Hessel et al.; 0.01 means roughly the last 100 iterations.
    ``std`` is clamped to ``[min_std, 1e6]``; Forage rewards are +-1, so 1e-2 only guards
    against near-constant returns blowing up the targets.
    """

    def __init__(self, in_features: int = HIDDEN, beta: float = 0.01,
                 min_std: float = 1e-2) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        if not 0.0 < min_std:
            raise ValueError(f"min_std must be > 0, got {min_std}")
        super().__init__(in_features)
        self.beta, self.min_std = beta, min_std
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("mean_sq", torch.ones(()))
        self.register_buffer("std", torch.ones(()))
        self.register_buffer("count", torch.zeros(()))

    def denormalize(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.std + self.mean

    def prepare_targets(self, returns: torch.Tensor) -> torch.Tensor:
        return (returns - self.mean) / self.std

    @torch.no_grad()
    def update_stats(self, returns: torch.Tensor) -> None:
        r = returns.detach().float()
        self.count += 1
        w = self.count.reciprocal().clamp(min=self.beta)
        mean = self.mean.lerp(r.mean(), w)
        mean_sq = self.mean_sq.lerp(r.square().mean(), w)
        std = (mean_sq - mean.square()).clamp(min=0).sqrt().clamp(self.min_std, 1e6)
        # sigma' (W' h + b') + mu' == sigma (W h + b) + mu
        self.linear.weight.mul_(self.std / std)
        self.linear.bias.mul_(self.std).add_(self.mean - mean).div_(std)
        self.mean.copy_(mean)
        self.mean_sq.copy_(mean_sq)
        self.std.copy_(std)


CONV_MATHS = ("conv2d", "matmul")


def places(conv: nn.Conv2d, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables that lay ``conv``'s weight (O, C, 3, 3) out as the dense matrix of an
    unpadded 3x3 convolution of a C x side x side input, int64 on the CPU:

    * ``place`` (C*side*side, O*s*s), s = side - 2: the flat index into the weight of entry
      ((c, y, x), (o, y', x')), ``W[o, c, y - y', x - x']``, or ``W.numel()`` (one past the
      weight: a 0) where the window at (y', x') does not reach (y, x);
    * ``taken`` (O*C*9, s*s): the flat indices into the dense matrix where each weight sits
      (every output cell of an unpadded convolution sees the whole window, so each weight sits
      at s*s places), in ascending order."""
    c_in, c_out, s = conv.in_channels, conv.out_channels, side - 2
    c, y, x, o, y2, x2 = torch.meshgrid(*(torch.arange(n) for n in (c_in, side, side,
                                                                   c_out, s, s)), indexing="ij")
    dy, dx = y - y2, x - x2
    reached = (dy >= 0) & (dy < 3) & (dx >= 0) & (dx < 3)
    flat = ((o * c_in + c) * 3 + dy.clamp(0, 2)) * 3 + dx.clamp(0, 2)
    place = torch.where(reached, flat, conv.weight.numel()).reshape(c_in * side * side, -1)
    order = torch.sort(place.flatten(), stable=True)
    taken = order.indices[:conv.weight.numel() * s * s].view(conv.weight.numel(), s * s)
    return place, taken


class Placed(torch.autograd.Function):
    """``weight``'s entries laid out by a table of places: the result's entry i is
    ``weight.flatten()[place.flatten()[i]]``, 0 where it points one past the weight, and the
    gradient of weight entry j is the sum of the result's gradient over its places,
    ``taken[j]`` (:func:`places`). Forward and backward are a gather each: autograd's own
    backward of a gather is a scatter-add, several times slower on a CPU."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, place: torch.Tensor, taken: torch.Tensor
                ) -> torch.Tensor:
        ctx.save_for_backward(taken)
        ctx.weight_shape = weight.shape
        padded = F.pad(weight.reshape(-1), (0, 1))
        return padded.index_select(0, place.reshape(-1)).view(place.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (taken,) = ctx.saved_tensors
        summed = grad.reshape(-1).index_select(0, taken.reshape(-1)).view(taken.shape).sum(-1)
        return summed.view(ctx.weight_shape), None, None


class ConvBody(nn.Sequential):
    """conv(3->16, 3x3) -> ReLU -> conv(16->32, 3x3) -> ReLU -> flatten -> linear(128) -> ReLU,
    with its convolutions computed one of two ways (``conv_math``, the same parameters and
    the same function within float rounding):

    * ``"conv2d"``: ``nn.Conv2d``, the library's convolution kernels (cuDNN, oneDNN);
    * ``"matmul"``: each convolution as one matrix product, ``x.flatten(1) @ D`` with ``D``
      its weight laid out densely, (C*H*W, O*H'*W'): entry (input cell, output cell) is the
      weight that joins them, 0 where the 3x3 window does not reach. ``D`` is gathered from
      the weight through a fixed table of places (:class:`Placed`), and its gradient gathered
      back the same way, so it stays differentiable in the weight. At view 7 it does 5.4x
      (first conv) and 2.8x (second) the convolutions' multiply-adds, the extra ones by
      zeros, but as one wide matmul: where the
      narrow channel counts (3, 16, 32) leave a conv kernel's matmul units idle, as with
      oneDNN's bf16 convolutions on a CPU with AMX, it can still be faster. Which is faster is
      measured, never assumed: ``python -m labkit bench-update`` times both, and stage 7
      times both at warmup (``labkit.executors.choose_conv_math``); every other stage runs
      "conv2d" unless a run forces "matmul" (``RunConfig.conv_math``). The dense matrices grow
      as the view's fourth power: :attr:`matmul_fits` says whether they are small enough for
      a stage to consider them.

    On CUDA, cuDNN runs float32 convolutions as TF32 by default where the GPU has it, and the
    matmuls stay full float32 (``labkit.device``), so there the two differ by TF32's rounding.
    """

    #: The most elements the place tables and dense matrices of :attr:`conv_math` "matmul"
    #: may hold for a stage to time it (4M: views up to 9; view 7's hold 400k).
    MATMUL_MAX_ELEMENTS = 4 * 2**20

    def __init__(self, view: int = 7, conv_math: str = "conv2d") -> None:
        super().__init__(
            layer_init(nn.Conv2d(N_CHANNELS, 16, 3)), nn.ReLU(),
            layer_init(nn.Conv2d(16, 32, 3)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(32 * (view - 4) ** 2, HIDDEN)), nn.ReLU(),
        )
        self.view = check_view(view)
        self.conv_math = conv_math

    def __getitem__(self, idx):  # a slice is a plain Sequential of those layers
        return nn.Sequential(*list(self._modules.values())[idx]) if isinstance(idx, slice) \
            else super().__getitem__(idx)

    def _convs(self) -> tuple[tuple[nn.Conv2d, int], tuple[nn.Conv2d, int]]:
        """Each convolution with the side of its input."""
        return (self[0], self.view), (self[2], self.view - 2)

    @property
    def matmul_fits(self) -> bool:
        """Whether the place tables and dense matrices of "matmul" hold at most
        :attr:`MATMUL_MAX_ELEMENTS`: per convolution, the dense matrix and its table of places
        (C*H*W x O*H'*W' each) and the table of each weight's places (weights x H'*W')."""
        return sum(2 * conv.in_channels * side**2 * conv.out_channels * (side - 2) ** 2
                   + conv.weight.numel() * (side - 2) ** 2
                   for conv, side in self._convs()) <= self.MATMUL_MAX_ELEMENTS

    @property
    def conv_math(self) -> str:
        return self._conv_math

    @conv_math.setter
    def conv_math(self, value: str) -> None:
        """Set it after ``.to(device)`` or before. The first "matmul" makes each
        convolution's place tables (:func:`places`), kept as buffers that move with the module
        but are not saved (a state dict is the same either way); switching back and forth
        after that makes nothing."""
        if value not in CONV_MATHS:
            raise ValueError(f"conv_math must be one of {', '.join(CONV_MATHS)}; got {value!r}")
        self._conv_math = value
        if value == "matmul" and not hasattr(self, "_place1"):
            for i, (conv, side) in enumerate(self._convs(), 1):
                place, taken = places(conv, side)
                for name, table in ((f"_place{i}", place), (f"_taken{i}", taken)):
                    self.register_buffer(name, table.to(conv.weight.device), persistent=False)

    def dense(self, i: int) -> torch.Tensor:
        """Convolution ``i``'s (1 or 2) weight as the (C*H*W, O*H'*W') matrix of
        :attr:`conv_math` "matmul"."""
        conv, _ = self._convs()[i - 1]
        return Placed.apply(conv.weight, getattr(self, f"_place{i}"),
                            getattr(self, f"_taken{i}"))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """obs (B, 3, V, V) float -> features (B, 128)."""
        if self._conv_math == "conv2d":
            return super().forward(obs)
        x = obs.flatten(1)
        for i, (conv, side) in enumerate(self._convs(), 1):
            bias = conv.bias.view(-1, 1).expand(-1, (side - 2) ** 2).flatten()
            x = F.relu(torch.addmm(bias, x, self.dense(i)))
        return F.relu(self[5](x))


class Agent(nn.Module):
    """conv(3->16, 3x3) -> ReLU -> conv(16->32, 3x3) -> ReLU -> flatten -> linear(128) -> ReLU
    (:class:`ConvBody`, its convolutions run as ``conv_math`` says; ``body="attention"``:
    :class:`AttentionBody`) -> policy logits (5) and a value head ("plain" or "popart")."""

    def __init__(self, view: int = 7, value_head: str = "plain", body: str = "conv",
                 conv_math: str = "conv2d") -> None:
        super().__init__()
        check_view(view)
        if value_head not in VALUE_HEADS:
            raise ValueError(f"value_head must be one of {VALUE_HEADS}, got {value_head!r}")
        if check_body(body) == "attention" and conv_math != "conv2d":
            raise ValueError(f"conv_math applies to the conv body; body is {body!r}")
        self.view = view
        self.body = AttentionBody(view) if body == "attention" else ConvBody(view, conv_math)
        self.actor = layer_init(nn.Linear(HIDDEN, N_ACTIONS), std=0.01)
        self.value_head = ValueHead(HIDDEN) if value_head == "plain" else PopArtValueHead(HIDDEN)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs (B, 3, V, V) -> (logits (B, 5), training-space value (B,))."""
        h = self.body(obs.float())
        return self.actor(h), self.value_head(h)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        """Value in return space (for bootstrapping GAE)."""
        return self.value_head.denormalize(self.value_head(self.body(obs.float())))

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprob of ``action``, entropy, training-space value), all (B,), with gradients."""
        logits, value = self(obs)
        logp = logits.float().log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action.long()[:, None]).squeeze(-1), entropy, value


@torch.no_grad()
def sample_action(net: nn.Module, obs: torch.Tensor, generator: torch.Generator | None = None,
                  noise: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(action int64 (B,), logprob (B,), value (B,)) from ``net``: an :class:`Agent`, or
    ``torch.compile(agent)``, which shares its parameters.

    The value is in return space (what GAE needs). Sampling is a Gumbel-max,
    argmax(logp - log E) with E ~ Exp(1): exact categorical sampling from elementwise ops and
    an argmax on the device, no host read. A default ``Categorical(logits=...)`` reads the
    device in its argument validation (at construction and in ``log_prob``: a sync each on a
    GPU), until the process's first ``torch.compile``, which turns that validation off for
    every distribution (dynamo's ``TorchPatcher.patch``); ``torch.multinomial`` itself checks
    its input with device-side asserts since torch 2.6 (no host read). ``generator`` must live
    on the same device as ``obs``; it stays outside any compiled region (dynamo does not trace
    generators): a compiled rollout step is handed ``noise`` instead, E drawn before it from
    the same generator (the same numbers: one draw of the same shape).
    """
    debug.check(observations=obs)
    logits, value = net(obs)
    debug.check(logits=logits, values=value)
    logp = logits.float().log_softmax(-1)
    if noise is None:
        noise = torch.empty_like(logp).exponential_(generator=generator)
    action = (logp - noise.log()).argmax(-1)
    return action, logp.gather(-1, action[:, None]).squeeze(-1), \
        net.value_head.denormalize(value)
