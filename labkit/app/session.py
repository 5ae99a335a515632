"""One training process between iterations (:class:`Session`): the state of the last finished
iteration (what a checkpoint holds, and what resumes exactly), the recent records, the logs it
writes to ``OUT/metrics.jsonl`` and TensorBoard, and how it saves ``OUT/checkpoint.pt``; what it
says when a stop signal, a full disk or a non-finite loss ends the loop. :func:`labkit.app.train.
train` opens the run and drives the loop."""
from __future__ import annotations

import contextlib
import hashlib
import math
import signal
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import debug
from ..distributed import parameter_checksum
from ..files import describe_os_error
from ..logging import AsyncLogger, SyncLogger, TensorBoardSink, quiet_thread_os_errors
from ..signals import signals_deferred, signum_of
from ..stages import Pipeline, PipelineState
from . import checkpoint
from .run import METRICS, Run, TrainingFailed, TrainingInterrupted

#: Update statistics read from the device once per iteration.
UPDATE_KEYS = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "grad_norm")
#: ``final_mean_return`` is the episode-weighted mean over this many last iterations.
FINAL_WINDOW = 5


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


def _rank_part(state: PipelineState) -> dict:
    """What differs between ranks (their envs, episode statistics, sampler), on the CPU so
    that it travels to rank 0 as plain bytes."""
    return checkpoint.to_cpu(state.per_rank())


