"""Files that survive a kill, a full disk and a second process: atomic writes and directory locks.

The bottom layer: nothing here imports flopwise, so ``config``, ``data`` and ``train`` all use it.

- :func:`write_file` (and :func:`write_json` for JSON) is the one writer: it writes beside the
  target and renames over it (fsynced), so a reader -- or a run resumed after ``kill -9`` --
  sees the old file or the new one, never half of one. A failure removes the temporary file; a
  fault of the machine (a full disk) is a :class:`WriteError` naming the target, not the
  temporary file, and saying what was kept.
- :class:`DirLock` is one writer's claim on a directory (a run, a data directory being
  prepared): an exclusive ``flock`` on ``<dir>/.lock``. The kernel releases it when the
  holder exits in any way, ``SIGKILL`` included, so a lock left by a dead process never blocks
  a resume; a second writer is refused with the holder's pid, host, command and start time.
- :func:`is_disk_full` tells whether an exception is what a full disk raises: ``OSError``
  with ENOSPC/EDQUOT, or ``torch.save``'s ``RuntimeError`` from its zip writer (``[enforce
  fail at inline_container.cc...]``), which carries no errno.
- :func:`read_json` / :func:`loads_json` read JSON a user may have been sent (``meta.json``,
  a Hugging Face ``config.json``, a task file's lines, a checkpoint's ``state.json``): a file
  over :data:`MAX_JSON_BYTES`, text that is not UTF-8, arrays and objects nested deeper than
  :data:`MAX_JSON_DEPTH` (found by a scan before ``json.loads``, whose C parser recurses once
  per level) and any syntax error are a :class:`FileFormatError` naming the file and the place.
  :func:`read_text` is the same reading for other text formats (a YAML config).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from itertools import accumulate
from pathlib import Path
from typing import Any

from flopwise.errors import FlopwiseError

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


def _atomic_write(path: str | Path, data: str | bytes, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` all at once: temporary file, fsync, rename, fsync the directory.
    Private: callers use :func:`write_file`, whose errors name the target."""
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


class LockedError(FlopwiseError, RuntimeError):
    """Another live process holds the directory; the message names it."""


class DirLock:
    """An exclusive, process-lifetime lock on a directory (see the module docstring).

    ``with DirLock(run_dir, "flopwise train"):`` -- or :meth:`acquire` / :meth:`release` when
    the holder's lifetime is not a block. The lock file is left in place on release (removing
    it would race a process about to lock it); only the flock decides who holds it."""

    def __init__(self, directory: str | Path, purpose: str, dedicated: bool = False):
        """``dedicated``: ``directory`` exists only to hold the lock (prepare's ``.NAME.lock``):
        release removes it, whoever made it, so a killed holder's stays only until the next
        one is done."""
        self.directory = Path(directory)
        self.purpose = purpose
        self.dedicated = dedicated
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
        while True:
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
            except FileNotFoundError:  # a releasing holder removed the dedicated directory just now
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise LockedError(f"{self.directory} is in use by another process ({holder}); "
                                      f"wait for it to finish or stop it -- two writers would corrupt it") from None
                raise
            # A holder that released a dedicated lock removed its file: the one this flock is on
            # may be that removed file, while a third process locks a new one. Only the file at
            # the path counts; otherwise open it again.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
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
            if self.dedicated and [p.name for p in self.directory.iterdir()] == [LOCK_NAME]:
                self.path.unlink()  # still held: a process that opened it re-checks after its flock
                self.directory.rmdir()
            elif self._created and [p.name for p in self.directory.iterdir()] == [LOCK_NAME]:
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
        info = loads_json(raw or b"{}", LOCK_NAME)
    except (OSError, ValueError):  # FileFormatError is a ValueError
        return "holder unknown"
    if not isinstance(info, dict) or "pid" not in info:
        return "holder unknown"
    return (f"pid {info.get('pid')} on {info.get('host', '?')}, {info.get('purpose', '?')} since "
            f"{info.get('since', '?')}: {info.get('command', '')}").rstrip(": ")


# --------------------------------------------------------------------------- failed writes
#
# A write that fails for a reason of the machine -- a full disk or quota, a read-only mount, a
# folder the user may not write, a name too long -- is the user's to fix, not a bug: the write
# site removes what it left half-written, keeps what was there before, and raises a
# :class:`WriteError` naming the file and the reason in one line. Any other exception raised
# while writing is a bug and is left alone (``is_write_fault`` tells which is which).

WRITE_FAULTS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for the filesystem", errno.EROFS: "read-only file system",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.ENAMETOOLONG: "file name too long", errno.EIO: "input/output error",
                errno.ENOTDIR: "a part of the path is a file, not a folder", errno.EISDIR: "is a folder"}
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors, tokenizers) report errno


