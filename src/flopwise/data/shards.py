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
always complete.
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

MAGIC = b"FLOPWSHD"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQI")  # magic, version, dtype code, vocab, n_tokens, crc32
_DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_CRC_CHUNK = 1 << 24  # bytes per crc32 step when verifying (bounded memory)


class ShardError(ValueError):
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        self._f.write(b"\0" * HEADER_SIZE)  # placeholder; the real header is written on close

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
        self._f.write(data)
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
            os.chmod(self._tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        _fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Discard what was written; the final name is left untouched."""
        try:
            self._f.close()
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        empty = np.empty(0, dtype=h.dtype)
        empty.flags.writeable = False
        return empty
    tokens = np.memmap(path, dtype=h.dtype, mode="r", offset=HEADER_SIZE, shape=(h.n_tokens,))
    if verify:
        crc = 0
        step = max(1, _CRC_CHUNK // h.dtype.itemsize)
        top = 0
        for i in range(0, h.n_tokens, step):
            chunk = tokens[i : i + step]
            crc = zlib.crc32(chunk.tobytes(), crc)
            top = max(top, int(chunk.max()))
        if crc != h.crc32:
            raise ShardError(
                f"{path}: checksum mismatch: crc32 of the tokens is {crc:#010x}, "
                f"header says {h.crc32:#010x} (the file is corrupted)"
            )
        if top >= h.vocab_size:
            raise ShardError(f"{path}: token id {top} is >= the header's vocab_size {h.vocab_size}")
    return tokens
