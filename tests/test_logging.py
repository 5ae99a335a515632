from __future__ import annotations

import gc
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from labkit.logging import AsyncLogger, SyncLogger
from labkit.measure.syncmeter import SyncMeter
from tests.runs import wait_for

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected(i: int) -> dict:
    return {"step": i, "loss": i * 0.5, "vec": [i, i + 1, i + 2], "lr": 0.1, "ok": i % 2 == 0}


def values_for(i: int, device: str = "cpu") -> dict:
    return {"loss": torch.tensor(i * 0.5, device=device),
            "vec": torch.arange(i, i + 3, device=device), "lr": 0.1,
            "ok": torch.tensor(i % 2 == 0, device=device)}


def log_one(logger, i: int) -> None:
    logger.log(i, **values_for(i))


class GatedStream(io.StringIO):
    """A stream whose write waits until the gate opens: a writer slower than the producer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write(self, s: str) -> int:
        self.gate.wait()
        return super().write(s)


class FailingStream(io.StringIO):
    def __init__(self, ok_writes: int) -> None:
        super().__init__()
        self.ok_writes = ok_writes

    def write(self, s: str) -> int:
        if self.ok_writes == 0:
            raise OSError("disk full")
        self.ok_writes -= 1
        return super().write(s)


@pytest.mark.parametrize("cls", [SyncLogger, AsyncLogger])
def test_records_written_in_order(tmp_path, cls):
    path = tmp_path / "sub" / "log.jsonl"
    with cls(path) as logger:
        for i in range(300):
            log_one(logger, i)
    assert read_lines(path) == [expected(i) for i in range(300)]


def test_async_snapshot_is_not_affected_by_later_in_place_updates():
    stream = io.StringIO()
    total = torch.zeros(())
    with AsyncLogger(stream) as logger:
        for i in range(50):
            total += 1
            logger.log(i, total=total)
    assert [json.loads(s)["total"] for s in stream.getvalue().splitlines()] == list(range(1, 51))


def test_async_flush_writes_everything_logged_so_far():
    stream = io.StringIO()
    logger = AsyncLogger(stream)
    for i in range(100):
        log_one(logger, i)
    logger.flush()
    assert len(stream.getvalue().splitlines()) == 100
    logger.close()
    assert not stream.closed  # a stream passed in belongs to the caller


def test_async_writes_all_records_when_the_body_raises(tmp_path):
    path = tmp_path / "log.jsonl"
    with pytest.raises(KeyError):
        with AsyncLogger(path, max_queue=16) as logger:
            for i in range(200):
                log_one(logger, i)
            raise KeyError("boom")
    assert read_lines(path) == [expected(i) for i in range(200)]


def test_async_close_is_idempotent_and_log_after_close_raises():
    stream = io.StringIO()
    logger = AsyncLogger(stream)
    logger.log(0, x=1.0)
    logger.close()
    logger.close()
    logger.flush()
    assert stream.getvalue() == '{"step": 0, "x": 1.0}\n'
    with pytest.raises(ValueError, match="closed"):
        logger.log(1, x=1.0)


def test_async_writer_error_surfaces_in_main_thread():
    logger = AsyncLogger(FailingStream(ok_writes=5), max_queue=4)
    with pytest.raises(RuntimeError, match="writer thread failed") as info:
        for i in range(50):
            logger.log(i, x=torch.tensor(float(i)))
        logger.flush()
    assert isinstance(info.value.__cause__, OSError)
    assert str(info.value.__cause__) == "disk full"
    logger.close()  # already reported: closing again does not raise


def test_async_writer_error_surfaces_on_close():
    stream = FailingStream(ok_writes=2)
    with pytest.raises(RuntimeError) as info:
        with AsyncLogger(stream) as logger:
            for i in range(3):
                logger.log(i, x=i)
    assert isinstance(info.value.__cause__, OSError)
    assert len(stream.getvalue().splitlines()) == 2


def test_async_queue_is_bounded_and_log_blocks():
    stream = GatedStream()
    logger = AsyncLogger(stream, max_queue=8)
    produced = 0
    max_pending = 0

    def produce() -> None:
        nonlocal produced, max_pending
        for i in range(40):
            logger.log(i, x=torch.tensor(i))
            produced += 1
            max_pending = max(max_pending, logger.pending)

    producer = threading.Thread(target=produce)
    producer.start()
    deadline = time.monotonic() + 5
    while produced < 9 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)
    # The writer holds record 0 (stuck in write), 8 wait in the queue, the 10th log blocks.
    assert produced == 9
    assert producer.is_alive()
    assert logger.pending == 8
    stream.gate.set()
    producer.join(timeout=10)
    logger.close()
    assert max_pending <= 8
    assert [json.loads(s)["x"] for s in stream.getvalue().splitlines()] == list(range(40))


def test_async_logger_collected_on_its_writer_thread_drains_and_stops():
    class CollectingStream(io.StringIO):
        """The first write waits, then runs a GC pass on the writer thread."""

        def __init__(self) -> None:
            super().__init__()
            self.gate = threading.Event()
            self.first = True

        def write(self, s: str) -> int:
            if self.first:
                self.first = False
                self.gate.wait()
                gc.collect()
            return super().write(s)

    stream = CollectingStream()
    gc.disable()  # only the writer thread's explicit pass may collect the logger
    try:
        logger = AsyncLogger(stream)
        logger.cycle = logger  # unreachable after `del`, but only a GC pass frees it
        writer = logger._writer
        for i in range(5):
            logger.log(i, x=i)
        del logger
        stream.gate.set()
        writer.thread.join(timeout=10)
    finally:
        gc.enable()
    assert writer.orphaned  # the finalizer ran on the writer thread
    assert not writer.thread.is_alive()
    assert [json.loads(s)["x"] for s in stream.getvalue().splitlines()] == list(range(5))


def test_async_log_makes_no_host_read_in_calling_thread():
    logger = AsyncLogger(io.StringIO())
    with SyncMeter() as meter:
        for i in range(20):
            log_one(logger, i)
    logger.close()
    assert meter.host_reads == 0


def test_sync_log_reads_each_tensor_value():
    logger = SyncLogger(io.StringIO())
    with SyncMeter() as meter:
        log_one(logger, 0)  # three tensor values, one number
    assert meter.host_reads == 3


@pytest.mark.parametrize("cls", [SyncLogger, AsyncLogger])
def test_bad_values_raise(cls):
    with cls(io.StringIO()) as logger:
        with pytest.raises(ValueError, match="m: expected a 0-d or 1-d tensor"):
            logger.log(0, m=torch.zeros(2, 2))
        with pytest.raises(TypeError, match="s: expected a number"):
            logger.log(0, s=object())
    with pytest.raises(TypeError, match="target"):
        cls(42)
    with pytest.raises(ValueError, match="max_queue"):
        AsyncLogger(io.StringIO(), max_queue=0)


@pytest.mark.slow
def test_async_flushes_at_interpreter_exit(tmp_path):
    path = tmp_path / "log.jsonl"
    script = textwrap.dedent("""
        import sys, time
        import torch
        from labkit.logging import AsyncLogger

        class Slow:
            def __init__(self, f):
                self.f = f
            def write(self, s):
                time.sleep(0.002)
                return self.f.write(s)
            def flush(self):
                self.f.flush()

        out = open(sys.argv[1], "w")
        logger = AsyncLogger(Slow(out), max_queue=1024)
        for i in range(100):
            logger.log(i, x=torch.tensor(float(i)))
        # no close(): the exit hook must drain the queue
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=120)
    assert [r["x"] for r in read_lines(path)] == [float(i) for i in range(100)]