def write_fault_errno(e: BaseException) -> int | None:
    """The errno of a write that failed for a reason of the machine (:data:`WRITE_FAULTS`), or
    None for anything else. Knows torch.save's zip-writer error (a full disk, no errno) and a
    Rust library's "(os error N)" (safetensors' ``SafetensorError``), which are no ``OSError``."""
    if isinstance(e, OSError):
        return e.errno if e.errno in WRITE_FAULTS else None
    if is_disk_full(e):
        return errno.ENOSPC
    m = _OS_ERROR_CODE.search(str(e))
    return int(m.group(1)) if m and int(m.group(1)) in WRITE_FAULTS else None


def is_write_fault(e: BaseException) -> bool:
    """Whether ``e`` is a write failing for a reason of the machine, not a bug."""
    return write_fault_errno(e) is not None


def write_reason(e: BaseException) -> str:
    """The reason a write failed, in the same lower-case words whatever library raised it."""
    code = write_fault_errno(e)
    return WRITE_FAULTS[code] if code is not None else describe_write_error(e)


class WriteError(FlopwiseError, OSError):
    """A file or folder that could not be written for a reason of the machine; the message names
    it, the reason, and what was kept. An ``OSError`` too, with the original ``errno`` and the
    path as ``filename``, so callers that catch ``OSError`` (or test :func:`is_disk_full`) still do."""

    def __init__(self, message: str, code: int | None = None, filename: str | None = None):
        if code is None:
            OSError.__init__(self, message)
        else:
            OSError.__init__(self, code, message, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # pickled across processes (trial workers, ranks) with its message intact
        return type(self), (self.message, self.errno, self.filename)


def write_error(path: str | Path, e: BaseException, what: str = "", kept: str = "") -> WriteError:
    """The :class:`WriteError` for ``e`` (a write fault: :func:`is_write_fault`) while writing
    ``path``: ``cannot write WHAT PATH: REASON; KEPT``. ``raise write_error(...) from e``."""
    label = f"{what} {path}" if what else str(path)
    return WriteError(f"cannot write {label}: {write_reason(e)}" + (f"; {kept}" if kept else ""),
                      write_fault_errno(e), str(path))


def write_file(path: str | Path, data: str | bytes, what: str = "", kept: str = "") -> None:
    """:func:`_atomic_write`, a write fault becoming a :class:`WriteError` that names ``path``
    (not the temporary file beside it) and says the earlier copy, if any, is intact, then
    ``kept``: what else the caller knows to be intact (a run's checkpoint)."""
    path = Path(path)
    try:
        _atomic_write(path, data)
    except Exception as e:
        if not is_write_fault(e) or isinstance(e, WriteError):
            raise
        had = f"the earlier {path.name} is unchanged" if path.exists() else ""
        raise write_error(path, e, what, "; ".join(k for k in (had, kept) if k)) from e


def json_text(obj: Any) -> str:
    """``obj`` as the indented JSON document :func:`write_json` writes. Values JSON has no type
    for (paths, dates) are written as their ``str``."""
    return json.dumps(obj, indent=2, default=str) + "\n"


def write_json(path: str | Path, obj: Any, what: str = "", kept: str = "") -> None:
    """``obj`` as an indented JSON document at ``path`` (:func:`json_text`), written by
    :func:`write_file` (all at once; a write fault is a :class:`WriteError` naming ``path``).
    Read it back with :func:`read_json`."""
    write_file(path, json_text(obj), what, kept)


class AppendFile:
    """An append-only file of whole lines (``metrics.jsonl``, ``evals.jsonl``, ``samples.txt``):
    each :meth:`write` lands whole or not at all. A write cut short by a full disk is cut off
    again (the file truncated back to where it ended), so readers never meet a torn last line,
    and the failure is a :class:`WriteError` naming the file. Unbuffered: one ``write(2)`` per
    call, nothing left in a buffer to be flushed (half) at exit."""

    def __init__(self, path: str | Path, what: str = ""):
        self.path, self.what = Path(path), what
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            if not is_write_fault(e):
                raise
            raise write_error(self.path, e, what) from e

    def write(self, text: str | bytes, sync: bool = False) -> None:
        """Append ``text`` (whole lines); ``sync``: fsync before returning."""
        if self._fd is None:
            raise ValueError(f"{self.path}: write to a closed AppendFile")
        fd, view = self._fd, memoryview(text.encode("utf-8") if isinstance(text, str) else text)
        start = os.fstat(fd).st_size
        done = 0
        try:
            while done < len(view):
                done += os.write(fd, view[done:])
            if sync:
                os.fsync(fd)
        except BaseException as e:
            # Cut our part-line off -- only when nobody appended after it (a second writer's line is theirs).
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_size == start + done:
                    os.ftruncate(fd, start)
            if not isinstance(e, Exception) or not is_write_fault(e):
                raise
            raise write_error(self.path, e, self.what, "its earlier lines are intact") from e

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


# --------------------------------------------------------------------------- reading files a user was sent

# The deepest nesting of arrays and objects a JSON file flopwise reads may have. Every format
# flopwise reads nests a few levels (a config.json's rope_parameters: 2, meta.json's
# splits.train.shards: 3, a task record's choices: 3); 64 leaves room for any honest file and
# stays far below what exhausts Python's stack (json's parser recurses once per level, up to
# the recursion limit of 1000; a file of 100,000 '[' would otherwise be a RecursionError).
MAX_JSON_DEPTH = 64
# The largest JSON file read whole: the biggest ones flopwise meets (meta.json of a corpus of
# 100,000 shards, a sharded model's safetensors index) hold a few MB; a file larger than this
# is not one of them, and reading it would only cost memory (about 10x its size as objects).
MAX_JSON_BYTES = 64 << 20

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class FileFormatError(FlopwiseError, ValueError):
    """A file that is not in the format it should be in (not UTF-8, not JSON, nested too
    deeply, too large); ``where`` names the file (and line), ``reason`` says what is wrong."""

    def __init__(self, where: str | os.PathLike[str], reason: str):
        self.where, self.reason = str(where), reason
        super().__init__(f"{self.where}: {reason}")

    def __reduce__(self):
        return (type(self), (self.where, self.reason))


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest, brackets inside strings not
    counted; for text that is not valid JSON, an upper bound of what ``json.loads`` would
    recurse through before it stopped. C-speed regular expressions, then one pass over the
    brackets alone."""
    outside = _JSON_STRING.sub("", text)
    quote = outside.find('"')
    if quote >= 0:  # an unterminated string: json.loads stops there
        outside = outside[:quote]
    brackets = _NOT_BRACKET.sub("", outside)
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def check_json_depth(text: str, where: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """:class:`FileFormatError` naming ``where`` when ``text`` nests deeper than ``max_depth``
    (no scan at all when it holds no more openers than that: most files, every short line)."""
    if text.count("[") + text.count("{") > max_depth and json_depth(text) > max_depth:
        raise FileFormatError(where, f"not valid JSON: nested deeper than {max_depth} levels")


def loads_json(text: str | bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` for text a user may have sent: nesting checked first, and every
    failure a :class:`FileFormatError` naming ``where`` (a file, or a file and line) with the
    line and column of a syntax error."""
    if isinstance(text, (bytes, bytearray)):
        text = decode_utf8(bytes(text), where)
    check_json_depth(text, where, max_depth)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FileFormatError(where, f"not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:  # the scan bounds the depth; a caller already deep in its own stack
        raise FileFormatError(where, "not valid JSON: nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise FileFormatError(where, f"not valid JSON: {_first_line(e)}") from None


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as text (a UTF-8 byte-order mark dropped); :class:`FileFormatError` naming the
    byte offset of the first byte that is not UTF-8."""
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        raise FileFormatError(where, f"not UTF-8 text: byte {at:,} is 0x{data[at]:02x} ({e.reason})") from None


def read_bytes(path: str | os.PathLike, max_bytes: int | None) -> bytes:
    """The bytes of the file at ``path``; :class:`FileFormatError` when it holds more than
    ``max_bytes`` (None: no limit), checked before it is read -- and while it is, for a file
    that grows or a device that never ends. ``OSError`` (a missing file ...) as ``open`` raises it."""
    with open(path, "rb") as f:
        if max_bytes is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        data = b"" if size > max_bytes else f.read(max_bytes + 1)
        if size > max_bytes or len(data) > max_bytes:
            raise FileFormatError(str(path), f"{max(size, len(data)):,} bytes or more, larger than the "
                                             f"{max_bytes:,} bytes flopwise reads from a file of this kind")
        return data


def read_text(path: str | os.PathLike, max_bytes: int | None = None) -> str:
    """The UTF-8 text of the file at ``path`` (see :func:`read_bytes`, :func:`decode_utf8`)."""
    return decode_utf8(read_bytes(path, max_bytes), str(path))


def read_json(path: str | os.PathLike, max_bytes: int | None = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON document in the file at ``path``: :class:`FileFormatError` naming the file
    when it is too large, not UTF-8, nested too deeply or not JSON; ``OSError`` (a missing
    file ...) as ``open`` raises it."""
    return loads_json(read_text(path, max_bytes), str(path), max_depth)


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def replace_dir(new: Path, out: Path) -> None:
    """Rename the finished directory ``new`` to ``out``. An existing ``out`` is moved aside to
    ``.NAME.old`` first and deleted only once ``new`` is in its place (put back if the rename
    fails), so ``out`` is always the old complete directory or the new one, never a mix. A kill
    between the two renames leaves ``.NAME.old`` for the caller's next run to settle."""
    if not out.exists():
        os.replace(new, out)
        return
    old = out.parent / f".{out.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
