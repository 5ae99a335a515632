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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .. import debug
from ..config import RunConfig, split_run_fields
from ..device import ALLOWED as DEVICES
from ..device import resolve_device
from ..distributed import SINGLE, Group, join, leave, parameter_checksum
from ..files import (
    FolderLock,
    check_output_dir,
    describe_os_error,
    write_json,
    write_jsonl,
)
from ..logging import AsyncLogger, SyncLogger, TensorBoardSink, quiet_thread_os_errors
from ..signals import raise_if_stopped, signals_deferred, signum_of, stop_signals
from ..stages import Pipeline, PipelineState, get_stage
from ..validate import check_int
from . import checkpoint

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
    world_size: int = 1
    """Processes of a torchrun run (the CLI sets it from torchrun's WORLD_SIZE); every process
    steps its own n_envs, and total_steps counts them all."""
    n_iterations: int = field(init=False)
    """total_steps // (n_envs * n_steps * world_size), derived."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunConfig):
            raise TypeError(f"run must be a RunConfig, got {type(self.run).__name__}")
        self.stage = get_stage(self.stage).name
        if not isinstance(self.device, str) or not _device_syntax_ok(self.device):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
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


def _device_syntax_ok(device: str) -> bool:
    if device == "auto":
        return True
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


CONFIG = "config.json"
#: A folder holding any of these holds a run.
RUN_FILES = (CONFIG, METRICS, "checkpoint.pt")


class TrainingInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) during training; the state of the last finished
    iteration was saved (or, before the first one, nothing needed saving)."""

    def __init__(self, message: str, signum: int = signal.SIGINT,
                 checkpoint_path: Path | None = None, iteration: int | None = None) -> None:
        super().__init__(message)
        self.signum, self.checkpoint_path, self.iteration = signum, checkpoint_path, iteration


class TrainingFailed(RuntimeError):
    """Training stopped on a fault of the run or the machine (a non-finite loss, a full
    disk); the message says what happened and where the last good state is."""


def check_runnable(cfg: TrainConfig, group: Group = SINGLE) -> torch.device:
    """The device ``cfg`` trains on (this rank's GPU under torchrun), after checking (before
    anything is written) that it exists, the stage can run there and the run fits in memory."""
    device = group.device(resolve_device(cfg.device))
    get_stage(cfg.stage).check(device, cfg.run)  # StageSkipped, a ValueError
    if cfg.world_size != group.world:
        raise ValueError(f"world_size is {cfg.world_size} in the config but torchrun started "
                         f"{group.world} process(es); resume a run with as many as it had")
    return device


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


def _read_metrics(path: Path, keep_through: int) -> list[dict]:
    """The records of iterations 1..``keep_through`` in ``path``. A crash after a checkpoint
    may have logged later iterations (they will run again) or half a last line: both are
    dropped. A bad line with good lines after it is damage, not a crash: an error."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    kept: list[dict] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break  # the torn last line of an interrupted write
            raise ValueError(f"{path} line {number} is not valid JSON (and later lines are); "
                             "repair or delete that line, then resume") from None
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            if number == len(lines):
                break
            raise ValueError(f"{path} line {number} is not a metrics record (a JSON object with "
                             "an integer iteration); repair or delete that line, then resume")
        if record["iteration"] > keep_through:
            break
        if record["iteration"] != len(kept) + 1:  # one record per iteration, in order
            what = (f"repeats iteration {record['iteration']}"
                    if record["iteration"] <= len(kept) else
                    f"skips from iteration {len(kept)} to {record['iteration']}")
            raise ValueError(f"{path} line {number} {what}: a resumed run would keep the "
                             "damage; repair or restore the file, then resume")
        kept.append(record)
    if len(kept) < keep_through:
        raise ValueError(f"{path} ends at iteration {len(kept)}, but the checkpoint holds "
                         f"iteration {keep_through}: its records after {len(kept)} are missing; "
                         "restore the file, then resume")
    return kept


def _final_means(recent: deque) -> tuple[float, float]:
    """Episode-weighted mean return and length over the last iterations' records."""
    episodes = sum(r["episodes"] for r in recent)
    if not episodes:
        return math.nan, math.nan
    ret = sum(r["episodes"] * r["mean_return"] for r in recent if r["episodes"]) / episodes
    length = sum(r["episodes"] * r["mean_length"] for r in recent if r["episodes"]) / episodes
    return ret, length


