"""Files that survive a kill, a full disk and a second process: atomic writes and directory locks.

The bottom layer: nothing here imports flopwise, so ``config``, ``data`` and ``train`` all use it.

- :func:`atomic_write` writes beside the target and renames over it (fsynced), so a reader --
  or a run resumed after ``kill -9`` -- sees the old file or the new one, never half of one.
  A failure (a full disk) removes the temporary file and re-raises.
- :class:`DirLock` is one writer's claim on a directory (a run, a data directory being
  prepared): an exclusive ``flock`` on ``<dir>/.lock``. The kernel releases it when the
  holder exits in any way, ``SIGKILL`` included, so a lock left by a dead process never blocks
  a resume; a second writer is refused with the holder's pid, host, command and start time.
- :func:`is_disk_full` tells whether an exception is what a full disk raises: ``OSError``
  with ENOSPC/EDQUOT, or ``torch.save``'s ``RuntimeError`` from its zip writer (``[enforce
  fail at inline_container.cc...]``), which carries no errno.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".lock"


def umask() -> int:
    """The process umask (read by setting it, so set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories cannot be opened
    or synced: some network and FUSE filesystems answer EINVAL, and that is no write failure)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` all at once: temporary file, fsync, rename, fsync the directory."""
    path = Path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def is_disk_full(e: BaseException) -> bool:
    """True for the errors a full disk (or a quota) raises, whatever library wrote the file."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    text = str(e)
    # torch.save's zip writer: "[enforce fail at inline_container.cc:NNN] . PytorchStreamWriter failed writing file
    # data/0: file write failed" -- no errno; a short write is the only way it fails while writing.
    return isinstance(e, RuntimeError) and "inline_container" in text and "fail" in text


def describe_write_error(e: BaseException) -> str:
    """A one-line reason for a failed write, the same words for every library's error."""
    if is_disk_full(e):
        return "no space left on the device"
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return f"{type(e).__name__}: {e}"


class LockedError(RuntimeError):
    """Another live process holds the directory; the message names it."""


class DirLock:
    """An exclusive, process-lifetime lock on a directory (see the module docstring).

    ``with DirLock(run_dir, "flopwise train"):`` -- or :meth:`acquire` / :meth:`release` when
    the holder's lifetime is not a block. The lock file is left in place on release (removing
    it would race a process about to lock it); only the flock decides who holds it."""

    def __init__(self, directory: str | Path, purpose: str):
        self.directory = Path(directory)
        self.purpose = purpose
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # directories acquire made: removed again if left holding only the lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "DirLock":

        if self._fd is not None:
            return self
        self._created = [p for p in [self.directory, *self.directory.parents] if not p.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise LockedError(f"{self.directory} is in use by another process ({holder}); "
                                  f"wait for it to finish or stop it -- two writers would corrupt it") from None
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "command": " ".join(sys.argv)[:300], "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:  # who holds it, for the message a second writer gets; best effort (the flock is the lock)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # a holder that failed before writing anything leaves no empty directory behind
            if self._created and [p.name for p in self.directory.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                for p in self._created:  # deepest first
                    p.rmdir()
        except OSError:
            pass
        os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode() or "{}")
    except (OSError, ValueError):
        return "holder unknown"
    if not isinstance(info, dict) or "pid" not in info:
        return "holder unknown"
    return (f"pid {info.get('pid')} on {info.get('host', '?')}, {info.get('purpose', '?')} since "
            f"{info.get('since', '?')}: {info.get('command', '')}").rstrip(": ")
