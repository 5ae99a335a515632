"""Metric loggers writing JSON lines: one ``{"step": ..., **values}`` dict per line.

``SyncLogger`` reads every tensor value in the calling thread (``.item()``/``.tolist()``): one
host sync per value, per step, which is the stage-3 bottleneck. ``AsyncLogger`` moves the read
off the hot path (stage 4): ``log`` only snapshots tensors (non-blocking copies into pinned host
memory on CUDA, a clone on CPU) and queues them; a background thread waits for the copies,
converts them to numbers and writes. Both share the interface ``log(step, **values)``,
``flush()``, ``close()`` and the context-manager protocol, so a stage swaps one for the other.

Values are Python numbers (``bool``, ``int``, ``float``, NumPy scalars) or 0-d/1-d tensors on
any device; a 0-d tensor is written as a number, a 1-d tensor as a list.
"""
from __future__ import annotations

import contextlib
import numbers
import os
import queue
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch

from .files import dumps, open_no_follow
from .signals import held

Value = int | float | bool | torch.Tensor
Target = str | os.PathLike | IO[str]

_STOP = object()
_FLUSH = object()


def _open(target: Target, mode: str) -> tuple[IO[str], bool]:
    """Return (stream, owned): a path is opened (and later closed) here, a stream is not."""
    if isinstance(target, (str, os.PathLike)):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        return open_no_follow(target, mode), True
    if callable(getattr(target, "write", None)):
        return target, False
    raise TypeError(f"target must be a path or a text stream, got {type(target).__name__}")


def _check(key: str, value: object) -> object:
    """Validate one value without reading tensor data; NumPy scalars become Python numbers."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"{key}: expected a real number or tensor, got a {value.dtype} "
                            "tensor")
        if value.ndim > 1:
            raise ValueError(f"{key}: expected a 0-d or 1-d tensor, got shape {tuple(value.shape)}")
        return value.detach()
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{key}: expected a number or a tensor, got {type(value).__name__}")


def _check_step(step: object) -> int:
    """The record's step: a Python or NumPy int (a tensor would need a host read to write)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    return int(step)


