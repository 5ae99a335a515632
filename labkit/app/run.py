"""What a training run is: its config (:class:`TrainConfig`), its folder, and the one door
that judges both.

:func:`open_run` is the only place a run is validated. A new run: the config's device is
resolved and the stage checked on it (it exists, the stage can run there, the run fits in
memory, the world size is torchrun's) before anything is written; then the folder (writable,
its file names free, not holding a run), the TensorBoard folder, the lock, and
``config.json``. A resumed run: the folder first (a run is there, its files are files), the
lock, the saved config from ``checkpoint.pt`` or, before the first checkpoint, from
``config.json`` (the same-run check between the two), then the device and the stage, the
resume point and the metrics kept. Under torchrun, rank 0 judges and the others receive the
config it settled on. :class:`Run` holds what the door found, the lock included, and writes
what belongs to the folder (the metrics kept on resume, the summary).

Files in ``OUT``: ``config.json``, ``metrics.jsonl`` (one line per iteration),
``checkpoint.pt``, ``summary.json``, ``.lock`` while a process trains there.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..device import parse_device, resolve_device
from ..distributed import SINGLE, Group
from ..executors import CompiledIfFaster
from ..files import (
    FolderLock,
    check_output_dir,
    describe_os_error,
    is_dir,
    no_links,
    read_json,
    read_json_object,
    read_jsonl,
    unique_folder,
    write_json,
    write_jsonl,
)
from ..logging import TensorBoardSink
from ..signals import signals_deferred
from ..stages import default_stage, get_stage
from . import checkpoint
from .train_config import TrainConfig

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
#: A folder holding any of these holds a run.
RUN_FILES = (CONFIG, METRICS, checkpoint.FILENAME)


@dataclass(frozen=True)
class NewFolder:
    """A new run folder, named by ``time.strftime(pattern)`` (``-2``, ``-3``... when taken)
    once the run is judged valid: what ``train`` writes to when given no folder."""

    pattern: str = "runs/train-%Y%m%d-%H%M%S"

    def __str__(self) -> str:
        return f"a new folder {self.pattern}"


class TrainingInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) during training; the message says what was kept
    (the state of the last finished iteration, or before the first one the run's config) and
    ``out`` is the run folder to resume."""

    def __init__(self, message: str, signum: int = signal.SIGINT,
                 checkpoint_path: Path | None = None, iteration: int | None = None,
                 out: Path | None = None) -> None:
        super().__init__(message)
        self.signum, self.checkpoint_path, self.iteration = signum, checkpoint_path, iteration
        self.out = out if out is not None else (checkpoint_path.parent if checkpoint_path
                                                else None)
        self.said = message  # what the CLI prints (labkit.signals.Stop's ``said``)


class TrainingFailed(RuntimeError):
    """Training stopped on a fault of the run or the machine (a non-finite loss, a full
    disk); the message says what happened and where the last good state is."""


@dataclass
class Run:
    """A run that passed the door: its config, folder and device, where it goes on from, and
    the folder's lock (released by :meth:`close`). ``saved`` is the checkpoint's payload (None
    for a new run or one that died before its first checkpoint), ``start`` its iteration,
    ``kept`` the metrics records of iterations 1..start (rank 0), ``finished`` the summary of
    a run already complete."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    group: Group = SINGLE
    saved: dict | None = None
    start: int = 0
    kept: list[dict] = field(default_factory=list)
    finished: dict | None = None
    lock: FolderLock | None = None

    @property
    def checkpoint_path(self) -> Path:
        return self.out / checkpoint.FILENAME

    def keep_metrics(self) -> None:
        """On resume, ``metrics.jsonl`` keeps iterations 1..start only (a crash after a
        checkpoint logged later ones, which run again, or half a line); rank 0 writes."""
        if self.group.is_main and (self.saved is not None or (self.out / METRICS).exists()):
            write_jsonl(self.out / METRICS, self.kept)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, a stop signal waiting for it (the run is done). If it cannot be
        written, say what is safe and how to get it: the finished run is in checkpoint.pt."""
        if not self.group.is_main:
            return
        try:
            with signals_deferred(reraise=False):
                write_json(self.out / SUMMARY, summary)
        except OSError as err:
            raise TrainingFailed(
                f"could not write {self.out / SUMMARY}: {describe_os_error(err)}. The finished "
                f"run is safe in {self.checkpoint_path} and {self.out / METRICS}; free space, "
                f"then python -m labkit train --resume {self.out} writes the summary") from None

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_type(cfg: TrainConfig | None, out: Path, resume: bool) -> str:
    """The type of device a torchrun run trains on, known before any rank talks to another
    (the process group's backend depends on it): from ``cfg``, or for ``resume`` from the
    run's config.json (every rank sees the folder). Where that cannot be read, "auto"'s
    choice; rank 0's door then reports what is wrong with the folder."""
    device = cfg.device if cfg is not None else "auto"
    if cfg is None and resume:
        try:
            saved = _config_json(out).get("device")
            device = saved if parse_device(saved) is not None else device
        except (OSError, ValueError, TypeError):
            pass
    try:
        return resolve_device(device).type
    except ValueError:  # CUDA named but absent: the door says so in one line
        return "cpu"