@cuda
def test_async_cuda_values_without_syncs():
    stream = io.StringIO()
    logger = AsyncLogger(stream)
    values = [values_for(i, "cuda") for i in range(20)]  # H2D creation syncs: outside the meter
    torch.cuda.synchronize()
    with SyncMeter(cuda_debug=True) as meter:
        for i, kwargs in enumerate(values):
            logger.log(i, **kwargs)
    logger.close()
    assert meter.host_reads == 0
    assert meter.cuda_syncs == 0
    records = [json.loads(s) for s in stream.getvalue().splitlines()]
    assert records == [expected(i) for i in range(20)]


def test_a_background_thread_dying_of_a_disk_error_prints_no_traceback(monkeypatch):
    """TensorBoard's own writer thread on a full disk: its owner reports the error in one
    line, so the thread itself stays quiet; any other exception still reaches the hook that
    prints it."""
    import errno
    import threading

    from labkit.logging import quiet_thread_os_errors

    printed = []  # stands for the hook in place (Python's prints a traceback)
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_type))

    def run(exc: BaseException) -> None:
        def die() -> None:
            raise exc
        t = threading.Thread(target=die)
        t.start()
        t.join()

    with quiet_thread_os_errors():
        run(OSError(errno.ENOSPC, "No space left on device"))
        assert printed == []
        run(ValueError("a bug"))
        assert printed == [ValueError]
    run(OSError(errno.ENOSPC, "No space left on device"))  # outside: as before
    assert printed == [ValueError, OSError]


# ---------------------------------------------------------------- 14. the logger's errors


class FlushFails(io.StringIO):
    def __init__(self, ok_flushes: int) -> None:
        super().__init__()
        self.ok = ok_flushes

    def flush(self) -> None:
        if self.ok == 0:
            raise OSError(28, "No space left on device")
        self.ok -= 1
        super().flush()


def test_a_writer_error_surfaces_at_the_next_log():
    logger = AsyncLogger(FlushFails(ok_flushes=3))
    for i in range(4):
        logger.log(i, x=i)
    wait_for(lambda: logger._writer.error is not None, 10, "the writer to fail")
    with pytest.raises(RuntimeError, match="No space left"):
        logger.log(4, x=4)


@pytest.mark.slow
def test_a_dropped_logger_reports_its_error_on_stderr(tmp_path):
    script = ("import io\nfrom labkit.logging import AsyncLogger\n"
              "class Bad(io.StringIO):\n"
              "    def write(self, s):\n        raise OSError('disk full')\n"
              "logger = AsyncLogger(Bad())\nlogger.log(1, x=1)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "AsyncLogger writer failed" in r.stderr
    assert "disk full" in r.stderr


@pytest.mark.parametrize("cls", [SyncLogger, AsyncLogger])
def test_a_deleted_log_folder_is_noticed(tmp_path, cls):
    folder = tmp_path / "logs"
    logger = cls(folder / "steps.jsonl")
    logger.log(0, x=1)
    logger.flush()
    shutil.rmtree(folder)
    with pytest.raises((RuntimeError, FileNotFoundError), match="was deleted"):
        for i in range(1, 1000):
            logger.log(i, x=i)
            logger.flush()
    logger.close()
