"""Writing files so that nothing is ever half-written: one atomic-write helper for JSON, JSON
lines and checkpoints alike."""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a uniquely named temporary file beside ``path``; on a clean exit flush, fsync and
    rename it over ``path`` (one file system, so the rename is atomic). On any error, or a
    KeyboardInterrupt, the temporary file is removed and ``path`` is untouched."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows, where folders cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _plain(obj: Any) -> Any:
    """NaN and infinities become null: bare ``NaN`` is not JSON, and other tools reject it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """Standard JSON (``allow_nan=False``; non-finite floats written as null)."""
    return json.dumps(_plain(obj), allow_nan=False, **kwargs)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically."""
    with atomic_write(path) as f:
        f.write(dumps(data, indent=2) + "\n")
    return Path(path)


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> Path:
    """Write ``records`` as JSON lines, atomically."""
    with atomic_write(path) as f:
        f.writelines(dumps(r) + "\n" for r in records)
    return Path(path)
