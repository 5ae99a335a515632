"""Train PPO on Forage with one stage's pipeline, on the CPU or a GPU, with checkpoints.

The loop is only bookkeeping around :class:`labkit.stages.Pipeline` (the one rollout and
update): per iteration it runs ``pipeline.iteration()``, reads the update statistics once,
appends a line to ``OUT/metrics.jsonl`` and keeps a device-side copy of the state at the
iteration boundary. Every ``checkpoint_every`` iterations, at the end, and on Ctrl-C, that state
goes to ``OUT/checkpoint.pt`` (atomically); ``train(None, OUT, resume=True)`` continues the
same run bit-exactly on the same device. The learning rate anneals over the whole run.

Files in ``OUT``: ``metrics.jsonl`` (one line per iteration), ``checkpoint.pt``,
``summary.json``. The stage's own per-step logger writes to a temporary folder: it is part of
the stage's workload (what the ladder times), not the training record.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from .config import RunConfig, split_run_fields
from .device import ALLOWED as DEVICES
from .device import resolve_device
from .envs.spec import check_int
from .files import write_json, write_jsonl
from .logging import SyncLogger
from .stages import Pipeline, StageSkipped, get_stage

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
#: Update statistics read from the device once per iteration.
UPDATE_KEYS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "grad_norm")
#: ``final_mean_return`` is the episode-weighted mean over this many last iterations.
FINAL_WINDOW = 5


@dataclass
class TrainConfig:
    """One training run: a ``RunConfig`` trained by one stage's pipeline for ``total_steps``."""

    run: RunConfig = field(default_factory=RunConfig)
    """What the pipeline runs (N, T, seed, value head, env, PPO). Its ``lr_horizon`` is set to
    ``n_iterations``: the LR anneals to 0 over the whole run."""
    stage: str = "fused_amp"
    """Ladder stage whose pipeline trains (0-8 or a name; stages 0-2 are slow on purpose,
    cuda_graphs needs a bf16 GPU)."""
    device: str = "auto"
    """auto (CUDA if present), cpu, cuda or cuda:N."""
    total_steps: int = 500_000
    """Env steps of the whole run, rounded down to whole iterations (at least one)."""
    checkpoint_every: int = 25
    """Write OUT/checkpoint.pt every this many iterations (0: only at the end and on Ctrl-C)."""
    n_iterations: int = field(init=False)
    """total_steps // (n_envs * n_steps), derived."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunConfig):
            raise TypeError(f"run must be a RunConfig, got {type(self.run).__name__}")
        self.stage = get_stage(self.stage).name
        if not isinstance(self.device, str) or not _device_syntax_ok(self.device):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        check_int("total_steps", self.total_steps, 1)
        check_int("checkpoint_every", self.checkpoint_every, 0)
        batch = self.run.batch_size
        if self.total_steps < batch:
            raise ValueError(f"total_steps must be at least one batch (n_envs * n_steps = "
                             f"{batch}), got {self.total_steps}")
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


def _device_syntax_ok(device: str) -> bool:
    if device == "auto":
        return True
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, after the last iteration boundary was checkpointed."""

    def __init__(self, checkpoint_path: Path, iteration: int) -> None:
        super().__init__(f"interrupted; state after iteration {iteration} saved to "
                         f"{checkpoint_path}")
        self.checkpoint_path, self.iteration = checkpoint_path, iteration


def build_pipeline(cfg: TrainConfig, device: torch.device) -> Pipeline:
    """The stage's pipeline for ``cfg`` (its LR annealed over ``cfg.n_iterations``)."""
    try:
        return Pipeline(cfg.stage, cfg.run, device)
    except StageSkipped as err:
        raise ValueError(f"stage {cfg.stage!r} cannot run on {device}: {err}") from None


def _read_stats(pipeline: Pipeline, stats: dict) -> dict[str, float]:
    """Update statistics (device tensors) and the LR as Python floats."""
    lr = pipeline.optimizer.param_groups[0]["lr"]
    values = [stats[k].float() for k in UPDATE_KEYS]
    if isinstance(lr, torch.Tensor):
        values.append(lr.float())
    # The loop's one deliberate host sync per iteration: it also makes the clock read after it
    # honest on CUDA. (The episode statistics were read by the stage's metrics component.)
    numbers = torch.stack(values).tolist()
    out = dict(zip(UPDATE_KEYS, numbers[:len(UPDATE_KEYS)], strict=True))
    out["lr"] = numbers[-1] if isinstance(lr, torch.Tensor) else float(lr)
    return out


def _read_metrics(path: Path, keep_through: int) -> list[dict]:
    """The records of iterations 1..``keep_through`` in ``path``. A crash after a checkpoint
    may have logged later iterations (they will run again) or half a line: both dropped."""
    import json

    if not path.exists():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            break
        if record.get("iteration", math.inf) > keep_through:
            break
        kept.append(record)
    return kept


def _final_means(recent: deque) -> tuple[float, float]:
    """Episode-weighted mean return and length over the last iterations' records."""
    episodes = sum(r["episodes"] for r in recent)
    if not episodes:
        return math.nan, math.nan
    ret = sum(r["episodes"] * r["mean_return"] for r in recent if r["episodes"]) / episodes
    length = sum(r["episodes"] * r["mean_length"] for r in recent if r["episodes"]) / episodes
    return ret, length


