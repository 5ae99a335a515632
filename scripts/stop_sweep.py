"""Land a real SIGTERM at every Nth line the main thread runs during a training iteration, and
check that each stop ends the run as it must: ``TrainingInterrupted`` (exit 143 from the CLI)
within a bound, the async logger's writer thread gone and no thread dead of an exception, the
checkpoint loadable.

A stop can land between any two bytecodes; the one CI hang after SIGTERM (a run still going
120 s after the signal) was never reproduced by sending the signal at random moments, so this
script sends it at chosen ones: a trace function counts the line events of the third
iteration (stage async_logging, the one that logs 17 records an iteration through its queue),
then each trial raises the signal at the k-th of them (``signal.raise_signal``: the installed
handler runs at that line). A trial that does not end within ``--bound`` seconds has every
thread's stack dumped and the sweep exits 1.

    python scripts/stop_sweep.py                 # 400 landing points spread over an iteration
    python scripts/stop_sweep.py --points 2000   # denser
    python scripts/stop_sweep.py --points 100000 --files queue.py threading.py
                                                 # every line of the queue's bookkeeping
"""
from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from labkit.app import checkpoint, session  # noqa: E402
from labkit.app.run import TrainingInterrupted  # noqa: E402
from labkit.app.train import TrainConfig, train  # noqa: E402

CFG = dict(stage="async_logging", device="cpu", n_envs=4, n_steps=16, total_steps=64 * 6,
           checkpoint_every=0)


class Lander:
    """Counts the main thread's line events from the end of iteration 2; at ``target`` (if
    set) raises SIGTERM there."""

    def __init__(self, target: int | None, files: tuple[str, ...]) -> None:
        self.target, self.count, self.armed, self.fired = target, 0, False, False
        self.where = ""  # the line it landed at
        self.files = files  # count only lines of files whose path ends so (empty: every file)

    def trace(self, frame, event, arg):
        return self.line if self.armed and not self.fired else None

    def line(self, frame, event, arg):
        if event == "line" and self.armed and not self.fired and (
                not self.files or frame.f_code.co_filename.endswith(self.files)):
            self.count += 1
            if self.count == self.target:
                self.fired = True
                self.where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
                signal.raise_signal(signal.SIGTERM)
        return self.line if not self.fired else None


def trial(target: int | None, bound: float, files: tuple[str, ...] = ()
          ) -> tuple[str, int, str]:
    """One run stopped at line event ``target`` of iteration 3 (None: not stopped; returns
    how many line events iteration 3 had, and where the stop landed), counting the lines of
    ``files`` only."""
    lander = Lander(target, files)
    keep = session.Session.keep

    def keep_and_arm(self, record):
        keep(self, record)
        if record["iteration"] == 2:
            lander.armed = True
        elif record["iteration"] == 3 and not lander.fired:  # iteration 3 ended: stop tracing
            lander.armed, lander.fired = False, True

    session.Session.keep = keep_and_arm
    died: list[str] = []
    hook, threading.excepthook = threading.excepthook, lambda a: died.append(
        f"{a.thread.name if a.thread else '?'} died: {a.exc_type.__name__}: {a.exc_value}")
    faulthandler.dump_traceback_later(bound, exit=True)
    sys.settrace(lander.trace)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            try:
                train(TrainConfig.flat(**CFG), out, progress=False)
                outcome = "finished" if target is None else "not landed"
            except TrainingInterrupted as stop:
                outcome = f"stopped ({signal.Signals(stop.signum).name})"
                if (out / checkpoint.FILENAME).exists():
                    checkpoint.load(out / checkpoint.FILENAME)
            left = [t.name for t in threading.enumerate() if t.name == "labkit-async-logger"]
            if left:
                outcome += f"; writer threads left: {len(left)}"
            outcome += "".join(f"; {d}" for d in died)
            if not torch.is_grad_enabled():  # a with-block's __enter__ cut short: no __exit__
                outcome += "; grad mode left off"
                torch.set_grad_enabled(True)  # for the trials after this one
    finally:
        sys.settrace(None)
        threading.excepthook = hook
        faulthandler.cancel_dump_traceback_later()
        session.Session.keep = keep
    return outcome, lander.count, lander.where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=400)
    parser.add_argument("--bound", type=float, default=300.0,
                        help="seconds a trial may take before it counts as a hang")
    parser.add_argument("--files", nargs="*", default=[],
                        help="land only on lines of files whose path ends so (queue.py ...)")
    args = parser.parse_args()
    files = tuple(args.files)
    outcome, lines, _ = trial(None, args.bound, files)
    print(f"iteration 3 runs {lines:,} lines in the main thread"
          f"{' in ' + ', '.join(files) if files else ''} ({outcome} unstopped)", flush=True)
    targets = sorted({1 + round(i * (lines - 1) / max(args.points - 1, 1))
                      for i in range(args.points)})
    bad, missed, start = [], 0, time.perf_counter()
    for k in targets:
        outcome, _, where = trial(k, args.bound, files)
        if outcome == "not landed":  # this run's iteration 3 ran fewer lines there
            missed += 1
        elif outcome != "stopped (SIGTERM)":
            bad.append((k, outcome))
            print(f"line event {k}: {outcome} (landed at {where})", flush=True)
    print(f"{len(targets) - len(bad) - missed} of {len(targets) - missed} landing points stop "
          f"as they must ({missed} not reached: iteration 3 ran fewer lines; "
          f"{time.perf_counter() - start:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
