"""``python -m labkit watch [--function NAME] [--json] (script.py | -m module) [args]``: run a
reader's script under :class:`labkit.doctor.watch.watch`, like ``python -m cProfile``, and
print the report when it ends, also when it raises or is stopped (the script's own error
first). ``--function NAME`` (``name`` or ``Class.method``) watches each call of that function
as one iteration, and only inside it; without it the whole script is watched, in totals. The
exit code is the script's."""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..doctor.watch import WatchReport, watch


class _EachCall:
    """A profile hook that enters ``w`` at each outermost call of a function named ``name``
    and leaves it, one iteration, when that call returns (or raises)."""

    def __init__(self, w: watch, name: str) -> None:
        self.w, self.name = w, name
        self.short = name.rsplit(".", 1)[-1]
        self.frame: Any = None
        self.seen: dict[Any, str] = {}  # code -> "file:line (qualname)"

    def matches(self, code: Any) -> bool:
        if code.co_name != self.short:
            return False
        qual = getattr(code, "co_qualname", code.co_name)
        return "." not in self.name or qual == self.name or qual.endswith("." + self.name)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and self.frame is None and self.matches(frame.f_code):
            code = frame.f_code
            self.seen.setdefault(code, f"{code.co_filename}:{code.co_firstlineno} "
                                       f"({getattr(code, 'co_qualname', code.co_name)})")
            self.frame = frame
            self.w.__enter__()
        elif event == "return" and frame is self.frame:
            self.frame = None
            self.w.__exit__(None, None, None)
            self.w.step()

    def close(self) -> None:
        if self.frame is not None:  # stopped inside the function
            self.frame = None
            self.w.__exit__(None, None, None)
            self.w.step()


def watch_script(target: str, args: list[str], *, module: bool = False,
                 function: str | None = None, say=print,
                 show: Callable[[WatchReport], None] | None = None
                 ) -> tuple[WatchReport | None, int]:
    """Run ``target`` (a script path, or a module name with ``module``) with ``args`` as its
    ``sys.argv[1:]`` under a watch; (the report, the script's exit code); the report is None in
    a child process the script forked. ``show`` prints a report: where the script ends with
    ``os._exit`` (no Python cleanup after it) it is called before the process ends. ValueError
    for a script that does not exist or a function name that is not a name."""
    _check_target(target, module, function)
    w = watch()
    hook = _EachCall(w, function) if function is not None else None  # each call an iteration
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    parent, forks, real_exit = os.getpid(), len(_FORKS), os._exit
    done: list[WatchReport] = []

    def finish() -> WatchReport:
        """Stop watching (once) and say what was seen."""
        if done:
            return done[0]
        removed = False
        if hook is not None:
            removed = sys.getprofile() is not hook  # the script set its own (or none)
            sys.setprofile(None)
            hook.close()
        elif w in watch._active:
            w.__exit__(None, None, None)
        os._exit = real_exit
        sys.argv, sys.path[:] = saved_argv, saved_path
        done.append(report := w.report())
        if len(_FORKS) > forks:
            report.notes.insert(0, f"the script forked {len(_FORKS) - forks} process(es): "
                                   "only this one is watched")
        if hook is not None:
            report.notes[:0] = _hook_notes(hook, function, removed)
        return report

    def hard_exit(status: int) -> None:
        """``os._exit`` in the script: the report first (no Python cleanup follows), in the
        process that was watched; a forked child just exits."""
        if os.getpid() == parent and show is not None:
            report = finish()
            report.notes.insert(0, f"the script ended with os._exit({status}): the report "
                                   "covers what ran before it")
            show(report)
        real_exit(status)

    os._exit = hard_exit
    code = _run(target, module, w.__enter__ if hook is None else partial(sys.setprofile, hook),
                say)
    report = finish()
    return (report if os.getpid() == parent else None), code


def _check_target(target: str, module: bool, function: str | None) -> None:
    """ValueError, naming it, for a function name that is not a name or a script that is a
    folder or missing (a module that cannot be found: :func:`_check_module`)."""
    if function is not None and not all(part.isidentifier() for part in function.split(".")):
        raise ValueError(f"--function must be a function name or Class.method, got "
                         f"{function!r}")
    if module:
        _check_module(target)
    elif Path(target).is_dir():
        raise ValueError(f"script {target!r} is a folder, not a file (a package: -m NAME)")
    elif not Path(target).is_file():
        raise ValueError(f"script {target!r}: no such file")


def _run(target: str, module: bool, start: Callable[[], None], say) -> int:
    """``start`` the watch, then run the script as ``__main__``; its exit code: its own exit's,
    130 for Ctrl-C, 1 for an error (printed as Python would)."""
    try:
        start()
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:  # the script's own exit: its code
        if not isinstance(stop.code, (int, type(None))):
            say(str(stop.code), file=sys.stderr)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        say("\nthe script was interrupted; the report covers what ran", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - the script's error, printed as Python would
        traceback.print_exc()
        return 1
    return 0


def _hook_notes(hook: _EachCall, function: str, removed: bool) -> list[str]:
    """What a ``--function`` watch says of its hook: replaced by the script, never called, or
    matching several functions."""
    if removed:
        return [f"--function {function}: the script replaced labkit's profile hook "
                "(sys.setprofile), so calls after that were not watched "
                f"({len(hook.seen)} function(s) of that name seen before)"]
    if not hook.seen:
        return [f"--function {function}: the script never called a function of that name; "
                "nothing was watched"]
    if len(hook.seen) > 1:
        return [f"--function {function} matched {len(hook.seen)} functions, each call of any "
                "one an iteration: " + "; ".join(hook.seen.values())]
    return []


#: One entry per fork of this process (os.register_at_fork): a watched script that forks is
#: said to have, and its children print no report of their own.
_FORKS: list[int] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=lambda: _FORKS.append(1))


def _check_module(name: str) -> None:
    """A ValueError, in one line, for a module ``-m`` cannot run: none of that name, or a
    name that is not a module's."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:  # a parent package missing, an empty name
        raise ValueError(f"module {name!r}: {err}") from None
    if found is None:
        raise ValueError(f"module {name!r}: no such module")


# ------------------------------------------------------------------ the command


def cmd_watch(args: argparse.Namespace) -> int:
    """The script's exit code, after the report."""
    def show(report: WatchReport) -> None:
        sys.stdout.flush()
        print(report.to_json() if args.json else report.format(), flush=True)

    report, code = watch_script(args.target, args.args, module=args.module,
                                function=args.function, show=show)
    if report is not None:  # None: a child the script forked, which says nothing
        show(report)
    return code


def add_parser(sub) -> None:
    p = sub.add_parser(
        "watch", help="run your own script under labkit's meters and report what they saw",
        description="Run a script (or -m module) under labkit.watch, like python -m cProfile: "
                    "host reads (device reads, a sync each on a GPU, apart from host-scalar "
                    "reads), factories without device=, copies, clones, ops, compiles and "
                    "memory, each at its file:line with the chapter that teaches the fix. "
                    "The report is printed when the script ends, raises or is stopped; the "
                    "exit code is the script's.")
    p.add_argument("--function", default=None, metavar="NAME",
                   help="a function (name or Class.method) whose every call is one iteration; "
                        "only its calls are watched (default: the whole script, in totals)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-m", dest="module", action="store_true",
                   help="TARGET is a module, run as python -m TARGET")
    p.add_argument("target", metavar="TARGET", help="the script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=cmd_watch)


