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
    if function is not None and not all(part.isidentifier() for part in function.split(".")):
        raise ValueError(f"--function must be a function name or Class.method, got "
                         f"{function!r}")
    if module:
        _check_module(target)
    elif Path(target).is_dir():
        raise ValueError(f"script {target!r} is a folder, not a file (a package: -m NAME)")
    elif not Path(target).is_file():
        raise ValueError(f"script {target!r}: no such file")
    w, hook = watch(), None
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    code, parent, forks, real_exit = 0, os.getpid(), len(_FORKS), os._exit
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
            if removed:
                report.notes.insert(0, f"--function {function}: the script replaced labkit's "
                                       "profile hook (sys.setprofile), so calls after that "
                                       f"were not watched ({len(hook.seen)} function(s) of "
                                       "that name seen before)")
            elif not hook.seen:
                report.notes.insert(0, f"--function {function}: the script never called a "
                                       "function of that name; nothing was watched")
            elif len(hook.seen) > 1:
                report.notes.insert(0, f"--function {function} matched {len(hook.seen)} "
                                       "functions, each call of any one an iteration: "
                                       + "; ".join(hook.seen.values()))
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
    try:
        if function is None:
            w.__enter__()
        else:
            hook = _EachCall(w, function)
            sys.setprofile(hook)
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:  # the script's own exit: its code
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            say(str(stop.code), file=sys.stderr)
    except KeyboardInterrupt:
        say("\nthe script was interrupted; the report covers what ran", file=sys.stderr)
        code = 130
    except Exception:  # noqa: BLE001 - the script's error, printed as Python would
        traceback.print_exc()
        code = 1
    report = finish()
    return (report if os.getpid() == parent else None), code


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