def train(cfg: TrainConfig | None, out: str | Path, *, resume: bool = False,
          progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """Train, writing ``out/metrics.jsonl``, ``out/checkpoint.pt`` and ``out/summary.json``.

    ``resume=True`` continues the run saved in ``out/checkpoint.pt`` with its saved config
    (``cfg`` must be None or equal to it) and appends to its metrics. ``stop_after`` ends the
    run early after that iteration (counted from the run's start), with a checkpoint, as a clean
    Ctrl-C would. Ctrl-C saves the state of the last finished iteration, closes the logs and
    raises :class:`TrainingInterrupted`. Returns the summary (also written to summary.json).
    """
    from tqdm.auto import tqdm

    out = Path(out)
    ckpt_path = out / checkpoint.FILENAME
    saved = None
    if resume:
        saved = checkpoint.load(ckpt_path)
        saved_cfg = TrainConfig.from_dict(saved["config"])
        if cfg is not None and cfg.to_dict() != saved_cfg.to_dict():
            raise ValueError(f"cfg differs from the config saved in {ckpt_path}; pass cfg=None "
                             "to resume with the saved one")
        cfg = saved_cfg
    elif cfg is None:
        raise ValueError("cfg is required unless resume=True")
    elif ckpt_path.exists() or (out / METRICS).exists():
        raise ValueError(f"out folder {out} already holds a run; resume it or choose another")
    if stop_after is not None:
        check_int("stop_after", stop_after, 1)

    device = resolve_device(cfg.device)
    if saved is not None and torch.device(saved["device"]).type != device.type:
        raise ValueError(f"{ckpt_path} was written on {saved['device']}; resume it on the same "
                         f"kind of device (got {device}): the sampling generator's state is "
                         "device-specific")
    pipe = build_pipeline(cfg, device)
    wall_before = 0.0
    if saved is not None:
        pipe.load_state_dict(saved["state"])
        wall_before = float(saved["wall_s"])
    start = pipe.iteration_index
    end = cfg.n_iterations if stop_after is None else max(start, min(stop_after,
                                                                     cfg.n_iterations))
    out.mkdir(parents=True, exist_ok=True)
    kept = _read_metrics(out / METRICS, start)
    if saved is not None:
        write_jsonl(out / METRICS, kept)
    recent: deque = deque(kept[-FINAL_WINDOW:], maxlen=FINAL_WINDOW)

    metrics_log = SyncLogger(out / METRICS, mode="a")
    state, state_wall = pipe.state_dict(), wall_before

    def save_state() -> Path:
        return checkpoint.save(ckpt_path, {"config": cfg.to_dict(), "device": str(device),
                                           "wall_s": state_wall, "state": state})

    bar = tqdm(total=cfg.n_iterations * cfg.run.batch_size, initial=start * cfg.run.batch_size,
               unit="step", unit_scale=True, desc=f"train {cfg.stage}", disable=not progress)
    first_iter_s = None
    t_start = time.perf_counter()
    try:
        for it in range(start, end):
            t0 = time.perf_counter()
            stats = pipe.iteration()
            record = {"iteration": it + 1, **_read_stats(pipe, stats),
                      **{k: stats[k] for k in ("episodes", "mean_return", "std_return",
                                               "mean_length")}}
            now = time.perf_counter()
            iter_s = now - t0
            first_iter_s = iter_s if first_iter_s is None else first_iter_s
            record.update(iter_s=iter_s, sps=cfg.run.batch_size / iter_s,
                          wall_s=wall_before + now - t_start)
            metrics_log.log(pipe.global_step, **record)
            metrics_log.flush()
            recent.append(record)
            state, state_wall = pipe.state_dict(), record["wall_s"]
            if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
                save_state()
            bar.update(cfg.run.batch_size)
            if record["episodes"]:
                bar.set_postfix(ret=f"{record['mean_return']:.2f}", sps=f"{record['sps']:.0f}")
        save_state()
    except KeyboardInterrupt:
        # Mid-iteration state is torn; the last boundary's copy is what resumes exactly.
        save_state()
        raise TrainingInterrupted(ckpt_path, state["iteration"]) from None
    finally:
        bar.close()
        metrics_log.close()
        pipe.close()

    session_s = time.perf_counter() - t_start
    ran = end - start
    final_return, final_length = _final_means(recent)
    summary = {
        "stage": cfg.stage, "device": str(device), "complete": end == cfg.n_iterations,
        "iterations": end, "steps": end * cfg.run.batch_size,
        "final_mean_return": final_return, "final_mean_length": final_length,
        "final_window_iterations": len(recent),
        "wall_s": wall_before + session_s,
        "steps_per_s": ran * cfg.run.batch_size / session_s if ran else math.nan,
        "steady_steps_per_s": ((ran - 1) * cfg.run.batch_size / (session_s - first_iter_s)
                               if ran > 1 else math.nan),
        "first_iteration_s": first_iter_s,
        "config": cfg.to_dict(),
    }
    write_json(out / SUMMARY, summary)
    return summary
