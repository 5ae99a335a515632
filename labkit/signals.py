"""Stopping cleanly: Ctrl-C, SIGTERM and SIGHUP end long work the same way, keeping what it
finished, and a save in progress is never cut short by a second signal."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: Signals that stop work the way Ctrl-C does: keep what finished, exit 128 + the signal.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class Stop(KeyboardInterrupt):
    """A stop signal, raised in the main thread; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signum_of(stop: BaseException) -> int:
    """The signal behind a KeyboardInterrupt (SIGINT for a plain one)."""
    return getattr(stop, "signum", signal.SIGINT)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Inside: SIGINT, SIGTERM and SIGHUP raise :class:`Stop` (a KeyboardInterrupt). Outside
    the main thread signals cannot be handled, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stop(signum)

    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred(reraise: bool = True) -> Iterator[list[int]]:
    """Inside: stop signals are only recorded (a save in progress must finish). After the
    block, the first one is raised as :class:`Stop` (``reraise=False``: only recorded, for a
    block that is itself on the way out after a stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    pending: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum))
           for s in STOP_SIGNALS}
    try:
        yield pending
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if pending and reraise:
        raise Stop(pending[0])