def _open_run(cfg: TrainConfig | None, out: Path, resume: bool
              ) -> tuple[TrainConfig, dict | None]:
    """The run's config and its checkpoint payload (None: start from iteration 0).

    A new run writes ``config.json`` first, so a folder whose run died before its first
    checkpoint can be resumed from its start."""
    ckpt_path, cfg_path = out / checkpoint.FILENAME, out / CONFIG
    if not resume:
        if cfg is None:
            raise ValueError("cfg is required unless resume=True")
        if any((out / name).exists() for name in RUN_FILES):
            raise ValueError(f"out folder {out} already holds a run; resume it (--resume "
                             f"{out}) or choose another folder")
        write_json(cfg_path, cfg.to_dict())
        return cfg, None
    saved = None
    if ckpt_path.exists():
        saved = checkpoint.check(checkpoint.load(ckpt_path), ckpt_path)
        source, data = ckpt_path, saved["config"]
    elif cfg_path.exists():
        source, data = cfg_path, _read_json(cfg_path)
    else:
        raise ValueError(f"no run to resume in {out}: neither {checkpoint.FILENAME} nor "
                         f"{CONFIG} is there")
    try:
        saved_cfg = TrainConfig.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise checkpoint.CheckpointError(f"{source}: its config is not valid: "
                                         f"{type(err).__name__}: {err}") from None
    if cfg is not None and cfg.to_dict() != saved_cfg.to_dict():
        raise ValueError(f"cfg differs from the config saved in {source}; pass cfg=None to "
                         "resume with the saved one")
    if saved is not None and cfg_path.exists():
        _check_same_run(saved_cfg, ckpt_path, cfg_path)
    if saved is not None:
        it, step = saved["state"]["iteration"], saved["state"]["global_step"]
        if it > saved_cfg.n_iterations or step != it * saved_cfg.run.batch_size:
            raise checkpoint.CheckpointError(
                f"{ckpt_path}: field 'state.iteration' ({it}) or 'state.global_step' ({step}) "
                f"does not fit a run of {saved_cfg.n_iterations} iterations of "
                f"{saved_cfg.run.batch_size} steps")
        ranks = saved.get("ranks")
        if saved_cfg.world_size > 1 and (not isinstance(ranks, list)
                                         or len(ranks) != saved_cfg.world_size):
            raise checkpoint.CheckpointError(f"{ckpt_path}: field 'ranks' must hold the state "
                                             f"of each of its {saved_cfg.world_size} ranks")
    return saved_cfg, saved


#: What makes two runs different runs: a checkpoint must agree with its folder's config.json
#: on these (the run's length and checkpoint interval may differ; they are the saved ones).
SAME_RUN = ("stage", "run.n_envs", "run.n_steps", "run.seed", "run.value_head", "run.spec",
            "run.ppo", "world_size")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    return {k: v for key, value in data.items()
            for k, v in _flat(value, f"{prefix}.{key}" if prefix else str(key)).items()}


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or CheckpointError naming the file (torn, not JSON, or
    JSON of another shape)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise checkpoint.CheckpointError(f"{path} is not valid JSON (torn or edited: {err})"
                                         ) from None
    if not isinstance(data, dict):
        raise checkpoint.CheckpointError(f"{path} holds a JSON {type(data).__name__}, not a "
                                         "run config object")
    return data


def _check_same_run(saved_cfg: TrainConfig, ckpt_path: Path, cfg_path: Path) -> None:
    """Refuse a checkpoint that belongs to another run than the folder's ``config.json`` (a
    copied or misplaced file would mix two runs' metrics and models), naming the field."""
    recover = (f"(the checkpoint holds its own config: to resume it, delete or restore "
               f"{cfg_path})")
    try:
        folder = TrainConfig.from_dict(_read_json(cfg_path)).to_dict()
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise checkpoint.CheckpointError(f"{cfg_path}: not a valid run config "
                                         f"({type(err).__name__}: {err}) {recover}") from None
    ours, theirs = _flat(saved_cfg.to_dict()), _flat(folder)
    for key in sorted(set(ours) | set(theirs)):
        same_run_field = any(key == f or key.startswith(f + ".") for f in SAME_RUN)
        if same_run_field and ours.get(key) != theirs.get(key):
            raise checkpoint.CheckpointError(
                f"{ckpt_path} belongs to another run: its {key} is {ours.get(key)!r}, "
                f"{cfg_path} says {theirs.get(key)!r}; a checkpoint copied from another run "
                f"folder, or an edited config.json {recover}")


