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

import contextlib
import json
import math
import os
import signal
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import debug
from ..capture import warmup
from ..device import parse_device, resolve_device
from ..distributed import SINGLE, Group, current, join, leave, parameter_checksum
from ..executors import describe_model_math
from ..files import FolderLock, describe_os_error
from ..logging import AsyncLogger, SyncLogger, TensorBoardSink, quiet_thread_os_errors
from ..signals import raise_if_stopped, signals_deferred, signum_of, stop_signals
from ..stages import PARTS, Pipeline, PipelineState
from ..validate import check_int
from . import checkpoint
from .run import (
    CONFIG,
    METRICS,
    NewFolder,
    Run,
    TrainConfig,
    TrainingFailed,
    TrainingInterrupted,
    open_run,
)

__all__ = ["NewFolder", "TrainConfig", "TrainingFailed", "TrainingInterrupted",
           "build_pipeline", "train"]

#: Update statistics read from the device once per iteration.
UPDATE_KEYS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "grad_norm")
#: ``final_mean_return`` is the episode-weighted mean over this many last iterations.
FINAL_WINDOW = 5


def device_type(cfg: TrainConfig | None, out: Path, resume: bool) -> str:
    """The type of device a torchrun run trains on, known before any rank talks to another
    (the process group's backend depends on it): from ``cfg``, or for ``resume`` from the
    run's config.json (every rank sees the folder). Where that cannot be read, "auto"'s
    choice; rank 0's door then reports what is wrong with the folder."""
    device = cfg.device if cfg is not None else "auto"
    if cfg is None and resume:
        try:
            saved = json.loads((out / CONFIG).read_text(encoding="utf-8")).get("device")
            device = saved if parse_device(saved) is not None else device
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    try:
        return resolve_device(device).type
    except ValueError:  # CUDA named but absent: the door says so in one line
        return "cpu"


def build_pipeline(cfg: TrainConfig, device: torch.device, group: Group = SINGLE) -> Pipeline:
    """The stage's pipeline for ``cfg`` (its LR annealed over ``cfg.n_iterations``)."""
    return Pipeline(cfg.stage, cfg.run, device, group=group)


def _read_stats(pipeline: Pipeline, stats: dict) -> dict[str, float]:
    """Update statistics (device tensors) and the LR as Python floats."""
    values = [stats[k].float() for k in UPDATE_KEYS]
    lr = pipeline.stage.optimizer.lr(pipeline.optimizer)  # a float or a device tensor
    values.append(torch.as_tensor(lr, dtype=torch.float32, device=values[0].device))
    # The loop's one deliberate host sync per iteration: it also makes the clock read after it
    # honest on CUDA. (The episode statistics were read by the stage's metrics component.)
    numbers = torch.stack(values).tolist()
    return dict(zip((*UPDATE_KEYS, "lr"), numbers, strict=True))


def _final_means(recent: deque) -> tuple[float, float]:
    """Episode-weighted mean return and length over the last iterations' records."""
    episodes = sum(r["episodes"] for r in recent)
    if not episodes:
        return math.nan, math.nan
    ret = sum(r["episodes"] * r["mean_return"] for r in recent if r["episodes"]) / episodes
    length = sum(r["episodes"] * r["mean_length"] for r in recent if r["episodes"]) / episodes
    return ret, length