def open_run(cfg: TrainConfig | None, out: str | Path | NewFolder, *, resume: bool = False,
             tensorboard: str | Path | None = None, group: Group = SINGLE) -> Run:
    """The one door of a run (module docstring): judge ``cfg`` and the folder ``out`` (a new
    run, or ``resume`` the one there, with its saved config: ``cfg`` must then be None or
    equal to it; a :class:`NewFolder` is made once the config passed) and return the
    :class:`Run`, its folder locked. ValueError (a user's error) or OSError before anything is
    written for a new run; under torchrun rank 0's error ends every rank."""
    out = out if isinstance(out, NewFolder) else Path(out)
    failure, found = None, None
    if group.is_main:
        try:
            found = _judged(cfg, out, resume, tensorboard, group)
        except (ValueError, OSError) as err:
            if group.world == 1:
                raise
            failure = err
    # rank 0's settled config, as the object (pickled by torch.distributed), to every rank
    shared = group.broadcast(None if failure is not None or not group.is_main else
                             (found.cfg, found.saved is not None))
    if failure is not None:
        raise failure
    if shared is None:
        raise ValueError("rank 0 could not start the run (its error is in its output)")
    if not group.is_main:
        saved = checkpoint.load(out / checkpoint.FILENAME) if shared[1] else None
        cfg, device = _settled(shared[0], group)
        found = Run(cfg, out, device, group, saved)
    try:
        _go_on_from(found)
    except BaseException:
        found.close()
        raise
    return found


def _settled(cfg: TrainConfig, group: Group) -> tuple[TrainConfig, torch.device]:
    """``cfg`` with its stage named (the device's default where it names none) and the device
    it trains on (this rank's GPU under torchrun): resolved once, the stage checked there (it
    runs, it fits in memory), the world size torchrun's."""
    device = group.device(resolve_device(cfg.device))
    if cfg.stage is None:
        cfg = replace(cfg, stage=default_stage(device))
    get_stage(cfg.stage).check(device, cfg.run)  # StageSkipped, a ValueError
    if cfg.world_size != group.world:
        raise ValueError(f"world_size is {cfg.world_size} in the config but torchrun started "
                         f"{group.world} process(es); resume a run with as many as it had")
    return cfg, device


def _judged(cfg: TrainConfig | None, out: Path | NewFolder, resume: bool,
            tensorboard: str | Path | None, group: Group) -> Run:
    """Rank 0's judgement (see :func:`open_run`), in the order that writes nothing until
    the run is known to be valid; the folder is locked when it returns."""
    if not resume:
        if cfg is None:
            raise ValueError("cfg is required unless resume=True")
        cfg, device = _settled(cfg, group)
    elif isinstance(out, NewFolder) or not is_dir(out, "--resume"):
        raise ValueError(f"--resume {out}: no such run folder")
    elif not any((out / name).exists() for name in RUN_FILES):
        raise ValueError(f"no run to resume in {out}: neither {checkpoint.FILENAME} nor "
                         f"{CONFIG} is there")
    if tensorboard is not None:  # refused before the run folder is made
        TensorBoardSink.check_installed()
        if not isinstance(out, NewFolder):
            _check_board(Path(tensorboard), out)
        check_output_dir(tensorboard, "--tensorboard")
    if isinstance(out, NewFolder):
        out = unique_folder(out.pattern)
    out = check_output_dir(out, "--resume" if resume else "--out")
    _check_run_files(out)
    lock = FolderLock(out).acquire()
    try:
        _remove_stale_temporaries(out)
        if not resume:
            if any((out / name).exists() for name in RUN_FILES):
                raise ValueError(f"out folder {out} already holds a run; resume it (--resume "
                                 f"{out}) or choose another folder")
            if (out / SUMMARY).exists():  # no run's files: someone else's summary.json
                raise ValueError(f"out folder {out} holds a {SUMMARY} that no run there wrote; "
                                 "a new run would overwrite it: move it or choose another "
                                 "folder")
            write_json(out / CONFIG, cfg.to_dict())  # a run that dies now can be resumed
            return Run(cfg, out, device, group, lock=lock)
        saved_cfg, saved = _saved_run(cfg, out)
        saved_cfg, device = _settled(saved_cfg, group)
        return Run(saved_cfg, out, device, group, saved, lock=lock)
    except BaseException:
        lock.release()
        raise


