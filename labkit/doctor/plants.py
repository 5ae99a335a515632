"""Planted regressions: real bugs from the field reports, each a small variant of one component.

Every plant fills one slot of a stage with a variant of the component that is already there
(``dataclasses.replace``); the clean components are never touched. The variants are written
the way the bug looked in the report that found it, so chapter 10 can hunt them with
``labkit doctor`` the way those reports hunted theirs with profiles:

=====================  =========  ========================================================
plant                  slot       the bug, and the report that found it
=====================  =========  ========================================================
``item_in_logging``    logger     ``.item()`` on each value before logging (journey report)
``unfused_adam``       optimizer  per-parameter Adam, not fused (journey and GRPO reports)
``nan_checks``         collector  unconditional ``isnan(x).any()`` checks (trace report)
``per_item_loop``      metrics    a Python loop with ``.item()`` per element (trainer2 report)
``cpu_tensor``         metrics    ``torch.zeros(n)`` without ``device=`` in the loop (GRPO)
``unbounded_buffer``   metrics    a history that is appended to and never cleared (trace)
``clone_overuse``      env        defensive ``.clone()`` of every tensor (GRPO report)
``duplicate_forward``  model      the same body computed twice per call (trainer2 report)
``branchy_value_head`` model      a branch on the PopArt flag in the value path (journey)
``amp_off``            precision  mixed precision switched off (journey report; CUDA only)
=====================  =========  ========================================================

The reports: the "journey" report (a Python loop taken to 29,000 steps/s, and its regression
hunt), the "trace" report (a PyTorch trace analysis: NaN checks, memory growth), the
"trainer2" report (a trainer's sync-elimination summary), the "GRPO" report (a CPU-allocated
tensor, clone overuse, fused AdamW).

``plant(stage, name)`` returns the variant stage; a plant whose slot holds a component it is
not a variant of (the metrics plants need the device metrics of stage 6+, say) is refused with
a ``ValueError``. ``nan_observation(stage, step)`` plants a bug of another kind: a NaN in the
observations from a given step on, for ``labkit.debug`` to find.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..envs import ForageTorch
from ..logging import AsyncLogger
from ..measure.syncmeter import short_path
from ..metrics import DeviceEpisodeStats
from ..policy import HIDDEN, Agent, PopArtValueHead
from ..precision import Amp, Precision
from ..rollout import DeviceCollector
from ..stages import REFERENCE_STAGE, Stage, get_stage
from ..update import Adam

# ---------------------------------------------------------------------------- logger


class ItemLogger(AsyncLogger):
    """The async logger, with one "harmless" line added: each tensor is turned into a Python
    number before it is queued. That ``.item()`` runs in the training loop, once per step for
    the reward and once per update statistic: the device reads (a sync each on a GPU) that the
    async logger exists to move off the hot path come back. The journey report found exactly
    this in its logging: an ``.item()`` on the step's mean reward inside the log call, a full
    GPU sync per step."""

    def log(self, step: int, **values: Any) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.ndim == 0:
                values[key] = value.item()  # the planted line: a host read per value
        super().log(step, **values)


# ---------------------------------------------------------------------------- optimizer


@dataclass(frozen=True, repr=False)
class UnfusedAdam(Adam):
    """Adam without ``fused=True``: labkit's own :class:`labkit.update.Adam` of stages 0-6,
    back in the final stage (the plant changes no line of it). It is ``foreach=False``: it
    steps one parameter at a time, so on a GPU each step launches its handful of kernels once
    per parameter, where fused Adam launches a couple for all of them; its float LR and
    ``clip_grad_norm_`` come back too. It also reads each parameter's step counter with
    ``.item()`` every step, but torch keeps those counters on the CPU on every device: a
    host-scalar read costs Python time and never waits for the GPU. The journey report called
    its non-fused Adam's ``.item()`` calls "384 CPU round-trips per update"; a read of a CPU
    counter makes no round trip to the GPU: what ``fused=True`` removes on a GPU is launches,
    and the Python time of those reads. The GRPO report switched to fused AdamW."""


# ---------------------------------------------------------------------------- collector


class NanCheckingCollector(DeviceCollector):
    """The device collector, validating every tensor of every step unconditionally: an
    ``isnan`` kernel and an ``.any()`` read on the host per check. The trace report found
    50+ such checks per forward in its model, running whether or not debugging was wanted,
    at about 73 ms per validation cycle. (They sit around the policy here, not in it: a
    compiled network cannot hold a data-dependent ``if`` at all.) The fix is a debug switch:
    ``labkit.debug``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        act = self.act

        def checked_act(obs: torch.Tensor, **kwargs: Any
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            self._check("observations", obs)
            action, logprob, value = act(obs, **kwargs)
            self._check("logprobs", logprob)
            self._check("values", value)
            return action, logprob, value

        self.act = checked_act

    @staticmethod
    def _check(name: str, x: torch.Tensor) -> None:
        if torch.isnan(x).any():  # the planted line: a kernel and a host read, every call
            raise ValueError(f"NaN in {name}")

    def _finish_step(self, reward: torch.Tensor, done: torch.Tensor) -> None:
        self._check("rewards", reward)
        super()._finish_step(reward, done)


# ---------------------------------------------------------------------------- metrics


class ItemLoopEpisodeStats(DeviceEpisodeStats):
    """The device metrics with their masked reductions replaced by a loop over the envs: a
    host read per env per step (``if done[i]``) and two per finished episode. The trainer2
    report's rotor update read indices and values element by element in nested loops, and
    the GRPO report's spawning code read each index of a loop the same way. Same statistics,
    N or more reads per step."""

    def update(self, done: torch.Tensor, episode_return: torch.Tensor,
               episode_length: torch.Tensor) -> None:
        for i in range(done.shape[0]):
            if done[i]:  # the planted loop: a host read per env
                r = episode_return[i].item()
                n = episode_length[i].item()
                self._sums += torch.tensor([1.0, r, r * r, n], dtype=torch.float64,
                                           device=self.device)
                self._min.clamp_(max=r)
                self._max.clamp_(min=r)


class CpuBufferEpisodeStats(DeviceEpisodeStats):
    """The device metrics, gathering each step's four sums in a fresh buffer made without
    ``device=``. On a GPU run the buffer is a CPU tensor: every element written into it is a
    device-to-host copy, and the sums go back host-to-device. The GRPO report's loss buffer,
    made in the loop without a device, cost it 200 GPU-CPU transfers per epoch."""

    def update(self, done: torch.Tensor, episode_return: torch.Tensor,
               episode_length: torch.Tensor) -> None:
        ret = torch.where(done, episode_return.to(torch.float64), 0.0)
        length = torch.where(done, episode_length.to(torch.float64), 0.0)
        sums = torch.zeros(4, dtype=torch.float64)  # the planted line: no device=
        sums[0] = done.sum()
        sums[1] = ret.sum()
        sums[2] = ret.square().sum()
        sums[3] = length.sum()
        self._sums.add_(sums.to(self.device))
        torch.minimum(self._min, torch.where(done, ret, torch.inf).amin(), out=self._min)
        torch.maximum(self._max, torch.where(done, ret, -torch.inf).amax(), out=self._max)


class HistoryEpisodeStats(DeviceEpisodeStats):
    """The device metrics, also keeping every step's returns and lengths "for later analysis"
    in a list that nothing ever clears: memory grows by T tensors per iteration, forever. The
    trace report's run grew by 4.3 GB of CPU memory; it listed callback data accumulating as
    one possible cause among several and said the source still had to be found. A list like
    this one is that kind of source, and counting what each component holds finds it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.history: list[torch.Tensor] = []

    def update(self, done: torch.Tensor, episode_return: torch.Tensor,
               episode_length: torch.Tensor) -> None:
        super().update(done, episode_return, episode_length)
        self.history.append(torch.stack((episode_return, episode_length.float())))  # planted


# ---------------------------------------------------------------------------- env


class CloningForage(ForageTorch):
    """The vectorized env, copying everything it takes and returns "to be safe": seven
    ``.clone()`` per step that nothing needs (the state is updated in place anyway). The GRPO
    report found the same habit in its env (a clone of the input state, then a clone of a
    slice of that clone): allocations and memory traffic for nothing."""

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, dict]:
        obs, reward, terminated, truncated, info = super().step(actions.clone())  # planted
        info = {key: value.clone() for key, value in info.items()}  # planted
        return obs.clone(), reward.clone(), terminated.clone(), truncated.clone(), info  # planted


# ---------------------------------------------------------------------------- model


class TwiceAgent(Agent):
    """The reference agent, with each head running the shared body itself: the convolutions
    and the hidden layer computed twice per forward, in the rollout and in the update. The
    trainer2 report found one of its helpers called twice per step with identical inputs,
    the same matmul computed twice."""

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.actor(self.body(obs.float()))
        value = self.value_head(self.body(obs.float()))  # planted: the same body again
        return logits, value


class BranchyValueHead(PopArtValueHead):
    """One value head for both cases, chosen in the hot path: normalize once there are
    statistics. The journey report's inner loop branched on a Python flag (whether PopArt was
    on) and the report measured 1.5x. A branch on a Python flag is no graph break: dynamo
    guards the flag and specialises the graph to its value (a recompile, at most, when the
    value changes), so the compiler never handles both paths in one graph. This plant is a
    different, stronger case: it branches on a tensor (PopArt's update count), so eagerly it is
    a device read per call, and compiled it is a graph break and a host read; with
    ``fullgraph=True``, as labkit compiles, an error instead of a silent fallback to eager.
    The fix is labkit's: one interface (``get_training_value``, ``prepare_targets``,
    ``denormalize``) that each head implements without asking which head it is."""

    def __init__(self, in_features: int = HIDDEN, use_popart: bool = True) -> None:
        super().__init__(in_features)
        self.use_popart = use_popart

    def denormalize(self, v: torch.Tensor) -> torch.Tensor:
        if self.use_popart and self.count > 0:  # planted: a branch on a tensor
            return super().denormalize(v)
        return v

    def prepare_targets(self, returns: torch.Tensor) -> torch.Tensor:
        if self.use_popart and self.count > 0:  # planted: a branch on a tensor
            return super().prepare_targets(returns)
        return returns


class BranchyAgent(Agent):
    """The reference agent with PopArt switched on through :class:`BranchyValueHead` (the
    report's setting), whatever ``value_head`` says; same initial weights."""

    def __init__(self, view: int = 7, value_head: str = "plain", body: str = "conv") -> None:
        super().__init__(view, value_head, body)
        head = BranchyValueHead(HIDDEN)
        head.linear.load_state_dict(self.value_head.linear.state_dict())
        self.value_head = head


# ---------------------------------------------------------------------------- precision


@dataclass(frozen=True, repr=False)
class AmpOff(Amp):
    """Mixed precision switched off: fp32 on a GPU that has bf16. In the journey report
    someone turned AMP off to dodge the GradScaler's sync, and the update ran 2x slower: fp32
    moves twice the bytes of fp16. (On a CPU without bf16 instructions labkit's ``amp`` is fp32
    anyway; the plant keeps to CUDA, where the report measured it, so that what the doctor
    finds does not depend on which CPU runs it.)"""

    requires: tuple[str, ...] = ("cuda",)

    def __call__(self, device: torch.device) -> Precision:
        return Precision("fp32", device.type)  # planted: no autocast


# ---------------------------------------------------------------------------- the list


@dataclass(frozen=True)
class Plant:
    """A planted regression: the slot it fills, the variant (``part``), the component it
    varies, what ``labkit doctor`` should report (the notebook and the tests check that it
    does; the doctor never reads it), the report it comes from, and the class or function
    holding the bug (``bug``, when it is not the part itself)."""

    name: str
    slot: str
    part: Any
    varies: type
    finds: str
    report: str
    bug: Any = None

    @property
    def source(self) -> Any:
        """The class or function whose code holds the bug."""
        if self.bug is not None:
            return self.bug
        return self.part if inspect.isclass(self.part) or inspect.isroutine(self.part) \
            else type(self.part)

    @property
    def story(self) -> str:
        """The bug and the report that found it: the docstring of :attr:`source`, one line."""
        return " ".join((self.source.__doc__ or "").split())

    def lines(self) -> list[tuple[str, str]]:
        """(``file:N``, text) of the lines marked ``planted``: the bug itself (the file as a
        call site names it: ``labkit/doctor/plants.py``)."""
        lines, first = inspect.getsourcelines(self.source)
        path = short_path(inspect.getsourcefile(self.source))
        return [(f"{path}:{first + i}", text.strip())
                for i, text in enumerate(lines) if "# planted" in text or "# the planted" in text]


PLANTS: dict[str, Plant] = {p.name: p for p in (
    Plant("item_in_logging", "logger", ItemLogger, AsyncLogger, "device_read", "journey"),
    Plant("unfused_adam", "optimizer", UnfusedAdam(), Adam, "excess_ops", "journey, GRPO"),
    Plant("nan_checks", "collector", NanCheckingCollector, DeviceCollector, "device_read",
          "trace"),
    Plant("per_item_loop", "metrics", ItemLoopEpisodeStats, DeviceEpisodeStats, "device_read",
          "trainer2, GRPO"),
    Plant("cpu_tensor", "metrics", CpuBufferEpisodeStats, DeviceEpisodeStats,
          "no_device", "GRPO"),
    Plant("unbounded_buffer", "metrics", HistoryEpisodeStats, DeviceEpisodeStats,
          "memory_growth", "trace"),
    Plant("clone_overuse", "env", CloningForage, ForageTorch, "excess_ops", "GRPO"),
    Plant("duplicate_forward", "model", TwiceAgent, Agent, "excess_ops", "trainer2"),
    Plant("branchy_value_head", "model", BranchyAgent, Agent, "graph_break", "journey",
          bug=BranchyValueHead),
    Plant("amp_off", "precision", AmpOff(), Amp, "precision", "journey"),
)}
PLANT_NAMES = tuple(PLANTS)


def _holds(current: Any, base: type) -> bool:
    if isinstance(base, type) and isinstance(current, type):
        return issubclass(current, base)
    return isinstance(current, base)


def plant(stage: Stage | int | str, name: str) -> Stage:
    """``stage`` with the plant ``name`` in its slot (and ``+name`` in its name)."""
    stage = get_stage(stage)
    if name not in PLANTS:
        raise ValueError(f"plant must be one of {', '.join(PLANT_NAMES)}; got {name!r}")
    p = PLANTS[name]
    current = getattr(stage, p.slot)
    if not _holds(current, p.varies):
        have = getattr(current, "__name__", None) or type(current).__name__
        raise ValueError(f"plant {name!r} is a variant of {p.varies.__name__}, but stage "
                         f"{stage.name}'s {p.slot} is {have}; plant it in {REFERENCE_STAGE}")
    return replace(stage, name=f"{stage.name}+{name}", **{p.slot: p.part})


class NanForage(ForageTorch):
    """ForageTorch whose observation for env 0 holds a NaN from step ``nan_step`` on (steps
    counted from 0 since the env was built; step 0 is the first observation after a reset):
    a bug to find with ``labkit.debug``, not a slowdown."""

    nan_step = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_taken = 0

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, dict]:
        obs, *rest = super().step(actions)
        self.steps_taken += 1
        if self.steps_taken >= self.nan_step:
            obs = obs.clone()
            obs[0, 0, 0, 0] = float("nan")
        return (obs, *rest)


def nan_observation(stage: Stage | int | str, step: int) -> Stage:
    """``stage`` (with a device env) whose env 0 observes a NaN from step ``step`` (>= 1) on."""
    stage = get_stage(stage)
    if not _holds(stage.env, ForageTorch):
        raise ValueError(f"nan_observation needs a ForageTorch env; {stage.name} has "
                         f"{stage.env.__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    env = type(f"NanForageAt{step}", (NanForage,), {"nan_step": step})
    return replace(stage, name=f"{stage.name}+nan_at_{step}", env=env)
