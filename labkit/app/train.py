"""Train PPO on Forage with one stage's pipeline, on the CPU or a GPU, with checkpoints; and
``python -m labkit train``, its flags and the line it prints.

The loop is only bookkeeping around :class:`labkit.stages.Pipeline` (the one rollout and
update): per iteration it runs ``pipeline.iteration()``, and its
:class:`labkit.app.session.Session` reads the update statistics once, appends a line to
``OUT/metrics.jsonl`` and keeps a device-side copy of the state at the iteration boundary.
Every ``checkpoint_every`` iterations, at the end, and on Ctrl-C, that state goes to
``OUT/checkpoint.pt`` (atomically); ``train(None, OUT, resume=True)`` continues the
same run bit-exactly on the same device. The learning rate anneals over the whole run.

Files in ``OUT``: ``metrics.jsonl`` (one line per iteration), ``checkpoint.pt``,
``summary.json``. The stage's own per-step logger writes to a temporary folder: it is part of
the stage's workload (what the ladder times), not the training record.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from .. import debug
from ..capture import warmup
from ..config import (
    CAPTURE_UNITS,
    COMPILE_CHOICES,
    COMPILE_UNITS,
    CONV_MATH_CHOICES,
    OBS_STORAGES,
    RunConfig,
)
from ..distributed import SINGLE, Group, current, join, leave
from ..policy import BODIES, VALUE_HEADS
from ..signals import raise_if_stopped, signals_deferred, signum_of, stop_signals
from ..stages import PARTS, Pipeline, PipelineState
from ..validate import check_int
from . import checkpoint, remembered
from .flags import field_flag, non_negative_int, path, positive_int, stage
from .run import (
    CONFIG,
    NewFolder,
    Run,
    TrainingFailed,
    TrainingInterrupted,
    device_type,
    open_run,
)
from .session import Session
from .train_config import TrainConfig

__all__ = ["NewFolder", "TrainConfig", "TrainingFailed", "TrainingInterrupted",
           "build_pipeline", "train"]


def build_pipeline(cfg: TrainConfig, device: torch.device, group: Group = SINGLE) -> Pipeline:
    """The stage's pipeline for ``cfg`` (its LR annealed over ``cfg.n_iterations``)."""
    return Pipeline(cfg.stage, cfg.run, device, group=group)


def train(cfg: TrainConfig | None, out: str | Path | NewFolder, *, resume: bool = False,
          progress: bool = True, stop_after: int | None = None,
          tensorboard: str | Path | None = None, debug_checks: bool = False,
          remember_choices: bool = True) -> dict[str, Any]:
    """Train, writing ``out/config.json``, ``out/metrics.jsonl``, ``out/checkpoint.pt`` and
    ``out/summary.json`` (and TensorBoard scalars to ``tensorboard`` if given);
    ``out=NewFolder()``: a new ``runs/train-<date>-<time>`` folder, made once the run is
    judged valid.

    ``resume=True`` continues the run saved in ``out`` with its saved config (``cfg`` must be
    None or equal to it), from its checkpoint or, if it died before the first one, from its
    start. The run is judged once, by :func:`labkit.app.run.open_run`. ``stop_after`` ends the
    run early after that iteration (counted from the run's start), with a checkpoint. A stage
    that compiles only where it pays keeps what the last run like this one timed at warm-up
    (``remember_choices=False``: times it again; :mod:`labkit.app.remembered`). Ctrl-C,
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
    _check_arguments(cfg, out, stop_after, remember_choices)
    group = current()
    if group.world > 1:  # the process group's backend depends on the device type
        if isinstance(out, NewFolder):
            raise ValueError("--out is required under torchrun: every rank must name the "
                             "same run folder")
        group = join(device_type(cfg, Path(out), resume))
    run, grad = None, torch.is_grad_enabled()
    try:
        with debug.enable(debug_checks or debug.enabled()), stop_signals():
            with open_run(cfg, out, resume=resume, tensorboard=tensorboard,
                          group=group) as run:
                if run.finished is not None:
                    return {**run.finished, "already_complete": True, "out": str(run.out)}
                summary = _run(run, progress, stop_after, tensorboard, remember_choices)
                return {**summary, "out": str(run.out)}
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt as stop:  # before the loop: a build, a compile, the door
        where = run.out if run is not None else (
            None if isinstance(out, NewFolder) else Path(out))
        raise TrainingInterrupted(_stopped_before_training(stop, where), signum_of(stop),
                                  out=where) from None
    finally:
        # torch's grad mode as it was: a stop that lands inside a `with torch.no_grad()` block's
        # __enter__ or __exit__ (Python code, between switching the mode and returning) skips
        # the switch back, and grad would stay off for the rest of the process (a notebook's
        # kernel: the next run fails in its first backward). scripts/stop_sweep.py found it.
        torch.set_grad_enabled(grad)
        leave(group)


def _check_arguments(cfg: Any, out: Any, stop_after: Any, remember_choices: Any) -> None:
    """train()'s arguments of the wrong type or range: a clear error naming each."""
    if cfg is not None and not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig (TrainConfig.flat(n_envs=8, ...)) or None "
                        f"with resume=True, got {type(cfg).__name__}")
    if isinstance(out, bool) or not isinstance(out, (str, os.PathLike, NewFolder)):
        raise TypeError(f"out must be a folder path (str or Path), got {type(out).__name__}")
    if stop_after is not None:
        check_int("stop_after", stop_after, 1)
    if not isinstance(remember_choices, bool):
        raise TypeError(f"remember_choices must be True or False, got "
                        f"{type(remember_choices).__name__}")


