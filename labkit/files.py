"""Writing files so that nothing is ever half-written: one atomic-write helper for JSON, JSON
lines and checkpoints alike."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# mkstemp creates files readable by their owner only; a results file or checkpoint should get the
# permissions any other new file gets. The umask can only be read by setting it: do it once, here.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a uniquely named temporary file beside ``path``; on a clean exit flush, fsync and
    rename it over ``path`` (one file system, so the rename is atomic). The file keeps the
    permissions of the one it replaces, or gets those of any new file (0o666 less the umask).
    On any error, or a KeyboardInterrupt, the temporary file is removed and ``path`` is
    untouched."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            try:
                permissions = path.stat().st_mode & 0o7777
            except FileNotFoundError:
                permissions = 0o666 & ~_UMASK
            os.chmod(tmp, permissions)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename is None:  # a write: name the file
            kept = "is kept as it was" if path.exists() else "was not written"
            raise OSError(err.errno, f"{err.strerror or err}; {path} {kept}",
                          str(path)) from None
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


def save_figure(figure: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """A matplotlib figure saved atomically, in the format its suffix names: rendered in
    memory, then written through :func:`atomic_write`, so a link at ``path`` is replaced, not
    followed, and a kill never leaves half an image."""
    import io

    buf = io.BytesIO()
    figure.savefig(buf, dpi=dpi, format=Path(path).suffix[1:].lower() or None)
    with atomic_write(path, "wb") as f:
        f.write(buf.getvalue())
    return Path(path)


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


#: The largest JSON file the program reads (its run files and results are far smaller).
JSON_MAX_BYTES = 256 * 2**20


def parse_json(text: str, where: str, error: type[ValueError] = ValueError) -> Any:
    """The one JSON parser for what the program reads: ``error`` naming ``where`` (a file, or
    a file's line) where ``text`` is not JSON or is nested deeper than Python can parse (a
    RecursionError, never a traceback)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{where} is not valid JSON (torn or edited: {err})") from None
    except RecursionError:
        raise error(f"{where} is JSON nested too deeply to read (over "
                    f"{sys.getrecursionlimit()} levels): not a file labkit wrote") from None


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """The lines of a JSON-lines file that a run appends to, each as (its number from 1, its
    value), parsed as they are asked for (a reader that stops early reads no further); blank
    lines are passed over. A line that is not JSON raises ValueError naming the file and the
    line, except the one a killed writer was cut off in: the last line, where no newline ends
    it and it is not a JSON object, is left out (a record written whole ends in its newline)."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    torn_end = not text.endswith("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last = number == len(lines) and torn_end
        try:
            value = parse_json(line, f"{path} line {number}")
        except ValueError:
            if not last:
                raise
            return  # the torn last line of an interrupted write
        if last and not isinstance(value, dict):
            return
        yield number, value


def read_json(path: str | os.PathLike, error: type[ValueError] = ValueError) -> Any:
    """The JSON in the file ``path`` (at most :data:`JSON_MAX_BYTES`), as :func:`parse_json`."""
    size = os.stat(path).st_size
    if size > JSON_MAX_BYTES:
        raise error(f"{path} holds {size:,} bytes, more than the {JSON_MAX_BYTES:,} a JSON file "
                    "labkit reads may hold")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path} is not valid JSON (torn or edited: {err})") from None
    return parse_json(text, str(path), error)


def read_json_object(path: str | os.PathLike, what: str,
                     error: type[ValueError] = ValueError) -> dict:
    """The JSON object in ``path``; ``error`` naming the file where it is torn, not JSON, too
    deep or large, or JSON of another shape than ``what`` (the run door's config, a results
    file)."""
    data = read_json(path, error)
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, not {what}")
    return data


def is_dir(path: str | os.PathLike, flag: str) -> bool:
    """Whether ``path`` is a folder; a path the file system refuses to look up (a name too
    long) is a user error naming ``flag``."""
    try:
        return Path(path).is_dir()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror or err}") from None


class OutputError(ValueError):
    """An output path that cannot be used; the message names the path and why."""


def check_output_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """Make sure ``path`` is (or can become) a writable folder, before any work starts.

    Creates it if needed and writes a probe file in it. Raises :class:`OutputError` naming
    ``what`` and the path: it exists as a file, a parent is a file, no permission, a read-only
    or virtual file system."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise OutputError(f"{what} {path}: exists and is not a folder")
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".labkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise OutputError(f"{what} {path}: cannot write there ({reason})") from None
    return path


