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

from .flags import check_environment


def _one_line(text: object) -> str:
    """A message on one line (torch's errors span several), an echoed value of 200 characters
    or more cut to its start and its length (a 100,000-character flag, say)."""
    return re.sub(r"\S{200,}", lambda m: f"{m.group()[:60]}... ({len(m.group()):,} characters)",
                  " ".join(str(text).split()))


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ``error: ...`` (exit 2), like every other."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog.removeprefix('python -m labkit ')}: "
                     f"{_one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m labkit", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import doctor, ladder, plot_runs, profile, record, report, train, watch

    # the table of commands: each defines its flags beside its work
    ladder.add_parsers(sub)  # bench-env, bench-update, bench-sb3 and ladder
    train.add_parser(sub)
    record.add_parser(sub)
    report.add_parser(sub)
    profile.add_parser(sub)
    doctor.add_parsers(sub)  # doctor and rehearse
    watch.add_parser(sub)
    plot_runs.add_parser(sub)
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