def _stopped_before_training(stop: BaseException, out: Path | None) -> str:
    """What a stop before the first iteration of this session kept, and how to go on."""
    how = f"interrupted by {signal.Signals(signum_of(stop)).name} before training"
    hint = f"\ncontinue with: python -m labkit train --resume {out}"
    if out is not None and (out / checkpoint.FILENAME).exists():
        return f"{how} resumed; {out / checkpoint.FILENAME} is unchanged{hint}"
    if out is not None and (out / CONFIG).exists():  # the same command again is refused
        return f"{how} started; {out} holds the run's config and nothing trained yet{hint}"
    return f"{how} started; nothing saved"


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
                      remember: bool = True) -> None:
    """Settle what a stage that compiles only where it pays keeps: a resumed run keeps what
    its checkpoint says (the same kernels, the same numbers; the door checked that its
    choices fit the stage); a new one what the last run like it timed (``remember``:
    :mod:`labkit.app.remembered`), or else a warmup times eager against compiled, and where
    the stage chooses them the convolutions' conv2d against matmul (off the clock, undone; a
    forced ``compile`` or ``conv_math`` needs none), and remembers them. Under torchrun every
    rank keeps rank 0's choices. A checkpoint from before runs chose ran compiled, and its
    convolutions conv2d."""
    model = pipe.math
    if saved is not None:
        made = saved.get("executor_choices", {part: {"kept": "compiled",
                                                     "why": "as the run began"}
                                              for part in model.choices})
        model.keep_choices(made)
        convs = saved.get("conv_choices") or (
            {part: {"kept": "conv2d", "why": "as the run began"} for part in PARTS}
            if model.chooses_conv_math else {})
        if convs:
            model.keep_conv_math(convs)
    elif set(model.choices) - set(model.executor_choices) or (
            model.chooses_conv_math and not model.conv_choices):
        # rank 0's memory for every rank: ranks that time must all time (their warm-up
        # iterations all-reduce together), and nodes need not share a cache
        known = group.broadcast(remembered.recall(pipe) if remember and group.is_main else None)
        if known is not None:
            model.keep_choices(known[0])
            if known[1]:
                model.keep_conv_math(known[1])
        warmup(pipe)  # compiles off the clock (and times what is not remembered), undone
        if known is None and group.is_main:
            remembered.remember(pipe)
    if group.world > 1 and model.choices:
        model.keep_choices(group.broadcast(model.executor_choices))
    if group.world > 1 and model.conv_choices:
        model.keep_conv_math(group.broadcast(model.conv_choices))


def start_line(cfg: TrainConfig, pipe: Pipeline) -> str:
    """What a run prints as it starts: the stage, device, precision and, where the stage
    chooses, what runs its model math and why."""
    line = f"train: {cfg.stage} on {pipe.device}, {pipe.precision.describe()}"
    math = pipe.math.describe()
    return line + (f"; {math}" if math else "")


def _show(bar: Any, record: dict, steps: int) -> None:
    bar.update(steps)
    if record["episodes"]:
        bar.set_postfix(ret=f"{record['mean_return']:.2f}", sps=f"{record['sps']:.0f}")


def _run(run: Run, progress: bool, stop_after: int | None,
         tensorboard: str | Path | None, remember: bool = True) -> dict[str, Any]:
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
        _choose_executors(pipe, run.saved, group, remember)
        run.keep_metrics()
        session = Session(run, pipe)
        session.open_logs(resources, tensorboard)
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


# ------------------------------------------------------------------ the command


TRAIN_OPTIONS = ("stage", "device", "n_envs", "n_steps", "total_steps", "seed", "value_head",
                 "model", "compile", "compile_unit", "capture_unit", "obs_storage", "conv_math",
                 "checkpoint_every")