def train(cfg: TrainConfig | None, out: str | Path | NewFolder, *, resume: bool = False,
          progress: bool = True, stop_after: int | None = None,
          tensorboard: str | Path | None = None, debug_checks: bool = False) -> dict[str, Any]:
    """Train, writing ``out/config.json``, ``out/metrics.jsonl``, ``out/checkpoint.pt`` and
    ``out/summary.json`` (and TensorBoard scalars to ``tensorboard`` if given);
    ``out=NewFolder()``: a new ``runs/train-<date>-<time>`` folder, made once the run is
    judged valid.

    ``resume=True`` continues the run saved in ``out`` with its saved config (``cfg`` must be
    None or equal to it), from its checkpoint or, if it died before the first one, from its
    start. The run is judged once, by :func:`labkit.app.run.open_run`. ``stop_after`` ends the
    run early after that iteration (counted from the run's start), with a checkpoint. Ctrl-C,
    SIGTERM and SIGHUP save the state of the last finished iteration, close the logs and raise
    :class:`TrainingInterrupted` (further signals wait for the save); before the first
    iteration too, its message saying what the folder holds (a config.json written is kept for
    a resume). A signal that something swallows (a torch.compile guard clears any error) stops
    the run at the end of that iteration. A non-finite loss or a write error raises
    :class:`TrainingFailed` saying where the last good state is; so does a NaN or inf that
    ``debug_checks`` (the debug module's finite-ness checks, also on with ``LABKIT_DEBUG=1``)
    finds. The folder is locked while training: a second process writing to it gets a clear
    error. Returns the summary (also written to summary.json), with ``out``, the folder.

    Under torchrun every process calls this; rank 0 alone judges and writes the folder, and
    checkpoints hold every rank's envs (a stop signal keeps the last scheduled checkpoint:
    ranks stopped mid-iteration cannot agree on a newer one).
    """
    if isinstance(out, bool) or not isinstance(out, (str, os.PathLike, NewFolder)):
        raise TypeError(f"out must be a folder path (str or Path), got {type(out).__name__}")
    if stop_after is not None:
        check_int("stop_after", stop_after, 1)
    group = current()
    if group.world > 1:  # the process group's backend depends on the device type
        if isinstance(out, NewFolder):
            raise ValueError("--out is required under torchrun: every rank must name the "
                             "same run folder")
        group = join(device_type(cfg, Path(out), resume))
    run = None
    try:
        with debug.enable(debug_checks or debug.enabled()), stop_signals():
            with open_run(cfg, out, resume=resume, tensorboard=tensorboard,
                          group=group) as run:
                if run.finished is not None:
                    return {**run.finished, "already_complete": True, "out": str(run.out)}
                summary = _run(run, progress, stop_after, tensorboard)
                return {**summary, "out": str(run.out)}
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt as stop:  # before the loop: a build, a compile, the door
        where = run.out if run is not None else (
            None if isinstance(out, NewFolder) else Path(out))
        raise TrainingInterrupted(_stopped_before_training(stop, where), signum_of(stop),
                                  out=where) from None
    finally:
        leave(group)


def _stopped_before_training(stop: BaseException, out: Path | None) -> str:
    """What a stop before the first iteration of this session kept, and how to go on."""
    how = f"interrupted by {signal.Signals(signum_of(stop)).name} before training"
    hint = f"\ncontinue with: python -m labkit train --resume {out}"
    if out is not None and (out / checkpoint.FILENAME).exists():
        return f"{how} resumed; {out / checkpoint.FILENAME} is unchanged{hint}"
    if out is not None and (out / CONFIG).exists():  # the same command again is refused
        return f"{how} started; {out} holds the run's config and nothing trained yet{hint}"
    return f"{how} started; nothing saved"


def _rank_part(state: PipelineState) -> dict:
    """What differs between ranks (their envs, episode statistics, sampler), on the CPU so
    that it travels to rank 0 as plain bytes."""
    return checkpoint.to_cpu(state.per_rank())


class _WriteError(Exception):
    """Writing the run's files failed (a full disk, a deleted folder): the machine's fault."""


@contextlib.contextmanager
def _writing() -> Iterator[None]:
    try:
        yield
    except OSError as err:
        raise _WriteError(describe_os_error(err)) from err
    except RuntimeError as err:  # an AsyncLogger's writer thread failed (it names the cause)
        raise _WriteError(str(err)) from err


def _closer(log):
    """An exit callback closing ``log``; a failure to close is raised only if nothing else
    already failed (one message, not two chained tracebacks, when the disk is full)."""
    def close(exc_type, exc, tb) -> bool:
        try:
            log.close()
        except (OSError, RuntimeError):
            if exc_type is None:
                raise
        return False
    return close


