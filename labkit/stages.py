"""The ladder: each stage is a named composition of components, one lesson away from the last.

A ``Stage`` only says which component fills each slot:

====================  ======================================================================
slot                  what it decides
====================  ======================================================================
``env``               the Forage implementation (Python objects, NumPy, torch loop, torch)
``model``             the agent network (``Agent``: conv-conv-linear, policy and value heads)
``collector``         how one env step with the policy is done and stored
``logger``            how the per-step log record leaves the hot path
``metrics``           where episode statistics are aggregated
``optimizer``         which Adam, and its grad clip
``precision``         fp32, or mixed precision where the device has it
``rollout_executor``  how the policy and each rollout step execute (eager/compiled/graphed)
``update_executor``   how the loss and each minibatch step execute (eager/compiled/graphed)
====================  ======================================================================

A stage also names the ``chapter`` (notebook) that teaches it, and :data:`DEFAULT_STAGE` which
stage a run uses when none is named. Nothing outside a component asks which stage it is in; a
component that needs something of the device (CUDA, bf16) says so in ``requires``, and a
stage's ``skip_reason`` is derived from that.
``Stage.check`` is the one refusal path: it raises ``StageSkipped`` for a device the stage cannot
run on or a run that does not fit, and every command, the pipeline and the harness call it.
``Pipeline`` assembles a stage into one training iteration (rollout of T steps x N envs, GAE,
PPO update) and owns its whole state. Every stage runs the same Forage dynamics and PPO math.
"""
from __future__ import annotations

import contextlib
import contextvars
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from .capture import clone_state
from .config import RunConfig, memory_shortfall
from .device import has_bf16, resolve_device
from .distributed import SINGLE, Group
from .envs import ForageNumpy, ForagePyList, ForageTorch, ForageTorchLoop
from .executors import (
    PART_PHASE,
    Compiled,
    CompiledIfFaster,
    Eager,
    Executor,
    Graphed,
    ModelMath,
    compiles,
)
from .logging import AsyncLogger, SyncLogger
from .metrics import DeviceEpisodeStats, EagerEpisodeStats
from .policy import Agent, sample_action
from .ppo import Batch, PPOConfig, annealed_lr, gae
from .precision import Precision, amp, fp32
from .rollout import DeviceCollector, HostBatchedCollector, PerEnvCollector, Rollout
from .timing import PhaseClock
from .update import Adam, FusedAdam, build_update

#: What each name in a component's ``requires`` means, and the skip reason when it is missing.
REQUIREMENTS = {
    "cuda": (lambda device: device.type == "cuda", "needs CUDA"),
    "bf16": (has_bf16, "needs bf16 (the graphed update is built and tested for bf16 autocast; "
                       "fp16 would need its GradScaler captured too)"),
}


_ASSUMED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("assumed",
                                                                           default=())


@contextlib.contextmanager
def assuming(needs: tuple[str, ...]) -> Iterator[None]:
    """Inside, stage checks take ``needs`` (names in :data:`REQUIREMENTS`) as met, in this
    thread or task only: how a capture rehearsal runs a CUDA stage on the CPU. Nothing
    process-wide changes."""
    unknown = set(needs) - set(REQUIREMENTS)
    if unknown:
        raise ValueError(f"needs must be among {', '.join(REQUIREMENTS)}; got {sorted(unknown)}")
    token = _ASSUMED.set(tuple(needs))
    try:
        yield
    finally:
        _ASSUMED.reset(token)