def train(cfg: TrainConfig | None, out: str | Path, *, resume: bool = False,
          progress: bool = True, stop_after: int | None = None,
          tensorboard: str | Path | None = None, debug_checks: bool = False) -> dict[str, Any]:
    """Train, writing ``out/config.json``, ``out/metrics.jsonl``, ``out/checkpoint.pt`` and
    ``out/summary.json`` (and TensorBoard scalars to ``tensorboard`` if given).

    ``resume=True`` continues the run saved in ``out`` with its saved config (``cfg`` must be
    None or equal to it), from its checkpoint or, if it died before the first one, from its
    start. ``stop_after`` ends the run early after that iteration (counted from the run's
    start), with a checkpoint. Ctrl-C, SIGTERM and SIGHUP save the state of the last finished
    iteration, close the logs and raise :class:`TrainingInterrupted` (further signals wait for
    the save); before the first iteration they raise :class:`labkit.signals.Stop`, and a
    config.json written is kept for a resume. A signal that something swallows (a torch.compile
    guard clears any error) stops the run at the end of that iteration. A non-finite loss or a
    write error raises :class:`TrainingFailed` saying where the last good state is; so does a
    NaN or inf that ``debug_checks`` (the debug module's finite-ness checks, also on with
    ``LABKIT_DEBUG=1``) finds. The folder is locked while training: a second process writing
    to it gets a clear error. Returns the summary (also written to summary.json).

    Under torchrun every process calls this; rank 0 alone checks and writes the folder, and
    checkpoints hold every rank's envs (a stop signal keeps the last scheduled checkpoint:
    ranks stopped mid-iteration cannot agree on a newer one).
    """
    if isinstance(out, bool) or not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be a folder path (str or Path), got {type(out).__name__}")
    if stop_after is not None:
        check_int("stop_after", stop_after, 1)
    group = join(_device_type(cfg, Path(out), resume))
    try:  # a stop before the loop (the build, a compile) is a KeyboardInterrupt out of here
        with debug.enable(debug_checks or debug.enabled()), stop_signals():
            return _train(cfg, Path(out), resume, progress, stop_after, tensorboard, group)
    finally:
        leave(group)


def _device_type(cfg: TrainConfig | None, out: Path, resume: bool) -> str:
    """The type of device the run trains on, known before any rank talks to another: from
    ``cfg``, or for ``resume`` from the run's config.json (every rank sees the folder). Where
    that cannot be read, "auto"'s choice; rank 0 then reports what is wrong with the folder."""
    device = cfg.device if cfg is not None else "auto"
    if cfg is None and resume:
        try:
            saved = json.loads((out / CONFIG).read_text(encoding="utf-8")).get("device")
            device = saved if isinstance(saved, str) and _device_syntax_ok(saved) else device
        except (OSError, ValueError, AttributeError):
            pass
    try:
        return resolve_device(device).type
    except ValueError:  # CUDA named but absent: check_runnable says so in one line
        return "cpu"


def _train(cfg: TrainConfig | None, out: Path, resume: bool, progress: bool,
           stop_after: int | None, tensorboard: str | Path | None, group: Group
           ) -> dict[str, Any]:
    lock, saved, failure = None, None, None
    if group.is_main:
        try:
            if cfg is not None:
                check_runnable(cfg, group)
            if resume and not any((out / name).exists() for name in RUN_FILES):
                raise ValueError(f"no run to resume in {out}: neither {checkpoint.FILENAME} "
                                 f"nor {CONFIG} is there")
            out = check_output_dir(out, "--resume" if resume else "--out")
            if tensorboard is not None:
                check_output_dir(tensorboard, "--tensorboard")
                TensorBoardSink.check_installed()
            _check_run_files(out)
            lock = FolderLock(out).acquire()
            _remove_stale_temporaries(out)
            cfg, saved = _open_run(cfg, out, resume)
        except (ValueError, OSError) as err:
            if lock is not None:
                lock.release()
            if group.world == 1:
                raise
            failure = err
    shared = group.broadcast(None if failure is not None or not group.is_main else
                             (cfg.to_dict(), saved is not None))
    if failure is not None:
        raise failure
    if shared is None:
        raise ValueError("rank 0 could not start the run (its error is in its output)")
    if not group.is_main:
        cfg = TrainConfig.from_dict(shared[0])
        saved = checkpoint.load(out / checkpoint.FILENAME) if shared[1] else None
    try:
        return _run(cfg, saved, out, progress, stop_after, tensorboard, group)
    finally:
        if lock is not None:
            lock.release()