class _Session:
    """One training process between iterations: the state of the last finished iteration (what
    a checkpoint holds, and what resumes exactly), the recent records, the logs it writes, and
    how it saves. Every rank has one; rank 0 (``main``) writes."""

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, group: Group,
                 pipe: Pipeline, saved: dict | None, kept: list[dict], start: int) -> None:
        self.cfg, self.device, self.group, self.pipe = cfg, device, group, pipe
        self.start = start
        self.main = group.is_main
        self.ckpt_path = out / checkpoint.FILENAME
        self.steps_per_iteration = cfg.run.batch_size * cfg.world_size
        self.recent: deque = deque(kept[-FINAL_WINDOW:], maxlen=FINAL_WINDOW)
        self.wall_before = float(saved["wall_s"]) if saved is not None else 0.0
        self.state, self.state_wall = pipe.state_dict(), self.wall_before
        self.saved_iteration = saved["state"]["iteration"] if saved is not None else None
        self.metrics_log: SyncLogger | None = None
        self.board: AsyncLogger | None = None
        self.lock: FolderLock | None = None  # the run folder's, checked before each save
        self.first_iter_s: float | None = None
        self.t_start = self.session_s = self.setup_s = 0.0

    def open_logs(self, resources: contextlib.ExitStack, out: Path,
                  tensorboard: str | Path | None) -> None:
        if not self.main:
            return
        self.metrics_log = SyncLogger(out / METRICS, mode="a")
        resources.push(_closer(self.metrics_log))
        if tensorboard is not None:  # a resume replaces what came after its checkpoint
            purge = self.pipe.global_step * self.group.world + 1 if self.start else None
            resources.enter_context(quiet_thread_os_errors())  # its writer thread's disk errors
            self.board = AsyncLogger(None, sinks=[TensorBoardSink(tensorboard, purge)])
            resources.push(_closer(self.board))

    def record(self, it: int, stats: dict, t0: float) -> dict:
        """Iteration ``it``'s record (one host read); a non-finite loss on any rank saves the
        last finite state and raises :class:`TrainingFailed`."""
        record = {"iteration": it + 1, **_read_stats(self.pipe, stats),
                  **{k: stats[k] for k in ("episodes", "mean_return", "std_return",
                                           "mean_length")}}
        bad = [k for k in UPDATE_KEYS if not math.isfinite(record[k])]
        if self.group.any(bad):
            with signals_deferred(reraise=False):
                if self.behind():
                    self.save()  # the last finite state
            what = ", ".join(bad) or "on another rank"
            raise TrainingFailed(f"the loss became non-finite ({what}) in iteration {it + 1}; "
                                 f"stopped. {self.where()}")
        now = time.perf_counter()
        iter_s = now - t0
        self.first_iter_s = iter_s if self.first_iter_s is None else self.first_iter_s
        record.update(iter_s=iter_s, sps=self.steps_per_iteration / iter_s,
                      wall_s=self.wall_before + now - self.t_start)
        return record

    def log(self, record: dict) -> None:
        """The record into metrics.jsonl (flushed) and TensorBoard, on rank 0."""
        step = self.pipe.global_step * self.group.world
        if self.metrics_log is not None:
            with _writing():
                self.metrics_log.log(step, **record)
                self.metrics_log.flush()
        if self.board is not None:
            with _writing():
                self.board.log(step, **record)

    def keep(self, record: dict) -> None:
        """The iteration finished: its state is the one a checkpoint or a stop saves."""
        self.recent.append(record)
        self.state, self.state_wall = self.pipe.state_dict(), record["wall_s"]

    def behind(self) -> bool:
        return self.state.iteration != self.saved_iteration

    def save(self) -> None:
        """Every rank takes part (its envs are in the checkpoint); rank 0 writes."""
        parts = self.group.gather(_rank_part(self.state))
        if self.main:
            if self.lock is not None:
                self.lock.check()
            payload = {"config": self.cfg.to_dict(), "device": str(self.device),
                       "threads": torch.get_num_threads(),
                       "executor_choices": self.pipe.executor_choices,
                       "conv_choices": self.pipe.conv_choices,
                       "wall_s": self.state_wall, "state": self.state.to_dict()}
            if self.group.world > 1:
                payload["ranks"] = parts
            with _writing():
                checkpoint.save(self.ckpt_path, payload)
        self.saved_iteration = self.state.iteration

    def save_on_failure(self, quiet: bool = False) -> None:
        """Keep the last finished iteration after a failure, where one process can (ranks of a
        torchrun stopped at different points cannot agree on a state)."""
        if self.group.world == 1 and self.behind():
            with contextlib.ExitStack() as guard:
                if quiet:  # a crash: saving may fail too, and must not hide the crash
                    guard.enter_context(contextlib.suppress(Exception))
                guard.enter_context(signals_deferred(reraise=False))
                self.save()

    def where(self) -> str:
        if not self.ckpt_path.parent.is_dir():
            return f"the run folder {self.ckpt_path.parent} was deleted, with its checkpoint"
        if self.saved_iteration is None:
            return "no checkpoint was written yet"
        if not self.ckpt_path.is_file():
            return f"{self.ckpt_path}, written after iteration {self.saved_iteration}, is gone"
        return f"{self.ckpt_path} holds the state after iteration {self.saved_iteration}"

    def stopped(self, err: BaseException) -> BaseException:
        """What to raise for ``err``, which stopped the loop, after saving what can be saved."""
        if isinstance(err, KeyboardInterrupt):
            # Mid-iteration state is torn; the last boundary's copy is what resumes exactly.
            # Ranks of a torchrun stop at different points: only scheduled checkpoints count.
            signum = signum_of(err)
            if self.group.world == 1:
                with signals_deferred(reraise=False):
                    self.save()
            return TrainingInterrupted(
                f"interrupted by {signal.Signals(signum).name}; {self.where()}\ncontinue with: "
                f"python -m labkit train --resume {self.ckpt_path.parent}", signum,
                self.ckpt_path, self.saved_iteration)
        if isinstance(err, _WriteError):
            return TrainingFailed(f"writing the run failed: {err}. {self.where()}")
        if isinstance(err, debug.NonFiniteError):
            self.save_on_failure()
            return TrainingFailed(f"debug checks: {err}, in iteration "
                                  f"{self.state.iteration + 1}; stopped. {self.where()}")
        # A crash (a bug, out of memory): keep the last finished iteration if that works.
        self.save_on_failure(quiet=True)
        if hasattr(err, "add_note"):
            err.add_note(f"labkit: {self.where()}")
        return err

    def summary(self, end: int) -> dict[str, Any]:
        """The run's summary after iteration ``end`` (what summary.json holds)."""
        session_s, ran, spi = self.session_s, end - self.start, self.steps_per_iteration
        checksums = self.group.all_gather(parameter_checksum(self.pipe.agent))
        final_return, final_length = _final_means(self.recent)
        return {
            "stage": self.cfg.stage, "device": str(self.device),
            "precision": self.pipe.precision.describe(),
            "model_math": self.pipe.model_math(),
            "executor_choices": self.pipe.executor_choices,
            "conv_choices": self.pipe.conv_choices,
            "threads": torch.get_num_threads(),
            "complete": end == self.cfg.n_iterations, "iterations": end, "steps": end * spi,
            "world_size": self.group.world,
            "params_identical_on_all_ranks": len(set(checksums)) == 1,
            "param_checksums": checksums,
            "final_mean_return": final_return, "final_mean_length": final_length,
            "final_window_iterations": len(self.recent),
            "wall_s": self.wall_before + session_s,
            "steps_per_s": ran * spi / session_s if ran else math.nan,
            "steady_steps_per_s": ((ran - 1) * spi / (session_s - self.first_iter_s)
                                   if ran > 1 else math.nan),
            "first_iteration_s": self.first_iter_s,
            "setup_s": self.setup_s,
            "config": self.cfg.to_dict(),
        }