@contextlib.contextmanager
def output_dir(path: str | os.PathLike, what: str = "--out") -> Iterator[Path]:
    """:func:`check_output_dir` for the block's work: a folder it made is removed again where
    the block raises and leaves it empty, so a refusal that comes after the check (a size that
    does not fit the memory) creates nothing."""
    try:
        existed = Path(path).is_dir()
    except OSError:  # a name the file system refuses: check_output_dir says so, naming ``what``
        existed = False
    folder = check_output_dir(path, what)
    try:
        yield folder
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                folder.rmdir()  # empty only: what the block wrote stays
        raise


def link_refused(path: str | os.PathLike) -> str:
    """The one line for a symbolic link where labkit writes a file of its own."""
    return (f"{path} is a symbolic link; labkit does not write through links in its folders "
            "(the file would land wherever it points): remove it")


def no_links(folder: str | os.PathLike, names: Iterator[str] | tuple[str, ...]) -> None:
    """Raise :class:`OutputError` if any of ``names`` in ``folder`` (a file labkit writes there,
    or a subfolder of it, each component checked) is a symbolic link, dangling or not.
    ``folder`` itself may be one: the user chose it."""
    folder = Path(folder)
    for name in names:
        path = folder
        for part in Path(name).parts:
            path = path / part
            if path.is_symlink():
                raise OutputError(link_refused(path))


def open_no_follow(path: str | os.PathLike, mode: str) -> IO[str]:
    """``open(path, mode)`` for text writing ("w" or "a") that refuses a symbolic link in the
    last component, or a hard link (:class:`OutputError`), instead of writing where it points.
    It truncates ("w") only after that check."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | (
        os.O_APPEND if mode == "a" else 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError:
        if os.path.islink(path):
            raise OutputError(link_refused(path)) from None
        raise
    links = os.fstat(fd).st_nlink
    if links > 1:
        os.close(fd)
        raise OutputError(f"{path} is a hard link (link count {links}): writing it would change "
                          "the file it shares; move it away or choose another folder")
    if mode == "w":
        os.ftruncate(fd, 0)
    stream = open(fd, mode, encoding="utf-8")
    stream.buffer.raw.name = os.fspath(path)  # what a message names: the file, not its fd
    return stream


def describe_os_error(err: OSError) -> str:
    """One line for an OSError: what failed, on which path."""
    said = err.strerror or str(err) or type(err).__name__
    where = f" {err.filename}" if err.filename and str(err.filename) not in said else ""
    return f"{said}{where}"


class FolderLock:
    """An exclusive lock on a folder (``.lock`` inside it), held while a run writes there.

    It is an OS file lock (``fcntl.flock``), so a killed process releases it and a stale lock
    file never blocks anyone; the file records the holder's pid for the error message.
    """

    NAME = ".lock"

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = Path(folder) / self.NAME
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a link: a .lock link would have the pid written into its target
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError:
            if os.path.islink(self.path):
                raise OutputError(link_refused(self.path)) from None
            if os.path.isdir(self.path):
                raise OutputError(_not_own_file(self.path, "is a folder")) from None
            raise
        try:
            _check_lock_file(self.path, fd)
        except OutputError:
            os.close(fd)
            raise
        try:
            _lock_fd(fd)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(f"{self.path.parent} is in use by another labkit process "
                              f"(pid {holder}); wait for it or choose another folder") from None
        content = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if content and not content.isdecimal():
            os.close(fd)
            raise OutputError(f"{self.path} holds {content[:20]!r}, not a labkit pid: another "
                              "tool's file, kept as it is; move it away or choose another folder")
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def check(self) -> None:
        """Raise :class:`OutputError` if the lock file was deleted or replaced while held: a
        second process would then lock a new file and write the same folder alongside."""
        if self._fd is None:
            return
        if not self.path.parent.is_dir():  # the whole folder went: the machine's doing, exit 1
            raise FileNotFoundError(errno.ENOENT, f"the run folder {self.path.parent} was "
                                    "deleted while this run held it", str(self.path.parent))
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise OutputError(f"{self.path} was {'deleted' if now is None else 'replaced'} "
                              "while this run held it: another labkit process could now write "
                              f"{self.path.parent} too, so this one stops here")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _check_lock_file(path: Path, fd: int) -> None:
    """Refuse a ``.lock`` that is not a plain file of its own: the pid written into a hard
    link would overwrite the file it shares."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_nlink > 1:
        why = f"is a hard link (link count {st.st_nlink})"
    else:
        return
    raise OutputError(_not_own_file(path, why))


def _not_own_file(path: Path, why: str) -> str:
    return (f"{path} {why}; labkit writes its pid there, so it must be a plain file of its "
            "own: move it away or choose another folder")


def _lock_fd(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def unique_folder(pattern: str) -> Path:
    """A new folder named by ``time.strftime(pattern)``, with ``-2``, ``-3``... appended when
    that name is taken (two runs started in the same second get two folders)."""
    import time

    base = Path(time.strftime(pattern))
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise OutputError(f"no free folder name like {base}")