def _check_board(board: Path, out: Path) -> None:
    """``--tensorboard`` may not be, or lie under, a file the run writes in its folder: it
    would be made a folder there (and left behind) before the run refused it."""
    board, out = board.resolve(), out.resolve()
    for name in (*RUN_FILES, SUMMARY, FolderLock.NAME):
        if board == out / name or out / name in board.parents:
            raise ValueError(f"--tensorboard {board} is {name} of the run folder {out}, or "
                             "inside it: the run writes that file; give TensorBoard a folder "
                             "of its own")


def _saved_run(cfg: TrainConfig | None, out: Path) -> tuple[TrainConfig, dict | None]:
    """The saved run's config and its checkpoint payload (None: it died before the first
    checkpoint and resumes from its start), each checked against the other."""
    ckpt_path, cfg_path = out / checkpoint.FILENAME, out / CONFIG
    saved = None
    if ckpt_path.exists():
        saved = checkpoint.check(checkpoint.load(ckpt_path), ckpt_path)
        source, data = ckpt_path, saved["config"]
    else:
        source, data = cfg_path, _config_json(out)
    saved_cfg = _config_in(data, source)
    if cfg is not None and cfg.to_dict() != saved_cfg.to_dict():
        raise ValueError(f"cfg differs from the config saved in {source}; pass cfg=None to "
                         "resume with the saved one")
    if saved is not None:
        if cfg_path.exists():
            _check_same_run(saved_cfg, ckpt_path, cfg_path)
        _check_fits(saved, saved_cfg, ckpt_path)
    return saved_cfg, saved


def _check_fits(saved: dict, cfg: TrainConfig, ckpt_path: Path) -> None:
    """The checkpoint's iteration, step and ranks fit its own config."""
    it, step = saved["state"]["iteration"], saved["state"]["global_step"]
    if it > cfg.n_iterations or step != it * cfg.run.batch_size:
        raise checkpoint.CheckpointError(
            f"{ckpt_path}: field 'state.iteration' ({it}) or 'state.global_step' ({step}) "
            f"does not fit a run of {cfg.n_iterations} iterations of "
            f"{cfg.run.batch_size} steps")
    ranks = saved.get("ranks")
    if cfg.world_size > 1 and (not isinstance(ranks, list) or len(ranks) != cfg.world_size):
        raise checkpoint.CheckpointError(f"{ckpt_path}: field 'ranks' must hold the state "
                                         f"of each of its {cfg.world_size} ranks")


def _go_on_from(run: Run) -> None:
    """Where ``run`` goes on from: iteration 0, or the checkpoint's (refused on another kind
    of device, with torch's intra-op thread count set to the checkpoint's: CPU kernels may
    split a reduction by thread, and the same count resumes bit for bit), the metrics kept
    up to it and the checkpoint's choices of model math checked against the stage, or the
    summary of a run already complete."""
    saved = run.saved
    if saved is None:
        run.kept = _read_metrics(run.out / METRICS, 0) if run.group.is_main else []
        return
    if torch.device(saved["device"]).type != run.device.type:
        raise ValueError(f"{run.checkpoint_path} was written on {saved['device']}; resume it "
                         f"on the same kind of device (got {run.device}): the sampling "
                         "generator's state is device-specific")
    if isinstance(saved.get("threads"), int) and saved["threads"] != torch.get_num_threads():
        torch.set_num_threads(saved["threads"])
    run.start = saved["state"]["iteration"]
    if run.start == run.cfg.n_iterations and (run.out / SUMMARY).exists():
        try:
            run.finished = read_json(run.out / SUMMARY)
            if not isinstance(run.finished, dict):
                raise ValueError(f"a JSON {type(run.finished).__name__}, not an object")
            steps = run.finished.get("steps")
            if type(steps) is not int or steps < 0:
                raise ValueError(f"its field 'steps' is {steps!r}, not a whole number >= 0")
        except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
            raise ValueError(f"{run.out / SUMMARY} is not the summary a run writes ({err}); "
                             "delete it and --resume writes it again") from None
        return
    run.kept = _read_metrics(run.out / METRICS, run.start) if run.group.is_main else []
    _check_choices(saved, run.cfg, run.checkpoint_path)


