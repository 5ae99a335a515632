"""``python -m labkit {ladder,train,bench-env,record,report,profile,doctor,rehearse,watch,
plot-runs}``.

User errors (a bad flag value, an unusable output path, a bad checkpoint) print one line
``error: ...`` naming the field or path and exit 2, before any work starts. Faults of the
machine during work (a full disk) print one line saying what failed and where the finished work
is, and exit 1. Ctrl-C, SIGTERM and SIGHUP keep what finished and exit 128 + the signal.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .flags import (
    check_environment,
    choices,
    default_stage_note,
    device_flag,
    field_flag,
    finite_float,
    int_at_least,
    non_negative_int,
    path,
    positive_int,
    stage,
    stage_flags,
)


def _planted(args: argparse.Namespace) -> tuple:
    """The doctor's and the rehearsal's stage (with --plant's regression) and run config."""
    from ..config import RunConfig
    from ..doctor.checkup import DOCTOR_COMPILE, DOCTOR_CONV_MATH
    from ..doctor.plants import plant

    chosen = plant(args.stage, args.plant) if args.plant else args.stage
    return chosen, RunConfig(n_envs=args.n_envs, n_steps=args.n_steps, compile=DOCTOR_COMPILE,
                             conv_math=DOCTOR_CONV_MATH)


TRAIN_OPTIONS = ("stage", "device", "n_envs", "n_steps", "total_steps", "seed", "value_head",
                 "model", "compile", "conv_math", "checkpoint_every")


def cmd_train(args: argparse.Namespace) -> int:
    """Map the flags to a run; :func:`labkit.app.train.train` judges it (once) and trains."""
    from ..distributed import current
    from .train import NewFolder, TrainConfig, train

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
              tensorboard=args.tensorboard, debug_checks=args.debug)
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


def _one_line(text: object) -> str:
    """A message on one line (torch's errors span several), an echoed value of 200 characters
    or more cut to its start and its length (a 100,000-character flag, say)."""
    return re.sub(r"\S{200,}", lambda m: f"{m.group()[:60]}... ({len(m.group()):,} characters)",
                  " ".join(str(text).split()))


def _num(value: float | None, spec: str) -> str:
    """A figure for people; "n/a" for a missing one (NaN, or null in a JSON summary)."""
    return "n/a" if value is None or value != value else format(value, spec)


def cmd_plot_runs(args: argparse.Namespace) -> int:
    from ..book.plots import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out, oracle=args.oracle)}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ..config import RunConfig
    from ..device import resolve_device
    from ..measure.profiling import profile_stage
    from ..stages import default_stage

    device = resolve_device(args.device)
    print(profile_stage(args.stage or default_stage(device),
                        RunConfig(n_envs=args.n_envs, n_steps=args.n_steps), device, args.out,
                        iterations=args.iterations, top=args.top))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """``diagnose`` a stage: 0 without findings, 1 with findings."""
    import json

    from ..doctor import diagnose

    chosen, cfg = _planted(args)
    report = diagnose(chosen, iterations=args.iterations, cfg=cfg, device=args.device)
    print(json.dumps(report.to_dict()) if args.json else report.format())
    return 1 if report.findings else 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    from ..doctor.rehearsal import rehearse_stage

    if args.device != "cpu":
        raise ValueError(f"--device must be cpu, got {args.device!r}: a rehearsal stands in "
                         "for CUDA on the CPU; with a GPU, run the stage itself (python -m "
                         "labkit doctor --stage 8 --device cuda)")
    report = rehearse_stage(*_planted(args), iterations=args.iterations)
    print(report)
    return 0 if report.ok else 1


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ``error: ...`` (exit 2), like every other."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog.removeprefix('python -m labkit ')}: "
                     f"{_one_line(message)}\n")


def _add_train(sub) -> None:
    from ..config import COMPILE_CHOICES, CONV_MATH_CHOICES, RunConfig
    from ..policy import BODIES, VALUE_HEADS
    from .train import TrainConfig

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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="a torch.profiler trace of steady-state iterations")
    device_flag(p)
    p.add_argument("--stage", type=stage, default=None,
                   help=f"{choices()} ({default_stage_note()})")
    p.add_argument("--n-envs", type=positive_int, default=64, help="N (default: %(default)s)")
    p.add_argument("--n-steps", type=positive_int, default=32, help="T (default: %(default)s)")
    p.add_argument("--iterations", type=int_at_least(1, 100), default=1,
                   help="iterations traced, after one warmup; the trace keeps every event, "
                        "so at most 100 (default: %(default)s)")
    p.add_argument("--top", type=positive_int, default=15, help="rows of the top-ops table")
    p.add_argument("--out", type=path, default="runs/profile", help="folder for the trace")
    p.set_defaults(func=cmd_profile)


