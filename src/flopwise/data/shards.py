"""Token shards: a fixed 64-byte header followed by the raw token ids.

Layout (little-endian)::

    offset  size  field
         0     8  magic            b"FLOPWSHD"
         8     4  format version   u32 (= FORMAT_VERSION)
        12     4  dtype code       u32: 2 = uint16, 4 = uint32 (the item size in bytes)
        16     8  vocab_size       u64
        24     8  n_tokens         u64
        32     4  crc32            u32, zlib.crc32 of the token bytes
        36    28  zero padding
        64     -  tokens           n_tokens * itemsize bytes

Token ids are uint16 when the vocabulary fits (vocab_size <= 65536), else uint32 —
never int64: a 10B-token corpus is 20 GB, not 80 GB.  Readers memory-map the tokens,
so opening a shard costs nothing and the page cache is shared between processes.

Writes are atomic: tokens go to a temporary file in the same directory, which is
fsynced and then renamed over the final name, so a shard under its final name is
always complete. A failed write (a full disk) removes the temporary file and raises an
``OSError`` naming the shard's final path; discarding never raises a second error.

:func:`scan_tokens` is the one full read of a shard: its crc32 against the header and
its largest id against the header's vocabulary, a bad id reported with its position.
``flopwise prepare --verify`` and the check a run makes when it opens its data
(:mod:`flopwise.data.datadir`) both use it. :class:`SplitWriter` rolls one split's token
stream over numbered shards (``flopwise prepare`` and the embedded corpus both write
through it).
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flopwise.errors import FlopwiseError

from ..fsio import fsync_dir, umask

MAGIC = b"FLOPWSHD"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQI")  # magic, version, dtype code, vocab, n_tokens, crc32
_DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_CRC_CHUNK = 1 << 24  # bytes per crc32 step when verifying (bounded memory)


class ShardError(FlopwiseError, ValueError):
    """A shard file is malformed, or tokens do not fit the declared vocabulary."""


@dataclass(frozen=True)
class ShardHeader:
    version: int
    dtype: np.dtype
    vocab_size: int
    n_tokens: int
    crc32: int

    @property
    def nbytes(self) -> int:
        return self.n_tokens * self.dtype.itemsize


def shard_name(split: str, index: int) -> str:
    """``shard_name("train", 3) == "train-00003.bin"``."""
    return f"{split}-{index:05d}.bin"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return _DTYPES[2]
    if vocab_size <= 1 << 32:
        return _DTYPES[4]
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def _pack_header(dtype: np.dtype, vocab_size: int, n_tokens: int, crc: int) -> bytes:
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, vocab_size, n_tokens, crc & 0xFFFFFFFF)
    return head + b"\0" * (HEADER_SIZE - len(head))


class ShardWriter:
    """Stream tokens into one shard; the file appears under ``path`` only on ``close()``.

    >>> with ShardWriter(path, vocab_size) as w:
    ...     w.write(ids_a); w.write(ids_b)

    Leaving the ``with`` block by an exception discards the temporary file.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int):
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.n_tokens = 0
        self._crc = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        except OSError as e:
            raise _naming(e, self.path) from e
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        try:
            self._f.write(b"\0" * HEADER_SIZE)  # placeholder; the real header is written on close
        except OSError as e:
            self.abort()
            raise _naming(e, self.path) from e

    def write(self, tokens: Any) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size == 0:
            return
        if not np.issubdtype(arr.dtype, np.integer):
            raise ShardError(f"{self.path}: token ids must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ShardError(
                f"{self.path}: token id {bad} is outside the vocabulary [0, {self.vocab_size}) "
                f"(vocab_size={self.vocab_size})"
            )
        data = np.ascontiguousarray(arr, dtype=self.dtype).tobytes()
        self._crc = zlib.crc32(data, self._crc)
        try:
            self._f.write(data)
        except OSError as e:
            raise _naming(e, self.path) from e
        self.n_tokens += arr.size

    def close(self) -> Path:
        """Write the header, fsync, and rename into place. Returns the final path."""
        f = self._f
        try:
            f.seek(0)
            f.write(_pack_header(self.dtype, self.vocab_size, self.n_tokens, self._crc))
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.chmod(self._tmp, 0o666 & ~umask())  # mkstemp makes 0600; give the usual mode
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as e:
            self.abort()
            raise _naming(e, self.path) from e
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Discard what was written; the final name is left untouched. Never raises: closing
        flushes the buffer, which on a full disk fails again -- and the data is discarded anyway."""
        try:
            self._f.close()
        except OSError:
            pass
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _naming(e: OSError, path: Path) -> OSError:
    """The same error, naming the file the caller knows (not the hidden temporary one)."""
    return OSError(e.errno, e.strerror or str(e), str(path)) if e.errno else e


def write_shard(path: str | os.PathLike, tokens: Any, vocab_size: int) -> Path:
    """Write ``tokens`` (1-D integer array-like) as one shard, atomically.

    Raises :class:`ShardError` if any id is negative or ``>= vocab_size``; nothing is
    written under ``path`` in that case.
    """
    with ShardWriter(path, vocab_size) as w:
        w.write(tokens)
    return Path(path)


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and check a shard's header and its size. Raises :class:`ShardError`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise ShardError(f"{path}: shard file does not exist") from None
    if len(raw) < HEADER_SIZE:
        raise ShardError(
            f"{path}: truncated file: {size} bytes, shorter than the {HEADER_SIZE}-byte shard header"
        )
    magic, version, code, vocab, n_tokens, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ShardError(f"{path}: bad magic {magic!r}, expected {MAGIC!r} (not a flopwise token shard)")
    if version != FORMAT_VERSION:
        raise ShardError(
            f"{path}: unknown shard format version {version} (this flopwise reads version {FORMAT_VERSION})"
        )
    if code not in _DTYPES:
        raise ShardError(f"{path}: unknown dtype code {code} (expected 2 = uint16 or 4 = uint32)")
    if vocab <= 0:
        raise ShardError(f"{path}: header vocab_size is {vocab}, must be > 0")
    dtype = _DTYPES[code]
    if vocab > (1 << (8 * dtype.itemsize)):
        raise ShardError(f"{path}: header vocab_size {vocab} does not fit dtype {dtype.name}")
    expected = HEADER_SIZE + n_tokens * dtype.itemsize
    if size < expected:
        raise ShardError(
            f"{path}: truncated file: header says {n_tokens} {dtype.name} tokens "
            f"({expected} bytes with the header) but the file has {size} bytes"
        )
    if size > expected:
        raise ShardError(
            f"{path}: file size {size} does not match n_tokens={n_tokens} in the header "
            f"(expected {expected} bytes; {size - expected} trailing bytes)"
        )
    return ShardHeader(version=version, dtype=dtype, vocab_size=vocab, n_tokens=n_tokens, crc32=crc)


def read_shard(path: str | os.PathLike, verify: bool = False) -> np.ndarray:
    """Read-only memory map of a shard's tokens (uint16 or uint32, shape ``(n_tokens,)``).

    ``verify=True`` also reads every byte to check the crc32 and that no id is
    ``>= vocab_size`` (costs a full pass over the file).  An empty shard gives a
    zero-length (non-mapped) array, since an empty region cannot be memory-mapped.
    """
    path = Path(path)
    h = read_header(path)
    if h.n_tokens == 0:
        tokens = np.empty(0, dtype=h.dtype)
        tokens.flags.writeable = False
    else:
        tokens = np.memmap(path, dtype=h.dtype, mode="r", offset=HEADER_SIZE, shape=(h.n_tokens,))
    if verify:
        scan_tokens(path, h, tokens)
    return tokens


def scan_tokens(path: str | os.PathLike, header: ShardHeader | None = None, tokens: np.ndarray | None = None) -> int:
    """Read every token of a shard once: check the crc32 against the header and every id
    against the header's vocab_size. Returns the largest id (-1 for an empty shard).

    Raises :class:`ShardError` naming the file; an id out of range is given with its
    position, and both problems are reported when both are there (a shard overwritten
    with garbage usually has both). Memory stays bounded: the file is read in chunks.
    """
    path = Path(path)
    h = header if header is not None else read_header(path)
    if tokens is None:
        tokens = read_shard(path)
    crc, top, bad = 0, -1, None
    step = max(1, _CRC_CHUNK // h.dtype.itemsize)
    for i in range(0, h.n_tokens, step):
        chunk = tokens[i : i + step]
        # a C-contiguous slice of the map: no copy. The ignore: numpy's stubs give ndarray its
        # __buffer__ only for Python >= 3.12
        crc = zlib.crc32(chunk, crc)  # type: ignore[arg-type]
        high = int(chunk.max())
        if high >= h.vocab_size and bad is None:
            j = int(np.argmax(chunk >= h.vocab_size))
            bad = (int(chunk[j]), i + j)
        top = max(top, high)
    problems = []
    if bad is not None:
        problems.append(f"token id {bad[0]} at position {bad[1]:,} is not below the vocabulary size {h.vocab_size:,}")
    if crc != h.crc32:
        problems.append(f"checksum mismatch: crc32 of the tokens is {crc:#010x}, header says {h.crc32:#010x}")
    if problems:
        raise ShardError(f"{path}: " + "; ".join(problems) + " (the file is corrupted)")
    return top


class SplitWriter:
    """Token stream of one split -> ``SPLIT-NNNNN.bin`` shards of at most ``shard_tokens``."""

    def __init__(self, out: Path, split: str, vocab_size: int, shard_tokens: int):
        self.out, self.split, self.vocab_size, self.shard_tokens = out, split, vocab_size, shard_tokens
        self.shards: list[str] = []
        self.tokens = 0
        self.documents = 0
        self._writer: ShardWriter | None = None

    def write(self, ids: np.ndarray) -> None:
        pos = 0
        while pos < len(ids):  # a document may straddle two shards
            if self._writer is None:
                self._writer = ShardWriter(self.out / shard_name(self.split, len(self.shards)), self.vocab_size)
            take = min(len(ids) - pos, self.shard_tokens - self._writer.n_tokens)
            self._writer.write(ids[pos : pos + take])
            pos += take
            self.tokens += take
            if self._writer.n_tokens >= self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._writer is not None  # both callers check
        self.shards.append(self._writer.close().name)
        self._writer = None

    def close(self) -> dict[str, Any]:
        if self._writer is not None and self._writer.n_tokens:
            self._close_shard()
        elif self._writer is not None:
            self._writer.abort()
            self._writer = None
        return {"shards": self.shards, "tokens": self.tokens, "documents": self.documents}

    def abort(self) -> None:
        """Discard the shard being written (never raises)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