@runtime_checkable
class OptimizerComponent(Protocol):
    """What the optimizer slot's value offers (:class:`labkit.update.Adam`, ``FusedAdam``): it
    builds the optimizer, and owns how its LR is set and read, how its gradients are
    clipped and how a saved state is loaded into it in place, so the loop never asks which
    optimizer it has."""

    @property
    def requires(self) -> tuple[str, ...]: ...

    def __call__(self, *, params: Iterable[torch.Tensor], cfg: PPOConfig,
                 device: torch.device) -> torch.optim.Optimizer: ...

    def clip_grad(self, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor: ...

    def set_lr(self, optimizer: torch.optim.Optimizer, lr: float) -> None: ...

    def lr(self, optimizer: torch.optim.Optimizer) -> float | torch.Tensor: ...

    def load_state_(self, optimizer: torch.optim.Optimizer, state: dict) -> None: ...


@runtime_checkable
class PrecisionComponent(Protocol):
    """What the precision slot's value offers (:class:`labkit.precision.Fp32`, ``Amp``,
    ``Bf16``): built on a device, the :class:`labkit.precision.Precision` the update calls."""

    @property
    def requires(self) -> tuple[str, ...]: ...

    def __call__(self, device: torch.device) -> Precision: ...


@dataclass(frozen=True)
class Stage:
    """One rung of the ladder: which component fills each slot, and the ``chapter`` (the
    notebook in ``notebooks/``) that teaches it. The pipeline builds each slot with keywords,
    the slot's whole interface:

    * ``env(n_envs=, spec=, seed=, device=, env_offset=)``,
      ``model(view=, value_head=)`` (and ``body=`` where the run's model is not "conv"),
      ``collector(env=, n_steps=, act=, metrics=, device=, clock=)`` (its ``accepts`` names
      the envs it can step), ``logger(target=)``, ``metrics(device=)``: classes;
    * ``optimizer``: an :class:`OptimizerComponent`, ``optimizer(params=, cfg=, device=)``,
      which also owns ``set_lr``, ``lr``, ``clip_grad`` and ``load_state_``;
    * ``precision``: a :class:`PrecisionComponent`, ``precision(device=)`` -> a
      :class:`labkit.precision.Precision`;
    * ``rollout_executor`` and ``update_executor``: each an
      :class:`labkit.executors.Executor` (``wrap_model``, ``wrap_step``).

    What a component ``requires`` of the device becomes the stage's skip reason."""

    index: int
    name: str
    lesson: str
    chapter: str
    env: type = ForagePyList
    model: type = Agent
    collector: type = PerEnvCollector
    logger: type = SyncLogger
    metrics: type = EagerEpisodeStats
    optimizer: OptimizerComponent = Adam()
    precision: PrecisionComponent = fp32
    rollout_executor: Executor = Eager()
    update_executor: Executor = Eager()

    #: The fields that say what the stage is, not what fills a slot.
    LABELS: ClassVar[tuple[str, ...]] = ("index", "name", "lesson", "chapter")

    def components(self) -> dict[str, Any]:
        """The slots and what fills them."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in self.LABELS}

    def skip_reason(self, device: torch.device, assume: tuple[str, ...] | None = None
                    ) -> str | None:
        """Why this stage cannot run on ``device`` (None if it can), from its components: what
        each one ``requires`` of the device, and whether its collector ``accepts`` its env.
        ``assume`` names requirements taken as met; None: those of the :func:`assuming`
        block the caller is in (a capture rehearsal on the CPU stands in for CUDA and bf16)."""
        assume = _ASSUMED.get() if assume is None else assume
        if not issubclass(self.env, self.collector.accepts):
            return (f"{self.collector.__name__} cannot step {self.env.__name__} (it accepts "
                    f"{', '.join(c.__name__ for c in self.collector.accepts)})")
        for part in self.components().values():
            for need in getattr(part, "requires", ()):
                if need in assume:
                    continue
                available, reason = REQUIREMENTS[need]
                if not available(device):
                    return reason
        return None

    def check(self, device: torch.device, run: RunConfig | None = None,
              assume: tuple[str, ...] | None = None) -> None:
        """Raise ``StageSkipped`` if this stage cannot run on ``device`` (``skip_reason``, with
        ``assume``) or ``run`` does not fit in its free memory; nothing is allocated either
        way."""
        reason = self.skip_reason(device, assume)
        if reason:
            raise StageSkipped(self.name, device, reason, cause="device")
        reason = memory_shortfall(run, device) if run is not None else None
        if reason:
            raise StageSkipped(self.name, device, reason, cause="memory")

    @property
    def scales(self) -> bool:
        """Worth sweeping over N: its env steps every env in one batch of device ops."""
        return getattr(self.env, "vectorized_on_device", False)

    @property
    def one_env_at_a_time(self) -> bool:
        """Its env steps one env at a time in a Python loop (stages 0 and 2): an iteration's
        time grows with N x T on the host, whatever the device."""
        return getattr(self.env, "one_env_at_a_time", False)


def _ladder() -> tuple[Stage, ...]:
    s0 = Stage(0, "python_loop", "naive baseline: per-env objects, forwards and .item()",
               chapter="01_the_python_loop")
    s1 = replace(s0, index=1, name="numpy_vec", lesson="vectorize: NumPy envs, one forward",
                 chapter="02_vectorize_with_numpy",
                 env=ForageNumpy, collector=HostBatchedCollector)
    s2 = replace(s1, index=2, name="torch_state", lesson="GPU state alone is not enough",
                 chapter="03_tensors_on_the_device",
                 env=ForageTorchLoop, collector=DeviceCollector)
    s3 = replace(s2, index=3, name="batched_ops", lesson="batch everything: a vectorized step",
                 chapter="04_batch_everything", env=ForageTorch)
    s4 = replace(s3, index=4, name="async_logging", lesson="log off the hot path",
                 chapter="05_log_off_the_hot_path", logger=AsyncLogger)
    s5 = replace(s4, index=5, name="compile_warmup", lesson="compile, and warm up off the clock",
                 chapter="06_compile_and_warm_up",
                 rollout_executor=Compiled(), update_executor=Compiled())
    s6 = replace(s5, index=6, name="gpu_metrics", lesson="aggregate metrics on the device",
                 chapter="07_metrics_on_the_device", metrics=DeviceEpisodeStats)
    s7 = replace(s6, index=7, name="fused_amp", lesson="fused Adam and grad clip, mixed precision",
                 chapter="08_fused_optimizers_and_amp", optimizer=FusedAdam(), precision=amp,
                 rollout_executor=CompiledIfFaster(), update_executor=CompiledIfFaster())
    s8 = replace(s7, index=8, name="cuda_graphs",
                 lesson="replay rollout step and update as CUDA graphs",
                 chapter="09_cuda_graphs",
                 optimizer=FusedAdam(capturable=True),
                 rollout_executor=Graphed(s5.rollout_executor),
                 update_executor=Graphed(s5.update_executor, requires=("cuda", "bf16")))
    return (s0, s1, s2, s3, s4, s5, s6, s7, s8)


STAGES: tuple[Stage, ...] = _ladder()
STAGE_NAMES = tuple(s.name for s in STAGES)
#: The two parts of an iteration whose model math a stage may choose how to run.
PARTS = tuple(PART_PHASE)

#: The stage a run uses when none is named, by device type, from what is recorded in
#: ``results/`` (tests hold this to those files), not measured at start-up.
#: The CPU's is the one that finishes ``train``'s default run soonest, counting what a run
#: spends before its first iteration as well as its rate over ``TrainConfig``'s total steps:
#: in ``results/ladder_cpu_train.json`` (the ladder at ``RunConfig``'s N and T; the set-up is
#: the row's ``warmup_s`` and ``choose_s``, measured in a process that had compiled before) no
#: stage is measurably sooner (ranges that overlap tie) and of the tied it is the fastest that
#: starts without compiling; timed as whole processes (``scripts/train_default_ab.py``:
#: ``results/train_default_cpu.json``, and ``_fresh`` with an empty compile cache) it finished
#: first. Stage 7 runs more steps a second, but compiles and times its choices first, and over
#: the default 500k steps that costs more than its rate saves (the README has the figures).
#: CUDA's is the fastest in ``results/ladder_cuda_full.json`` (an H200), which needs bf16: on a
#: GPU without it the default is :data:`REFERENCE_STAGE`, the last rung that runs on every GPU
#: (:func:`default_stage`).
DEFAULT_STAGE: dict[str, str] = {"cpu": "numpy_vec", "cuda": "cuda_graphs"}


#: The last rung that runs on every device: what the doctor diagnoses when told nothing, and
#: the stage its planted regressions go into.
REFERENCE_STAGE = "fused_amp"


def default_stage(device: torch.device) -> str:
    """The name of the stage a run on ``device`` uses when none is named: :data:`DEFAULT_STAGE`,
    or :data:`REFERENCE_STAGE` where that one cannot run (a GPU without bf16)."""
    name = DEFAULT_STAGE[device.type]
    return REFERENCE_STAGE if get_stage(name).skip_reason(device) else name


def describe_choices() -> str:
    """How a stage may be named, for help texts and errors: "0-8 or a name (python_loop, ...)"."""
    return f"0-{len(STAGES) - 1} or a name ({', '.join(STAGE_NAMES)})"


def get_stage(key: Stage | int | str) -> Stage:
    """A stage by index (int or digit string) or name; a clear error otherwise."""
    if isinstance(key, Stage):
        return key
    if isinstance(key, str) and key.strip().isdecimal():  # not isdigit: '²' is a digit
        key = int(key)
    for s in STAGES:
        if (isinstance(key, int) and not isinstance(key, bool) and key == s.index) \
                or key == s.name:
            return s
    raise ValueError(f"stage must be one of {describe_choices()}; got {key!r}")


@dataclass
class PipelineState:
    """Everything an iteration changes (device-side copies): the one snapshot that warmup, graph
    capture, checkpoints, resume and torchrun use, and the one place its fields are named. A
    checkpoint file stores :meth:`to_dict`."""

    agent: dict
    optimizer: dict
    collector: dict
    metrics: dict
    generator: torch.Tensor
    global_step: int
    iteration: int
    #: The precision's own state (an fp16 GradScaler's scale; empty for fp32 and bf16).
    #: Optional: checkpoints written before it was kept load without it.
    precision: dict = field(default_factory=dict)

    #: What differs between the ranks of a torchrun: their envs, episode stats and sampler.
    PER_RANK: ClassVar[tuple[str, ...]] = ("collector", "metrics", "generator")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def required_keys(cls) -> tuple[str, ...]:
        """The keys every saved state has (the others have defaults)."""
        return tuple(f.name for f in fields(cls)
                     if f.default is MISSING and f.default_factory is MISSING)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.keys()}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> PipelineState:
        missing = [k for k in cls.required_keys() if k not in state]
        if missing:
            raise KeyError(f"the state has no {', '.join(missing)}")
        return cls(**{k: state[k] for k in cls.keys() if k in state})

    def per_rank(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.PER_RANK}


class StageSkipped(ValueError):
    """A stage refused before anything is built, by ``Stage.check``: ``cause`` is "device" (the
    device lacks what a component requires, or the collector cannot step the env) or "memory"
    (the run does not fit); ``reason`` says which in words. A ValueError, so the CLI prints it
    as one line and exits 2. A harness records a "device" refusal as ``skipped: <reason>``; a
    "memory" one is the caller's choice of size, and it stops the run before it starts."""

    def __init__(self, stage: str, device, reason: str, cause: str = "device") -> None:
        super().__init__(f"stage {stage!r} cannot run on {device}: {reason}")
        self.stage, self.device, self.reason, self.cause = stage, str(device), reason, cause

    def __reduce__(self):  # picklable across processes despite the extra arguments
        return type(self), (self.stage, self.device, self.reason, self.cause)


def without_graphs(stage: Stage) -> Stage:
    """``stage`` with each :class:`~labkit.executors.Graphed` executor replaced by its ``base``
    (``stage`` itself if it has none): a CUDA graph replays exactly the ops of the eager step
    it captured, so this runs the same work, with every op, read and tensor visible."""
    swaps = {slot: ex.base for slot, ex in (("rollout_executor", stage.rollout_executor),
                                               ("update_executor", stage.update_executor))
             if isinstance(ex, Graphed)}
    return replace(stage, **swaps) if swaps else stage


def _closed(*args: Any, **kwargs: Any) -> None:
    """What a closed pipeline's steps are."""
    raise ValueError("this Pipeline is closed (close(), or its with block ended): build a new "
                     "one")


class Pipeline:
    """One stage assembled on a device: ``iteration()`` = rollout + GAE + PPO update.

    It owns its state: ``state_dict()`` (device-side copies of model, optimizer, env, collector,
    metrics, sampling generator and counters), ``load_state_dict()`` (in place) and ``rewind()``
    (back to the state it was built with). Under torchrun, ``group`` says which rank this is:
    its envs, its sampling seed, gradients averaged over the ranks, episode statistics summed
    (see labkit.distributed). Building one touches no process-global state: the model is
    initialized from ``cfg.seed`` under a forked RNG, and nothing resets torch.compile's caches
    (compiled code is shared by pipelines of the same shapes: it guards on tensor properties,
    not on which module holds them, and on the conv body's ``conv_math``). ``close()``
    releases the logger, the rollout buffers and any captured graph at once, without waiting
    for the garbage collector.
    ``assume``: requirements taken as met (see :meth:`Stage.skip_reason`).
    """

    def __init__(self, stage: Stage | int | str, cfg: RunConfig | None = None,
                 device: torch.device | str = "auto", *,
                 log_dir: str | Path | None = None, group: Group = SINGLE,
                 assume: tuple[str, ...] | None = None) -> None:
        self.stage = stage = get_stage(stage)
        self.cfg = cfg = cfg if cfg is not None else RunConfig()
        if not isinstance(cfg, RunConfig):
            raise TypeError(f"cfg must be a RunConfig, got {type(cfg).__name__}")
        self.device = device = resolve_device(device)
        stage.check(device, cfg, assume)
        self.ppo = cfg.ppo
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            # body= only for another body than the conv net: a model class of the reader's
            # (or a plant) that takes (view, value_head) keeps working
            body = {"body": cfg.model} if cfg.model != "conv" else {}
            self.agent = stage.model(view=cfg.spec.view, value_head=cfg.value_head,
                                     **body).to(device)
        self.group = group
        self.generator = torch.Generator(device).manual_seed(group.sampling_seed(cfg.seed))
        self.clock = PhaseClock(device)
        self.precision = stage.precision(device=device)
        self.optimizer = stage.optimizer(params=self.agent.parameters(), cfg=cfg.ppo,
                                         device=device)
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="labkit-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.logger = stage.logger(target=self.log_dir / "steps.jsonl")
        self.metrics = stage.metrics(device=device)
        env = stage.env(n_envs=cfg.n_envs, spec=cfg.spec, seed=cfg.seed, device=device,
                        env_offset=group.env_offset(cfg.n_envs))
        fused = cfg.compile_unit == "step" and compiles(stage.rollout_executor)
        rollout_math = self._build_rollout(env, fused)
        self.ppo_update, loss = build_update(
            agent=self.agent, optimizer=self.optimizer,
            clip_grad=group.average_grads(stage.optimizer.clip_grad), precision=self.precision,
            executor=stage.update_executor, cfg=cfg.ppo, generator=self.generator, state=self,
            whole=cfg.capture_unit == "update")
        #: How each part runs its model math and its convolutions, and why (chosen at warm-up,
        #: forced by ``cfg``, or kept from a resumed run).
        self.math = ModelMath(stage, {"rollout": rollout_math, "update": loss}, self.agent,
                              compile=cfg.compile, conv_math=cfg.conv_math, fused=fused)
        self.global_step = 0
        self.iteration_index = 0
        self._initial = self.state_dict()

    def _build_rollout(self, env: Any, fused: bool) -> Any:
        """The policy, the collector and its step as the rollout executor runs them; returns
        the rollout's model math: the policy as the executor wrapped it, or, ``fused``
        (``compile_unit="step"`` in a stage whose rollout compiles), the collector's whole step
        past the sampling noise wrapped instead, the policy eager inside it."""
        stage, executor = self.stage, self.stage.rollout_executor
        if fused and not hasattr(stage.collector, "fuse"):
            raise ValueError(f"compile_unit=step compiles a DeviceCollector's step; stage "
                             f"{stage.name} collects with {stage.collector.__name__}")
        self.policy = self.agent if fused else executor.wrap_model(self.agent)
        self.collector = stage.collector(
            env=env, n_steps=self.cfg.n_steps, metrics=self.metrics, device=self.device,
            clock=self.clock, act=partial(sample_action, self.policy), generator=self.generator,
            obs_dtype=getattr(torch, self.cfg.obs_storage))
        math = self.collector.fuse(executor.wrap_model) if fused else self.policy
        self._step = executor.wrap_step(self.collector.step, state=self, generator=self.generator,
                                        after_replay=partial(self.clock.lap, "graph"))
        return math

    # ------------------------------------------------------------------ the iteration

    def collect(self) -> Rollout:
        """T env steps with the policy; each logs its mean reward (the logger's per-step load)."""
        self.math.convs_for("rollout")
        with torch.no_grad():
            for _ in range(self.cfg.n_steps):
                self._step()
                self.global_step += self.cfg.n_envs
                self.logger.log(self.global_step, reward=self.collector.reward_mean)
                self.clock.lap("io")
        return self.collector.storage

    def rollout(self) -> Batch:
        """Collect T steps and turn them into a flat PPO batch (GAE on the device)."""
        r = self.collect()
        with torch.no_grad():
            next_value = self.agent.get_value(self.collector.next_obs())
            adv, ret = gae(r.rewards, r.values, r.dones, next_value, self.collector.done,
                           self.ppo.gamma, self.ppo.gae_lambda)
        self.clock.lap("gae")
        return Batch.from_rollout(r.obs, r.actions, r.logprobs, adv, ret, r.values)

    def learn(self, batch: Batch) -> dict[str, float | torch.Tensor]:
        """The PPO update on ``batch``, then the iteration's log record and episode stats.

        Update statistics stay device tensors (the logger decides when to read them); the
        episode statistics are the metrics' one read per iteration."""
        if self.ppo.anneal_lr:
            self.stage.optimizer.set_lr(self.optimizer, annealed_lr(
                self.ppo.lr, self.iteration_index, self.cfg.lr_horizon))
        self.math.convs_for("update")
        stats = self.ppo_update(batch)
        self.clock.lap("update")
        self.iteration_index += 1
        self.group.reduce_metrics(self.metrics)
        episodes = self.metrics.summary()
        self.clock.lap("metrics")
        self.logger.log(self.global_step, **stats, **episodes)
        self.clock.lap("io")
        return {**stats, **episodes}

    def iteration(self) -> dict[str, float | torch.Tensor]:
        """One PPO iteration: rollout of T steps x N envs, GAE, update."""
        return self.learn(self.rollout())

    # ------------------------------------------------------------------ state

    def state_dict(self) -> PipelineState:
        """Copies (on the device: no host read) of everything an iteration changes."""
        return clone_state(PipelineState(
            agent=self.agent.state_dict(), optimizer=self.optimizer.state_dict(),
            collector=self.collector.state_dict(), metrics=self.metrics.state_dict(),
            generator=self.generator.get_state(), global_step=self.global_step,
            iteration=self.iteration_index, precision=self.precision.state_dict()))

    @torch.no_grad()
    def load_state_dict(self, state: PipelineState) -> None:
        """Load ``state`` (from ``state_dict``, possibly via a checkpoint on the CPU) in place."""
        if not isinstance(state, PipelineState):
            raise TypeError(f"state must be a PipelineState (Pipeline.state_dict(), or "
                            f"PipelineState.from_dict of a checkpoint's 'state'), got "
                            f"{type(state).__name__}")
        self.agent.load_state_dict(state.agent)
        self.stage.optimizer.load_state_(self.optimizer, state.optimizer)
        self.collector.load_state_dict(state.collector)
        self.metrics.load_state_dict(state.metrics)
        self.generator.set_state(state.generator)
        self.precision.load_state_dict(state.precision)
        self.global_step = int(state.global_step)
        self.iteration_index = int(state.iteration)

    def rewind(self) -> None:
        """Back to the state this pipeline was built with, in place (a ``reset`` is the envs':
        new episodes)."""
        self.load_state_dict(self._initial)

    def close(self) -> None:
        try:
            self.logger.close()
        finally:
            # The step executors hold this pipeline (a graph capture restores its state): drop
            # them so the buffers and graph pools go now, not at a later garbage collection.
            self._step = self.ppo_update = _closed
            if getattr(self, "_tmp", None) is not None:
                self._tmp.cleanup()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