def _add_doctor(sub) -> None:
    from ..doctor import DOCTOR_RUN
    from ..stages import REFERENCE_STAGE

    p = sub.add_parser(
        "doctor", help="run a few iterations under the meters and report regressions",
        description="Run a stage for a few iterations under the sync meter, a function watch, a "
                    "memory tracker and dynamo's counters; print what regressed and the "
                    "chapter with the fix. Exit 0 without findings, 1 with, 2 on a usage error.")
    device_flag(p)
    stage_flags(p, REFERENCE_STAGE, choices(), **DOCTOR_RUN)
    p.add_argument("--iterations", type=int_at_least(2, 10_000), default=5,
                   help="timed iterations, 2 to 10,000 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print {"findings": [...], ...}')
    p.set_defaults(func=cmd_doctor)


def _add_rehearse(sub) -> None:
    from ..stages import STAGES

    p = sub.add_parser(
        "rehearse", help="rehearse a stage's CUDA graph captures on the CPU",
        description="Capture and replay a stage's CUDA graphs on the CPU "
                    "(labkit.doctor.rehearsal): report what a real capture would refuse "
                    "(host reads, data-dependent ops, unregistered generators, host tensors) "
                    "and whether the replays compute what the stage without graphs computes, "
                    "bit for bit. No speed is measured. Exit 0 when capturable and equal, 1 "
                    "otherwise, 2 on a usage error.")
    stage_flags(p, STAGES[-1].name, "a stage with CUDA graphs", n_envs=16, n_steps=16)
    p.add_argument("--device", default="cpu", help="cpu (the rehearsal's only device)")
    p.add_argument("--iterations", type=int_at_least(1, 10_000), default=2,
                   help="iterations rehearsed (default: %(default)s)")
    p.set_defaults(func=cmd_rehearse)


def _add_plot_runs(sub) -> None:
    p = sub.add_parser("plot-runs", help="learning curves of train runs (steps and wall time)")
    p.add_argument("runs", type=path, nargs="+", help="train --out folders")
    p.add_argument("--oracle", type=finite_float, default=None,
                   help="draw the oracle's return")
    p.add_argument("--out", type=path, default="results/learning.png", help="PNG to write")
    p.set_defaults(func=cmd_plot_runs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m labkit", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import ladder, record, report, watch

    ladder.add_parsers(sub)  # each command's flags beside its work: bench-env and ladder
    _add_train(sub)
    record.add_parser(sub)
    report.add_parser(sub)
    _add_profile(sub)
    _add_doctor(sub)
    _add_rehearse(sub)
    watch.add_parser(sub)
    _add_plot_runs(sub)
    return parser


def _escape_unprintable() -> None:
    """A path the terminal's encoding cannot show (a non-UTF-8 byte in a file name) is printed
    escaped, never raised: a finished run must not end in an encoding error."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


#: What a command stopped by a signal has kept, where it does not say so itself (train,
#: ladder, bench-env and record keep what finished and say what that is).
KEPT_AFTER_STOP = {"doctor": "it writes no file", "rehearse": "it writes no file",
                   "profile": "a trace is written whole or not at all",
                   "bench-env": "no round had finished; nothing was written",
                   "ladder": "nothing had been measured; nothing was written",
                   "report": "each file it writes is replaced whole or not at all",
                   "plot-runs": "the figure is written whole or not at all",
                   "watch": "the report covers what ran"}


def _out_of_memory(err: BaseException) -> bool:
    """A failed allocation: MemoryError, or torch's (CUDA's "out of memory", the CPU
    allocator's "not enough memory")."""
    text = str(err).lower()
    return isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and (
        "out of memory" in text or "not enough memory" in text))


def _notes(err: BaseException) -> str:
    """What the work said it kept, in the notes it added to ``err`` (``labkit: ...``)."""
    return "".join(f"; {n.removeprefix('labkit: ')}" for n in getattr(err, "__notes__", ()))


def main(argv: list[str] | None = None) -> int:
    """Run one command, and map how it ended to one exit code and at most one line: a user's
    error (ValueError, TypeError) exit 2; the machine's (OSError, a failed allocation) or the
    run's (TrainingFailed) exit 1; a stop signal 128 + n with the line saying what was kept;
    a closed stdout (``| head``) quietly, 128 + SIGPIPE. Commands return their code or raise;
    none computes an exit code from a signal itself."""
    import signal

    from ..distributed import current
    from ..files import describe_os_error
    from ..signals import signum_of, stop_signals
    from .run import TrainingFailed

    command = "labkit"
    try:
        speak = current().is_main  # under torchrun rank 0 alone says it
    except ValueError:  # torchrun's variables are wrong: said below, by every process
        speak = True

    def say(line: str) -> None:
        if speak:
            print(line, file=sys.stderr)

    try:
        with stop_signals():  # from the first line: a signal at any moment stops alike
            _escape_unprintable()
            args = build_parser().parse_args(argv)
            command = args.command
            check_environment()
            return args.func(args)
    except BrokenPipeError:  # the reader went away (labkit ... | head): nothing to say
        _silence_stdout()
        return 128 + signal.SIGPIPE
    except (ValueError, TypeError) as err:
        say(f"error: {_one_line(err)}")
        return 2
    except OSError as err:
        say(f"error: {_one_line(describe_os_error(err))}")
        return 1
    except TrainingFailed as err:
        say(f"error: {_one_line(err)}")
        return 1
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise  # a bug: its traceback is the message
        say(f"error: out of memory in {command}: {_one_line(err)}{_one_line(_notes(err))}")
        return 1
    except KeyboardInterrupt as stop:
        signum = signum_of(stop)
        kept = KEPT_AFTER_STOP.get(command)
        said = getattr(stop, "said", None) or (
            f"interrupted by {signal.Signals(signum).name}: {command} stopped"
            + (f"; {kept}" if kept else ""))
        say(f"\n{said}")
        return 128 + signum


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's own flush at exit would raise again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