class History:
    """``metrics.jsonl`` as this run wrote it: its size after the last record and a hash of
    that record, checked before each record and at each checkpoint. A file truncated or
    rewritten meanwhile (by hand, by another tool) stops the run with a ValueError naming it,
    instead of a history that silently lacks iterations (a deleted one is a write error, which
    the logger raises)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = self._size()
        self.last: tuple[int, str] | None = None  # (offset, sha256) of the last record written

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return -1

    def _digest(self, start: int, end: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(start)
            return hashlib.sha256(f.read(max(end - start, 0))).hexdigest()

    def check(self) -> None:
        size = self._size()
        if size < 0 or size == self.size and (self.last is None or self._digest(
                self.last[0], size) == self.last[1]):
            return  # deleted: the logger's flush says so, a write error (the folder may be gone)
        what = ("had its last record rewritten" if size == self.size else
                f"holds {size:,} bytes where this run had written {self.size:,}")
        raise ValueError(f"{self.path} changed while the run was writing it: it {what} "
                         "(truncated or rewritten by something else); its history is torn, so "
                         "the run stops: restore the file (or start a new run), then resume")

    def wrote(self) -> None:
        """A record was appended (and flushed)."""
        start, self.size = self.size, self._size()
        self.last = (start, self._digest(start, self.size))


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


class Session:
    """One training process between iterations of ``run`` (the :class:`Run` the door opened:
    its config, folder, device, process group, start and lock are the run's) trained by
    ``pipe``: the state of the last finished iteration (what a checkpoint holds, and what
    resumes exactly), the recent records, the logs it writes, and how it saves. Every rank has
    one; rank 0 (the group's main) writes."""

    def __init__(self, run: Run, pipe: Pipeline) -> None:
        self.run, self.pipe = run, pipe
        self.steps_per_iteration = run.cfg.run.batch_size * run.cfg.world_size
        self.recent: deque = deque(run.kept[-FINAL_WINDOW:], maxlen=FINAL_WINDOW)
        saved = run.saved
        self.wall_before = float(saved["wall_s"]) if saved is not None else 0.0
        self.state, self.state_wall = pipe.state_dict(), self.wall_before
        self.saved_iteration = saved["state"]["iteration"] if saved is not None else None
        self.metrics_log: SyncLogger | None = None
        self.history: History | None = None
        self.board: AsyncLogger | None = None
        self.first_iter_s: float | None = None
        self.t_start = self.session_s = self.setup_s = 0.0

    def open_logs(self, resources: contextlib.ExitStack, tensorboard: str | Path | None) -> None:
        if not self.run.group.is_main:
            return
        self.metrics_log = SyncLogger(self.run.out / METRICS, mode="a")
        resources.push(_closer(self.metrics_log))
        self.history = History(self.run.out / METRICS)
        if tensorboard is not None:  # a resume replaces what came after its checkpoint
            purge = self.pipe.global_step * self.run.group.world + 1 if self.run.start else None
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
        if self.run.group.any(bad):
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
        step = self.pipe.global_step * self.run.group.world
        if self.metrics_log is not None:
            with _writing():
                self.history.check()
                self.metrics_log.log(step, **record)
                self.metrics_log.flush()
                self.history.wrote()
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
        run = self.run
        parts = run.group.gather(_rank_part(self.state))
        if run.group.is_main:
            if run.lock is not None:  # the run folder's, checked before each save
                run.lock.check()
            if self.history is not None:
                self.history.check()
            payload = {"config": run.cfg.to_dict(), "device": str(run.device),
                       "threads": torch.get_num_threads(),
                       "executor_choices": self.pipe.math.executor_choices,
                       "conv_choices": self.pipe.math.conv_choices,
                       "wall_s": self.state_wall, "state": self.state.to_dict()}
            if run.group.world > 1:
                payload["ranks"] = parts
            with _writing():
                checkpoint.save(run.checkpoint_path, payload)
        self.saved_iteration = self.state.iteration

    def save_on_failure(self, quiet: bool = False) -> None:
        """Keep the last finished iteration after a failure, where one process can (ranks of a
        torchrun stopped at different points cannot agree on a state)."""
        if self.run.group.world == 1 and self.behind():
            with contextlib.ExitStack() as guard:
                if quiet:  # a crash: saving may fail too, and must not hide the crash
                    guard.enter_context(contextlib.suppress(Exception))
                guard.enter_context(signals_deferred(reraise=False))
                self.save()

    def where(self) -> str:
        ckpt_path = self.run.checkpoint_path
        if not self.run.out.is_dir():
            return f"the run folder {self.run.out} was deleted, with its checkpoint"
        if self.saved_iteration is None:
            return "no checkpoint was written yet"
        if not ckpt_path.is_file():
            return f"{ckpt_path}, written after iteration {self.saved_iteration}, is gone"
        return f"{ckpt_path} holds the state after iteration {self.saved_iteration}"

    def stopped(self, err: BaseException) -> BaseException:
        """What to raise for ``err``, which stopped the loop, after saving what can be saved."""
        if isinstance(err, KeyboardInterrupt):
            # Mid-iteration state is torn; the last boundary's copy is what resumes exactly.
            # Ranks of a torchrun stop at different points: only scheduled checkpoints count.
            signum = signum_of(err)
            if self.run.group.world == 1:
                with signals_deferred(reraise=False):
                    self.save()
            return TrainingInterrupted(
                f"interrupted by {signal.Signals(signum).name}; {self.where()}\ncontinue with: "
                f"python -m labkit train --resume {self.run.out}", signum,
                self.run.checkpoint_path, self.saved_iteration)
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
        run, session_s, spi = self.run, self.session_s, self.steps_per_iteration
        ran = end - run.start
        checksums = run.group.all_gather(parameter_checksum(self.pipe.agent))
        final_return, final_length = _final_means(self.recent)
        return {
            "stage": run.cfg.stage, "device": str(run.device),
            "precision": self.pipe.precision.describe(),
            "model_math": self.pipe.math.kinds(),
            "executor_choices": self.pipe.math.executor_choices,
            "conv_choices": self.pipe.math.conv_choices,
            "threads": torch.get_num_threads(),
            "complete": end == run.cfg.n_iterations, "iterations": end, "steps": end * spi,
            "world_size": run.group.world,
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
            "config": run.cfg.to_dict(),
        }
