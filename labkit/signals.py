"""Stopping cleanly: Ctrl-C, SIGTERM and SIGHUP end long work the same way, keeping what it
finished, and a save in progress is never cut short by a second signal.

A stop is raised where the signal lands, and it is also remembered: code that swallows every
exception cannot lose it. torch.compile's guards are such code (a guard whose Python check
raises is cleared and counted as failed), so a Ctrl-C that lands in one would vanish; the
loops of labkit call :func:`raise_if_stopped` at each iteration's end and stop there."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: Signals that stop work the way Ctrl-C does: keep what finished, exit 128 + the signal.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class Stop(KeyboardInterrupt):
    """A stop signal, raised in the main thread; ``signum`` says which. Work that stopped and
    kept something raises it again with ``said``: the line that says what was kept (what the
    CLI prints before it exits 128 + the signal)."""

    def __init__(self, signum: int, said: str | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.said = signum, said


#: The signals caught by each open :func:`stop_signals` block, innermost last.
_caught: list[list[int]] = []
#: Above 0 inside :func:`held` blocks: a stop is recorded there, and raised when they end.
_held = [0]


def _heard() -> list[int]:
    """The stop signals this process does not ignore: one ignored when labkit starts was
    ignored on purpose (``nohup`` ignores SIGHUP, so that closing the terminal does not stop
    the run; a shell starts a background job with SIGINT ignored) and stays ignored."""
    return [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]


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

    caught: list[int] = []

    def stop(signum: int, frame: object) -> None:
        caught.append(signum)
        if not _held[0]:
            raise Stop(signum)

    _caught.append(caught)
    old: dict = {}
    try:
        for s in _heard():
            old[s] = signal.signal(s, stop)
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _caught[:] = [c for c in _caught if c is not caught]  # by identity, not equality


class held:  # noqa: N801 - a context manager, cheap enough for every log call
    """Inside: a stop signal is recorded, not raised; one that arrived inside is raised as
    the block ends (or by :meth:`raise_new`, where it ended in an exception). For bookkeeping
    a raise mid-way would corrupt (``queue.Queue.put`` between storing an item and counting
    it: the writer thread that takes it later dies on "task_done() called too many times").
    Nothing that can block long belongs inside."""

    def __init__(self) -> None:
        self.main = threading.get_ident() == threading.main_thread().ident  # signals land there
        self.seen = len(_caught[-1]) if _caught and self.main else 0

    def __enter__(self) -> None:
        if self.main:
            _held[0] += 1

    def __exit__(self, *exc: object) -> None:
        if self.main:
            _held[0] -= 1
            if exc[0] is None:
                self.raise_new()

    def raise_new(self) -> None:
        """Raise a stop that arrived since this guard was made (none: nothing)."""
        if self.main and not _held[0] and _caught and len(_caught[-1]) > self.seen:
            raise Stop(_caught[-1][-1])


def raise_if_stopped() -> None:
    """Raise :class:`Stop` if the innermost :func:`stop_signals` block caught a signal whose
    stop never arrived (something between the handler and the caller swallowed it). Called
    where a loop can stop cleanly: the end of an iteration, of a timing round."""
    if _caught and _caught[-1]:
        raise Stop(_caught[-1][0])


@contextlib.contextmanager
def signals_deferred(reraise: bool = True) -> Iterator[list[int]]:
    """Inside: stop signals are only recorded (a save in progress must finish). After the
    block, the first one is raised as :class:`Stop` (``reraise=False``: only recorded, for a
    block that is itself on the way out after a stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    pending: list[int] = []
    old: dict = {}
    try:
        for s in _heard():
            old[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
        yield pending
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if pending and reraise:
        raise Stop(pending[0])


@contextlib.contextmanager
def default_stop_signals() -> Iterator[None]:
    """Inside: the stop signals do what they do by default, end the process, in the main
    thread (elsewhere signals are not this thread's to set): for a wait that cannot hear a
    raised stop (a C++ rendezvous, ``labkit.distributed``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_DFL) for s in _heard()}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