def _to_python(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _check_not_deleted(stream: IO[str]) -> None:
    """Raise if ``stream``'s file was deleted (or its folder removed) under it: writing on
    would silently write to nowhere."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a StringIO, a socket wrapper): nothing to check
    if os.fstat(fd).st_nlink == 0:
        raise FileNotFoundError(f"the log file {getattr(stream, 'name', '?')} was deleted "
                                "while being written")


def _close_stream(stream: IO[str], owned: bool) -> None:
    if owned:
        stream.close()
    else:
        stream.flush()


class _LoggerBase:
    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class SyncLogger(_LoggerBase):
    """Write each record immediately: one host read per tensor value (the stage-3 way)."""

    def __init__(self, target: Target, mode: str = "w") -> None:
        self._stream, owned = _open(target, mode)
        # Closes (or flushes) the stream at garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, _close_stream, self._stream, owned)

    def log(self, step: int, **values: Value) -> None:
        if not self._finalizer.alive:
            raise ValueError("log() on a closed SyncLogger")
        record = {"step": _check_step(step)}
        for key, value in values.items():
            record[key] = _to_python(_check(key, value))  # host sync per tensor value
        self._stream.write(dumps(record) + "\n")

    def flush(self) -> None:
        """Write buffered records out; raises if the file was deleted meanwhile."""
        if self._finalizer.alive:
            self._stream.flush()
            _check_not_deleted(self._stream)

    def close(self) -> None:
        self._finalizer()


class _Writer:
    """The background thread and its queue. Holds no reference to the AsyncLogger, so an
    unclosed logger can still be garbage-collected (its finalizer then drains this writer).

    Each time the queue runs empty the thread rests up to ``REST_S`` before it takes the next
    record, unless woken (``wake``: a flush, a close, or a ``log`` that finds the queue full),
    so records are written in bursts rather than one wake-up per ``log``. It still takes one
    record at a time, so at most ``max_queue`` wait and one is in its hands. On the 2-core CPU
    it was timed on, a wake-up per record cost the training thread about 110 us per ``log``
    (the writer competing for the GIL and the cores); resting brought that to about 30 us."""

    REST_S = 0.02

    def __init__(self, sinks: list, max_queue: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.wake = threading.Event()
        self.sinks = sinks
        self.error: BaseException | None = None
        self.reported = False  # whether the logger raised self.error to its user
        self.orphaned = False
        self.thread = threading.Thread(target=self._run, name="labkit-async-logger", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is _STOP:
                    return
                # After a failure keep consuming (and dropping) so a blocked producer never hangs.
                if self.error is None:
                    self._handle(item)
            except Exception as exc:
                self.error = exc
            finally:
                self.queue.task_done()
            if self.queue.empty():
                if self.orphaned:
                    self._close_sinks()
                    return
                self.wake.wait(self.REST_S)  # records logged meanwhile wait for the next burst
                self.wake.clear()

    def _handle(self, item: object) -> None:
        if item is _FLUSH:
            for sink in self.sinks:
                sink.flush()
            return
        step, values, events = item
        for event in events:
            event.synchronize()  # the D2H copies of this record have landed in pinned memory
        record = {"step": step, **{k: _to_python(v) for k, v in values.items()}}
        for sink in self.sinks:
            sink.write(record)

    def shutdown(self) -> None:
        """Write everything queued, stop the thread, close (or flush) the stream."""
        if threading.current_thread() is self.thread:
            # A garbage collection on this thread collected the logger: nobody can log any
            # more, and joining ourselves (or a put on a full queue) would hang, so the loop
            # drains what is queued and then stops.
            self.orphaned = True
            return
        self.put(_FLUSH)
        self.put(_STOP)
        self.thread.join()
        self._close_sinks()

    def put(self, item: object) -> None:
        """Queue ``item``; where the queue is full, wake the thread, then wait for room. Flush
        and stop items wake it too: whoever queues them waits for them. A stop signal is not
        raised inside the queue's bookkeeping (:class:`~labkit.signals.held`); the wait for
        room can be stopped."""
        guard, wait = held(), None
        while True:
            try:
                with guard:  # no stop raised between storing the item and counting it
                    self.queue.put(item, block=wait is not None, timeout=wait)
                break
            except queue.Full:  # wake the writer and wait for room, a stop heard each 50 ms
                self.wake.set()
                guard.raise_new()
                wait = 0.05
        if item is _FLUSH or item is _STOP:
            self.wake.set()

    def shutdown_unattended(self) -> None:
        """``shutdown`` at garbage collection or interpreter exit, when nobody will call log()
        or close() again: a writer error is reported on stderr rather than lost."""
        self.shutdown()
        if self.error is not None and not self.reported:
            sys.stderr.write(f"labkit: AsyncLogger writer failed: {self.error!r}; records "
                             "after the failure were not written\n")
            self.reported = True

    def _close_sinks(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                if self.error is None:
                    self.error = exc


class JsonLines:
    """A sink: each record as one JSON line, flushed at once (on the writer thread, off the
    hot path), so a full disk or a deleted file surfaces at the record that failed."""

    def __init__(self, target: Target, mode: str = "w") -> None:
        self.stream, self.owned = _open(target, mode)

    def write(self, record: dict) -> None:
        self.stream.write(dumps(record) + "\n")
        self.stream.flush()
        _check_not_deleted(self.stream)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        _close_stream(self.stream, self.owned)


@contextlib.contextmanager
def quiet_thread_os_errors() -> Iterator[None]:
    """While active, an ``OSError`` that ends a background thread prints no traceback.
    TensorBoard's event-file writer runs in a thread of its own; on a full disk it dies with a
    14-line traceback, and the same error reaches the logger that owns it, which reports it on
    the main thread in one line. Other exceptions still print."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not issubclass(args.exc_type, OSError):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


class TensorBoardSink:
    """A sink: the numeric values of each record as TensorBoard scalars at the record's step
    (``torch.utils.tensorboard``; needs the ``tensorboard`` package). ``purge_step``: a resumed
    run's first new step; TensorBoard hides what an earlier session logged from that step on
    (iterations it ran after its last checkpoint, which the resume runs again)."""

    def __init__(self, log_dir: str | os.PathLike, purge_step: int | None = None) -> None:
        self.check_installed()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    @staticmethod
    def check_installed() -> None:
        """A clear error (before any work) when the tensorboard package is missing."""
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install "
                             "'labkit[tensorboard]'")

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and value == value:
                self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class AsyncLogger(_LoggerBase):
    """Log without host syncs in the calling thread; a daemon thread does the reads and writes.

    ``log`` snapshots tensor values (CUDA: ``copy_(non_blocking=True)`` into pinned host buffers,
    then one CUDA event per device that the writer waits on; CPU: a clone, so later in-place
    updates by the caller do not change what is logged) and puts the record on a bounded queue.
    When ``max_queue`` records are waiting, ``log`` blocks until the writer catches up: this
    backpressure keeps memory (queued records and their pinned buffers) bounded when the
    writer is slower than the training loop.

    ``target`` gets one JSON line per record; ``sinks`` (objects with ``write(record)``,
    ``flush()``, ``close()``, such as :class:`TensorBoardSink`) get every record too, on the
    same background thread. ``close()`` writes every queued record, then stops the thread;
    it is idempotent, and also
    runs when the logger leaves a ``with`` block (exception or not), when it is
    garbage-collected, and at interpreter exit (a ``weakref.finalize``, which does not keep the
    logger alive). If the writer fails, the next ``log``/``flush``/``close`` raises a
    ``RuntimeError`` chained from the writer's exception; records after the failure are lost.
    """

    def __init__(self, target: Target | None, max_queue: int = 1024, mode: str = "w",
                 sinks: tuple = ()) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int):
            raise TypeError(f"max_queue must be an int >= 1, got {type(max_queue).__name__}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        all_sinks = ([JsonLines(target, mode)] if target is not None else []) + list(sinks)
        self._writer = _Writer(all_sinks, max_queue)
        self._finalizer = weakref.finalize(self, self._writer.shutdown_unattended)

    @property
    def pending(self) -> int:
        """Items waiting in the queue (never more than ``max_queue``)."""
        return self._writer.queue.qsize()

    def log(self, step: int, **values: Value) -> None:
        self._raise_writer_error()
        if not self._finalizer.alive:
            raise ValueError("log() on a closed AsyncLogger")
        step = _check_step(step)
        snapshot: dict[str, object] = {}
        cuda_devices: set[torch.device] = set()
        for key, value in values.items():
            value = _check(key, value)
            if isinstance(value, torch.Tensor):
                if value.is_cuda:
                    staging = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    staging.copy_(value, non_blocking=True)
                    cuda_devices.add(value.device)
                    value = staging
                else:  # a clone on CPU; other accelerators (MPS, XPU) copy synchronously
                    value = value.to("cpu", copy=True)
            snapshot[key] = value
        events = []
        for device in cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        self._writer.put((step, snapshot, events))  # blocks while the queue is full

    def flush(self) -> None:
        """Block until every record logged so far is written and the stream is flushed."""
        self._raise_writer_error()
        if not self._finalizer.alive:
            return
        self._writer.put(_FLUSH)
        self._writer.queue.join()
        self._raise_writer_error()

    def close(self) -> None:
        self._shutdown()
        self._raise_writer_error()

    def _shutdown(self) -> None:
        if self._finalizer.detach() is not None:  # still open: the caller is here to be told
            self._writer.shutdown()

    def _raise_writer_error(self) -> None:
        error = self._writer.error
        if error is not None and not self._writer.reported:
            self._writer.reported = True
            self._shutdown()
            raise RuntimeError(f"AsyncLogger writer thread failed: {error!r}") from error