def cmd_train(args: argparse.Namespace) -> int:
    """Map the flags to a run; :func:`train` judges it (once) and trains."""
    given = {k: getattr(args, k) for k in TRAIN_OPTIONS if getattr(args, k) is not None}
    if args.resume:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(f"--resume continues the run with its saved config; drop {flags}")
        if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ValueError("--resume continues the run in its own folder; drop --out or "
                             "give the same folder")
    group = current()  # under torchrun: this process's rank (every rank runs this command)
    cfg = None if args.resume else TrainConfig.flat(**given, world_size=group.world)
    s = train(cfg, args.resume or args.out or NewFolder(), resume=bool(args.resume),
              progress=not args.no_progress, stop_after=args.stop_after,
              tensorboard=args.tensorboard, debug_checks=args.debug,
              remember_choices=not args.fresh_choices)
    out = s["out"]
    if not group.is_main:
        return 0
    if s.get("already_complete"):
        print(f"the run in {out} is already complete ({s['steps']:,} steps); nothing to do")
    elif s.get("summary_restored"):
        print(f"the run in {out} was complete ({s['steps']:,} steps) without its summary; "
              f"wrote {Path(out) / 'summary.json'} from its final checkpoint and metrics")
    else:
        print(f"trained {s['steps']:,} steps ({s['stage']} on {s['device']}, "
              + (f"{s['precision']}, " if s.get("precision") else "")
              + "".join(f"{part} {made['kept']}, " for part, made
                        in (s.get("executor_choices") or {}).items())
              + "".join(f"{part} convolutions {made['kept']}, " for part, made
                        in (s.get("conv_choices") or {}).items())
              + f"{s['threads']} CPU thread(s)) in {s['wall_s']:.0f} s, after this "
              f"session's {s['setup_s']:.1f} s set-up: "
              f"final mean return {_num(s['final_mean_return'], '.2f')}, "
              f"{_num(s['steps_per_s'], ',.0f')} steps/s this session"
              + (f" over {s['world_size']} processes" if s["world_size"] > 1 else "")
              + f"; wrote {out}")
    return 0


def _num(value: float | None, spec: str) -> str:
    """A figure for people; "n/a" for a missing one (NaN, or null in a JSON summary)."""
    return "n/a" if value is None or value != value else format(value, spec)


def add_parser(sub) -> None:
    # Flags left unset take the config's defaults, or the resumed run's values.
    p = sub.add_parser("train", help="train PPO on Forage with one stage's pipeline")
    field_flag(p, TrainConfig, "stage", stage)
    field_flag(p, TrainConfig, "device", str)
    field_flag(p, RunConfig, "n_envs", positive_int)
    field_flag(p, RunConfig, "n_steps", positive_int)
    field_flag(p, TrainConfig, "total_steps", positive_int)
    field_flag(p, RunConfig, "seed", non_negative_int)
    field_flag(p, RunConfig, "value_head", str, choices=VALUE_HEADS)
    field_flag(p, RunConfig, "model", str, choices=BODIES)
    field_flag(p, RunConfig, "compile", str, choices=COMPILE_CHOICES)
    field_flag(p, RunConfig, "compile_unit", str, choices=COMPILE_UNITS)
    field_flag(p, RunConfig, "capture_unit", str, choices=CAPTURE_UNITS)
    field_flag(p, RunConfig, "obs_storage", str, choices=OBS_STORAGES)
    field_flag(p, RunConfig, "conv_math", str, choices=CONV_MATH_CHOICES)
    field_flag(p, TrainConfig, "checkpoint_every", non_negative_int)
    p.add_argument("--out", type=path, default=None,
                   help="run folder (default: a new runs/train-<date>-<time>)")
    p.add_argument("--resume", type=path, default=None, metavar="DIR",
                   help="continue the run in DIR (from its checkpoint, or from its start)")
    p.add_argument("--tensorboard", type=path, default=None, metavar="DIR",
                   help="also write the metrics as TensorBoard scalars to DIR")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="K",
                   help="stop after iteration K of the run, with a checkpoint (--resume goes on)")
    p.add_argument("--debug", action="store_true",
                   help="check observations, logits, values, losses and gradients for NaN/inf "
                        "(one host read per check; LABKIT_DEBUG=1 does the same)")
    p.add_argument("--fresh-choices", action="store_true",
                   help="time eager against compiled (and conv2d against matmul) again where "
                        "the stage chooses, instead of keeping what the last run like this one "
                        "timed (kept in $LABKIT_CACHE_DIR, default ~/.cache/labkit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)
