"""The ladder: each stage is a named composition of components, one lesson away from the last.

A ``Stage`` only names parts (collector, env, logger, metrics, compile, fused optimizer + AMP,
CUDA graphs); ``Pipeline`` assembles them into one training iteration (rollout of T steps x N
envs, GAE, PPO update). Every stage runs the same Forage dynamics and the same PPO math.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import RunConfig
from .envs import ForageTorch, ForageTorchLoop
from .graphs import GraphedCollector
from .logging import AsyncLogger, SyncLogger
from .metrics import DeviceEpisodeStats, EagerEpisodeStats
from .policy import Agent
from .ppo import Batch, PPOConfig, anneal_lr, gae, make_optimizer
from .rollout import DeviceCollector, HostBatchedCollector, PerEnvCollector
from .update import make_updater


@dataclass(frozen=True)
class Stage:
    """One rung of the ladder: which component fills each slot."""

    index: int
    name: str
    lesson: str
    collector: type = PerEnvCollector
    env: type | None = None
    logger: type = SyncLogger
    metrics: type = EagerEpisodeStats
    compile: bool = False
    fused_amp: bool = False
    graphs: bool = False

    def skip_reason(self, device: torch.device) -> str | None:
        """Why this stage cannot run on ``device`` (None if it can)."""
        if self.graphs and device.type != "cuda":
            return "needs CUDA"
        if self.graphs and not torch.cuda.is_bf16_supported():
            return "needs bf16 (fp16's GradScaler reads the host, which graphs cannot capture)"
        return None


def _ladder() -> tuple[Stage, ...]:
    s0 = Stage(0, "python_loop", "naive baseline: per-env objects, forwards and .item()")
    s1 = replace(s0, index=1, name="numpy_vec", lesson="vectorize: NumPy envs, one forward",
                 collector=HostBatchedCollector)
    s2 = replace(s1, index=2, name="torch_state", lesson="GPU state alone is not enough",
                 collector=DeviceCollector, env=ForageTorchLoop)
    s3 = replace(s2, index=3, name="batched_ops", lesson="batch everything: a vectorized step",
                 env=ForageTorch)
    s4 = replace(s3, index=4, name="async_logging", lesson="log off the hot path",
                 logger=AsyncLogger)
    s5 = replace(s4, index=5, name="compile_warmup", lesson="compile, and warm up off the clock",
                 compile=True)
    s6 = replace(s5, index=6, name="gpu_metrics", lesson="aggregate metrics on the device",
                 metrics=DeviceEpisodeStats)
    s7 = replace(s6, index=7, name="fused_amp",
                 lesson="fused Adam, AMP, fused grad clip, branch-free value head",
                 fused_amp=True)
    s8 = replace(s7, index=8, name="cuda_graphs", lesson="replay rollout step and update as "
                 "CUDA graphs", collector=GraphedCollector, graphs=True)
    return (s0, s1, s2, s3, s4, s5, s6, s7, s8)


STAGES: tuple[Stage, ...] = _ladder()
STAGE_NAMES = tuple(s.name for s in STAGES)


def get_stage(key: int | str) -> Stage:
    """A stage by index or name; a clear error otherwise."""
    for s in STAGES:
        if key == s.index or key == s.name or (isinstance(key, str) and key == str(s.index)):
            return s
    raise ValueError(f"stage must be one of 0-{len(STAGES) - 1} or {', '.join(STAGE_NAMES)}; "
                     f"got {key!r}")


def precision_for(stage: Stage, device: torch.device) -> str:
    """bf16 autocast where the GPU supports it, fp16 (+ GradScaler) on older GPUs, fp32 on the
    CPU: autocast there runs bf16 matmuls without AMX and does not pay for this small model."""
    if not stage.fused_amp or device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


class StageSkipped(RuntimeError):
    """Raised when a stage cannot run on the requested device."""


class Pipeline:
    """One stage assembled on a device: ``iteration()`` = rollout + GAE + PPO update."""

    def __init__(self, stage: Stage, cfg: RunConfig, device: torch.device,
                 ppo: PPOConfig | None = None, log_dir: str | Path | None = None,
                 value_head: str = "plain", n_iterations: int | None = None) -> None:
        reason = stage.skip_reason(device)
        if reason:
            raise StageSkipped(f"{stage.name}: {reason}")
        self.stage, self.cfg, self.device = stage, cfg, device
        self.ppo = ppo if ppo is not None else PPOConfig()
        self.ppo.check_batch(cfg.n_envs, cfg.n_steps)
        self.n_iterations = n_iterations or cfg.iterations + 1
        self.precision = precision_for(stage, device)
        torch.manual_seed(cfg.seed)
        self.agent = Agent(cfg.spec.view, value_head).to(device)
        self.optimizer = make_optimizer(self.agent, self.ppo, fused=stage.fused_amp,
                                        capturable=stage.graphs)
        self.generator = torch.Generator(device).manual_seed(cfg.seed)
        if stage.compile:
            # Fresh dynamo caches per pipeline: guards on the previous pipeline's modules would
            # otherwise pile up recompiles until dynamo silently falls back to eager.
            torch._dynamo.reset()
            self.agent.compile()
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="labkit-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.logger = stage.logger(self.log_dir / "steps.jsonl")
        self.metrics = stage.metrics(device) if stage.metrics is DeviceEpisodeStats \
            else stage.metrics()
        extra = {"env_cls": stage.env} if stage.env is not None else {}
        if stage.graphs:
            extra["generator"] = self.generator
        self.collector = stage.collector(cfg.n_envs, cfg.n_steps, cfg.spec, cfg.seed, device,
                                         self.act, self.logger, self.metrics, **extra)
        self.update = make_updater(stage, self.agent, self.optimizer, self.ppo, self.precision,
                                   self.generator)
        self.iteration_index = 0

    def act(self, obs: torch.Tensor):
        return self.agent.act(obs, generator=self.generator)

    def rollout(self) -> Batch:
        """Collect T steps and turn them into a flat PPO batch (GAE on the device)."""
        r = self.collector.collect()
        with torch.no_grad():
            next_value = self.agent.get_value(self.collector.next_obs())
        adv, ret = gae(r.rewards, r.values, r.dones, next_value, self.collector.done,
                       self.ppo.gamma, self.ppo.gae_lambda)
        return Batch.from_rollout(r.obs, r.actions, r.logprobs, adv, ret, r.values)

    def learn(self, batch: Batch) -> dict[str, float | torch.Tensor]:
        """The PPO update on ``batch``, then the iteration's log record and episode stats.

        Update statistics stay device tensors (the logger decides when to read them); the
        episode statistics are the metrics' one read per iteration."""
        if self.ppo.anneal_lr:
            anneal_lr(self.optimizer, self.ppo.lr, self.iteration_index, self.n_iterations)
        stats = self.update(batch)
        self.iteration_index += 1
        episodes = self.metrics.summary()
        self.logger.log(self.collector.global_step, **stats, **episodes)
        return {**stats, **episodes}

    def iteration(self) -> dict[str, float | torch.Tensor]:
        """One PPO iteration: rollout of T steps x N envs, GAE, update."""
        return self.learn(self.rollout())

    def close(self) -> None:
        self.logger.close()
        if getattr(self, "_tmp", None) is not None:
            self._tmp.cleanup()