def _check_run_files(out: Path) -> None:
    """Each name the run writes is a file or free: a folder (or a device) in its place is
    refused at the door, naming it, before the lock is taken or anything is read."""
    for name in (*RUN_FILES, SUMMARY, FolderLock.NAME):
        path = out / name
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise ValueError(f"{path} is {kind}; a run writes a file there: move it away")


def _remove_stale_temporaries(out: Path) -> None:
    """Delete what an atomic write killed mid-way left (``.checkpoint.pt.XXXX.tmp``: each a
    whole checkpoint's size). Only with the folder locked: no other writer can own them."""
    for name in (*RUN_FILES, SUMMARY):
        for tmp in out.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


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
        self.first_iter_s: float | None = None
        self.t_start = self.session_s = 0.0

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
            payload = {"config": self.cfg.to_dict(), "device": str(self.device),
                       "threads": torch.get_num_threads(),
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
                f"interrupted by {signal.Signals(signum).name}; {self.where()}", signum,
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
            "config": self.cfg.to_dict(),
        }


def _start_of(cfg: TrainConfig, saved: dict | None, out: Path, device: torch.device) -> int:
    """The iteration the run goes on from: 0, or the checkpoint's (refused on another kind of
    device), with torch's intra-op thread count set to the one the checkpoint was written
    with. A complete run's checkpoint gives its last iteration: nothing left to train, and
    its summary is written again from that checkpoint and the metrics."""
    if saved is None:
        return 0
    if torch.device(saved["device"]).type != device.type:
        raise ValueError(f"{out / checkpoint.FILENAME} was written on {saved['device']}; resume "
                         f"it on the same kind of device (got {device}): the sampling "
                         "generator's state is device-specific")
    if isinstance(saved.get("threads"), int) and saved["threads"] != torch.get_num_threads():
        # CPU kernels may split a reduction by thread: the same count resumes bit for bit
        torch.set_num_threads(saved["threads"])
    return saved["state"]["iteration"]


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


def _show(bar: Any, record: dict, steps: int) -> None:
    bar.update(steps)
    if record["episodes"]:
        bar.set_postfix(ret=f"{record['mean_return']:.2f}", sps=f"{record['sps']:.0f}")


def _run(cfg: TrainConfig, saved: dict | None, out: Path, progress: bool,
         stop_after: int | None, tensorboard: str | Path | None, group: Group
         ) -> dict[str, Any]:
    from tqdm.auto import tqdm

    device = check_runnable(cfg, group)
    start = _start_of(cfg, saved, out, device)
    if start == cfg.n_iterations and (out / SUMMARY).exists():  # nothing left to do
        return {**json.loads((out / SUMMARY).read_text(encoding="utf-8")),
                "already_complete": True}
    kept = _read_metrics(out / METRICS, start) if group.is_main else []
    end = cfg.n_iterations if stop_after is None else max(start, min(stop_after,
                                                                     cfg.n_iterations))
    with contextlib.ExitStack() as resources:
        pipe = resources.enter_context(build_pipeline(cfg, device, group))
        if saved is not None:
            _load(pipe, saved, group, out / checkpoint.FILENAME)
        if group.is_main and (saved is not None or (out / METRICS).exists()):
            write_jsonl(out / METRICS, kept)
        session = _Session(cfg, out, device, group, pipe, saved, kept, start)
        session.open_logs(resources, out, tensorboard)
        steps = session.steps_per_iteration
        bar = resources.enter_context(tqdm(
            total=cfg.n_iterations * steps, initial=start * steps, unit="step",
            unit_scale=True, desc=f"train {cfg.stage}", disable=not (progress and group.is_main)))
        session.t_start = time.perf_counter()
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
    if group.is_main:
        _write_summary(out, summary, restored=start == end)
    return summary


def _write_summary(out: Path, summary: dict[str, Any], restored: bool) -> None:
    """summary.json, a stop signal waiting for it (the run is done). If it cannot be written,
    say what is safe and how to get it: the finished run is in checkpoint.pt."""
    try:
        with signals_deferred(reraise=False):
            write_json(out / SUMMARY, summary)
    except OSError as err:
        raise TrainingFailed(
            f"could not write {out / SUMMARY}: {describe_os_error(err)}. The finished run is "
            f"safe in {out / checkpoint.FILENAME} and {out / METRICS}; free space, then "
            f"python -m labkit train --resume {out} writes the summary") from None
    if restored:
        summary["summary_restored"] = True