def _load(pipe: Pipeline, saved: dict, group: Group, ckpt_path: Path) -> None:
    """The checkpoint's state into ``pipe`` (this rank's envs, under torchrun)."""
    state = dict(saved["state"])
    if group.world > 1:
        state.update(saved["ranks"][group.rank])
    try:
        pipe.load_state_dict(PipelineState.from_dict(state))
    except (KeyError, RuntimeError, TypeError, ValueError) as err:
        raise checkpoint.CheckpointError(f"{ckpt_path}: its state does not fit its "
                                         f"config ({type(err).__name__}: {err})") from None


def _choose_executors(pipe: Pipeline, saved: dict | None, group: Group,
                      ckpt_path: Path) -> None:
    """Settle what a stage that compiles only where it pays keeps: a resumed run keeps what
    its checkpoint says (the same kernels, the same numbers); otherwise a warmup times eager
    against compiled, and where the stage chooses them the convolutions' conv2d against
    matmul (off the clock, undone; a forced ``compile`` or ``conv_math`` needs none). Under
    torchrun every rank keeps rank 0's choices. A checkpoint from before runs chose ran
    compiled, and its convolutions conv2d."""
    if saved is not None:
        made = saved.get("executor_choices", {part: {"kept": "compiled",
                                                     "why": "as the run began"}
                                              for part in pipe.choices})
        if set(made) != set(pipe.choices):
            raise checkpoint.CheckpointError(
                f"{ckpt_path}: field 'executor_choices' names {sorted(made)}, but stage "
                f"{pipe.stage.name} chooses for {sorted(pipe.choices)}")
        pipe.keep_choices(made)
        convs = saved.get("conv_choices") or (
            {part: {"kept": "conv2d", "why": "as the run began"} for part in PARTS}
            if pipe.chooses_conv_math else {})
        if convs:
            if pipe.conv_body is None:
                raise checkpoint.CheckpointError(
                    f"{ckpt_path}: field 'conv_choices' names how convolutions run, but the "
                    f"agent of stage {pipe.stage.name} has no conv body")
            pipe.keep_conv_math(convs)
    elif set(pipe.choices) - set(pipe.executor_choices) or (
            pipe.chooses_conv_math and not pipe.conv_choices):
        warmup(pipe)
    if group.world > 1 and pipe.choices:
        pipe.keep_choices(group.broadcast(pipe.executor_choices))
    if group.world > 1 and pipe.conv_choices:
        pipe.keep_conv_math(group.broadcast(pipe.conv_choices))


