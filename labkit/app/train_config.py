"""What a training run is asked to do: :class:`TrainConfig`, checked field by field as it is
built (the door, :func:`labkit.app.run.open_run`, judges it against the device and the folder)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..config import RunConfig, split_run_fields
from ..device import parse_device
from ..stages import get_stage
from ..validate import check_int


@dataclass
class TrainConfig:
    """One training run: a ``RunConfig`` trained by one stage's pipeline for ``total_steps``."""

    run: RunConfig = field(default_factory=RunConfig)
    """What the pipeline runs (N, T, seed, value head, env, PPO). Its ``lr_horizon`` is set to
    ``n_iterations``: the LR anneals to 0 over the whole run."""
    stage: str | None = None
    """Ladder stage whose pipeline trains (0-8 or a name; stages 0-2 are slow on purpose,
    cuda_graphs needs a bf16 GPU). None: the run's device's default by its recorded ladder
    (``labkit.stages.DEFAULT_STAGE``: on the CPU the stage that finishes the default run first,
    set-up counted; on CUDA the fastest), settled when the run opens."""
    device: str = "auto"
    """auto (CUDA if present), cpu, cuda or cuda:N."""
    total_steps: int = 500_000
    """Env steps of the whole run, rounded down to whole iterations (at least one)."""
    checkpoint_every: int = 25
    """Write OUT/checkpoint.pt every this many iterations (0: only at the end and on Ctrl-C)."""
    world_size: int = 1
    """Processes of a torchrun run (the CLI sets it from torchrun's WORLD_SIZE); every process
    steps its own n_envs, and total_steps counts them all."""
    n_iterations: int = field(init=False)
    """total_steps // (n_envs * n_steps * world_size), derived."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunConfig):
            raise TypeError(f"run must be a RunConfig, got {type(self.run).__name__}")
        self.stage = get_stage(self.stage).name if self.stage is not None else None
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a str, got {type(self.device).__name__}")
        parse_device(self.device)
        check_int("total_steps", self.total_steps, 1)
        check_int("checkpoint_every", self.checkpoint_every, 0)
        check_int("world_size", self.world_size, 1)
        if self.world_size > 1 and self.run.value_head != "plain":
            raise ValueError("value_head must be plain under torchrun (PopArt's statistics "
                             "would need an all-reduce of their own)")
        batch = self.run.batch_size * self.world_size
        if self.total_steps < batch:
            raise ValueError(f"total_steps must be at least one batch (n_envs * n_steps * "
                             f"world_size = {batch}), got {self.total_steps}")
        self.n_iterations = self.total_steps // batch
        self.run = self.run.replace(lr_horizon=self.n_iterations)

    @classmethod
    def flat(cls, **kwargs) -> TrainConfig:
        """Build from one flat set of keywords: RunConfig fields go to ``run``."""
        run, own = split_run_fields(kwargs)
        return cls(run=RunConfig(**run), **own)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (saved in checkpoints and summary.json); derived fields included."""
        return {"run": self.run.to_dict(), **{f.name: getattr(self, f.name)
                                              for f in fields(self) if f.name != "run"}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        init = {f.name for f in fields(cls) if f.init}
        kwargs = {k: v for k, v in data.items() if k in init and k != "run"}
        return cls(run=RunConfig.from_dict(data["run"]), **kwargs)