def _check_choices(saved: dict, cfg: TrainConfig, ckpt_path: Path) -> None:
    """The checkpoint's choices fit the stage that trains: ``executor_choices`` (absent in a
    checkpoint from before runs chose) names exactly the parts the stage chooses for (its
    ``CompiledIfFaster`` slots), and ``conv_choices`` are made only where the agent has the
    conv body (the ladder's agent has it unless the run's model is another body)."""
    stage = get_stage(cfg.stage)
    chooses = sorted(part for part, executor in (("rollout", stage.rollout_executor),
                                                 ("update", stage.update_executor))
                     if isinstance(executor, CompiledIfFaster))
    made = saved.get("executor_choices")
    if made is not None and sorted(made) != chooses:
        raise checkpoint.CheckpointError(
            f"{ckpt_path}: field 'executor_choices' names {sorted(made)}, but stage "
            f"{stage.name} chooses for {chooses}")
    if saved.get("conv_choices") and cfg.run.model != "conv":
        raise checkpoint.CheckpointError(
            f"{ckpt_path}: field 'conv_choices' names how convolutions run, but the agent "
            f"of stage {stage.name} has no conv body")


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        yield from read_jsonl(path)
    except ValueError as err:  # a line that is not JSON: damage, not a crash
        raise ValueError(f"{err}; repair or delete that line, then resume") from None


def _read_metrics(path: Path, keep_through: int) -> list[dict]:
    """The records of iterations 1..``keep_through`` in ``path``. A crash after a checkpoint
    may have logged later iterations (they will run again) or half a last line (no newline
    ends it): both are dropped. Any other bad line is damage, not a crash: an error."""
    if not path.exists():
        return []
    kept: list[dict] = []
    for number, record in _records(path):
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            raise ValueError(f"{path} line {number} is not a metrics record (a JSON object "
                             "with an integer iteration); repair or delete that line, then "
                             "resume")
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


#: What makes two runs different runs: a checkpoint that disagrees with its folder's
#: config.json on these is another run's; on any other field (the run's length, its checkpoint
#: interval) the config.json was edited, which a resume refuses too.
SAME_RUN = ("stage", "run.n_envs", "run.n_steps", "run.seed", "run.value_head", "run.model",
            "run.compile", "run.spec", "run.ppo", "world_size")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    return {k: v for key, value in data.items()
            for k, v in _flat(value, f"{prefix}.{key}" if prefix else str(key)).items()}


def _config_json(out: Path) -> dict:
    """The object in ``out``'s config.json (the one reader of that file); CheckpointError
    naming it where it is torn, not JSON, or not an object."""
    return read_json_object(out / CONFIG, "a run config object", checkpoint.CheckpointError)


def _config_in(data: dict, source: Path, advice: str = "") -> TrainConfig:
    """The run config ``data`` read from ``source``, or CheckpointError naming the file."""
    try:
        return TrainConfig.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise checkpoint.CheckpointError(f"{source}: its config is not valid: "
                                         f"{type(err).__name__}: {err}{advice}") from None


def _check_same_run(saved_cfg: TrainConfig, ckpt_path: Path, cfg_path: Path) -> None:
    """Refuse a checkpoint that belongs to another run than the folder's ``config.json`` (a
    copied or misplaced file would mix two runs' metrics and models), naming the field."""
    recover = (f"(the checkpoint holds its own config: to resume it, delete or restore "
               f"{cfg_path})")
    folder = _config_in(_config_json(cfg_path.parent), cfg_path, f" {recover}").to_dict()
    ours, theirs = _flat(saved_cfg.to_dict()), _flat(folder)
    derived = ("n_iterations", "run.lr_horizon")  # computed: name what was edited first
    for key in sorted(set(ours) | set(theirs), key=lambda k: (k in derived, k)):
        if ours.get(key) == theirs.get(key):
            continue
        if any(key == f or key.startswith(f + ".") for f in SAME_RUN):
            raise checkpoint.CheckpointError(
                f"{ckpt_path} belongs to another run: its {key} is {ours.get(key)!r}, "
                f"{cfg_path} says {theirs.get(key)!r}; a checkpoint copied from another run "
                f"folder, or an edited config.json {recover}")
        raise ValueError(  # the run's length, say: a resume would not honour the edit
            f"{cfg_path} says {key} {theirs.get(key)!r}, but the run in {ckpt_path} has "
            f"{ours.get(key)!r}: a resumed run keeps the config it started with, so an edited "
            f"config.json is refused rather than ignored; restore it to resume, or start a "
            "new run")


def _check_run_files(out: Path) -> None:
    """Each name the run writes is a file or free: a symbolic link (dangling or not), a
    folder or a device in its place is refused at the door, naming it, before the lock is
    taken or anything is read."""
    no_links(out, (*RUN_FILES, SUMMARY, FolderLock.NAME))
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
            if tmp.is_dir() and not tmp.is_symlink():
                raise ValueError(f"{tmp} is a folder named like a temporary file an "
                                 "interrupted write leaves (labkit deletes those when a run "
                                 "starts): move it out of the run folder")
            tmp.unlink(missing_ok=True)