def start_line(cfg: TrainConfig, pipe: Pipeline) -> str:
    """What a run prints as it starts: the stage, device, precision and, where the stage
    chooses, what runs its model math and why."""
    line = f"train: {cfg.stage} on {pipe.device}, {pipe.precision.describe()}"
    math = describe_model_math(pipe.executor_choices, pipe.conv_choices)
    return line + (f"; {math}" if math else "")


def _show(bar: Any, record: dict, steps: int) -> None:
    bar.update(steps)
    if record["episodes"]:
        bar.set_postfix(ret=f"{record['mean_return']:.2f}", sps=f"{record['sps']:.0f}")


def _run(run: Run, progress: bool, stop_after: int | None,
         tensorboard: str | Path | None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    cfg, group, start = run.cfg, run.group, run.start
    if stop_after is not None and stop_after <= start < cfg.n_iterations:
        raise ValueError(f"stop_after ({stop_after}) must be after the iteration the run "
                         f"resumes from ({start} of {cfg.n_iterations}): nothing to train")
    end = cfg.n_iterations if stop_after is None else max(start, min(stop_after,
                                                                     cfg.n_iterations))
    t_setup = time.perf_counter()
    with contextlib.ExitStack() as resources:
        pipe = resources.enter_context(build_pipeline(cfg, run.device, group))
        if run.saved is not None:
            _load(pipe, run.saved, group, run.checkpoint_path)
        _choose_executors(pipe, run.saved, group, run.checkpoint_path)
        run.keep_metrics()
        session = _Session(cfg, run.out, run.device, group, pipe, run.saved, run.kept, start)
        session.lock = run.lock
        session.open_logs(resources, run.out, tensorboard)
        steps = session.steps_per_iteration
        bar = resources.enter_context(tqdm(
            total=cfg.n_iterations * steps, initial=start * steps, unit="step",
            unit_scale=True, desc=f"train {cfg.stage} {pipe.precision}",
            disable=not (progress and group.is_main)))
        if progress and group.is_main:
            bar.write(start_line(cfg, pipe))
        session.t_start = time.perf_counter()
        session.setup_s = session.t_start - t_setup
        try:
            for it in range(start, end):
                t0 = time.perf_counter()
                record = session.record(it, pipe.iteration(), t0)
                session.log(record)
                session.keep(record)
                if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0:
                    with signals_deferred():  # a stop during the save stops after it
                        session.save()
                _show(bar, record, steps)
                raise_if_stopped()  # a stop that something swallowed stops here
            with signals_deferred(reraise=False):  # the run is done; a late stop changes nothing
                if session.behind():  # not when the last iteration's checkpoint is written
                    session.save()
        except TrainingFailed:
            raise
        except (KeyboardInterrupt, Exception) as err:
            stop = session.stopped(err)
            if stop is err:
                raise
            raise stop from None
        session.session_s = time.perf_counter() - session.t_start
    summary = session.summary(end)
    run.write_summary(summary)
    if start == end:
        summary["summary_restored"] = True
    return summary
