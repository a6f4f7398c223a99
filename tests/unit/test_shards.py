"""Token shard format: round trips, corruption errors, atomic writes."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest

from flopwise.data import shards as shards_mod
from flopwise.data.shards import (
    HEADER_SIZE,
    MAGIC,
    ShardError,
    ShardWriter,
    dtype_for_vocab,
    read_header,
    read_shard,
    scan_tokens,
    shard_name,
    write_shard,
)


@pytest.mark.parametrize(
    "vocab, dtype",
    [(300, np.uint16), (65536, np.uint16), (65537, np.uint32), (200_000, np.uint32)],
)
def test_round_trip(tmp_path, vocab, dtype):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=1000)
    tokens[0], tokens[1] = 0, vocab - 1  # extremes of the range
    p = write_shard(tmp_path / "train-00000.bin", tokens, vocab)
    assert p.stat().st_size == HEADER_SIZE + 1000 * np.dtype(dtype).itemsize
    h = read_header(p)
    assert (h.vocab_size, h.n_tokens, h.dtype) == (vocab, 1000, np.dtype(dtype))
    out = read_shard(p, verify=True)
    assert isinstance(out, np.memmap) and out.dtype == dtype and not out.flags.writeable
    np.testing.assert_array_equal(out, tokens)


def test_header_layout(tmp_path):
    p = write_shard(tmp_path / "a.bin", np.array([1, 2, 3]), 300)
    raw = p.read_bytes()
    magic, version, code, vocab, n, crc = struct.unpack_from("<8sIIQQI", raw)
    assert (magic, version, code, vocab, n) == (MAGIC, 1, 2, 300, 3)
    assert crc == zlib.crc32(np.array([1, 2, 3], dtype="<u2").tobytes())
    assert raw[36:HEADER_SIZE] == b"\0" * (HEADER_SIZE - 36)


def test_dtype_never_int64():
    assert dtype_for_vocab(8192) == np.uint16
    assert dtype_for_vocab(1 << 17) == np.uint32


def test_empty_shard(tmp_path):
    p = write_shard(tmp_path / "e.bin", [], 300)
    assert len(read_shard(p, verify=True)) == 0


def test_streaming_writer_matches_write_shard(tmp_path):
    a = np.arange(100) % 300
    with ShardWriter(tmp_path / "s.bin", 300) as w:
        w.write(a[:40])
        w.write(a[40:].tolist())
    write_shard(tmp_path / "o.bin", a, 300)
    assert (tmp_path / "s.bin").read_bytes() == (tmp_path / "o.bin").read_bytes()
    assert shard_name("val", 7) == "val-00007.bin"


@pytest.mark.parametrize("bad", [300, 1000, -1])
def test_rejects_out_of_vocab(tmp_path, bad):
    p = tmp_path / "x.bin"
    with pytest.raises(ShardError, match=r"x\.bin.*outside the vocabulary"):
        write_shard(p, [1, 2, bad], 300)
    assert not p.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def test_rejects_non_integer(tmp_path):
    with pytest.raises(ShardError, match="integers"):
        write_shard(tmp_path / "f.bin", np.array([1.0, 2.0]), 300)


# ----------------------------------------------------------------- corruption


def _good(tmp_path, n=50):
    return write_shard(tmp_path / "train-00000.bin", np.arange(n) % 300, 300)


def _patch(p, offset, data: bytes):
    raw = bytearray(p.read_bytes())
    raw[offset : offset + len(data)] = data
    p.write_bytes(bytes(raw))


def test_bad_magic(tmp_path):
    p = _good(tmp_path)
    _patch(p, 0, b"NOTASHRD")
    with pytest.raises(ShardError, match=r"train-00000\.bin.*bad magic"):
        read_shard(p)


def test_unknown_version(tmp_path):
    p = _good(tmp_path)
    _patch(p, 8, struct.pack("<I", 99))
    with pytest.raises(ShardError, match=r"train-00000\.bin.*version 99"):
        read_shard(p)


def test_unknown_dtype(tmp_path):
    p = _good(tmp_path)
    _patch(p, 12, struct.pack("<I", 8))
    with pytest.raises(ShardError, match=r"train-00000\.bin.*dtype code 8"):
        read_shard(p)


def test_truncated_tokens(tmp_path):
    p = _good(tmp_path)
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(ShardError, match=r"train-00000\.bin.*truncated"):
        read_shard(p)


def test_truncated_header(tmp_path):
    p = _good(tmp_path)
    p.write_bytes(p.read_bytes()[:20])
    with pytest.raises(ShardError, match=r"train-00000\.bin.*truncated.*header"):
        read_shard(p)


def test_size_mismatch_trailing_bytes(tmp_path):
    p = _good(tmp_path)
    p.write_bytes(p.read_bytes() + b"\0\0")
    with pytest.raises(ShardError, match=r"train-00000\.bin.*n_tokens=50"):
        read_shard(p)


def test_checksum_mismatch(tmp_path):
    p = _good(tmp_path)
    _patch(p, HEADER_SIZE + 10, b"\x07")
    read_shard(p)  # without verify the header and size are fine
    with pytest.raises(ShardError, match=r"train-00000\.bin.*checksum mismatch"):
        read_shard(p, verify=True)


def test_scan_names_the_first_bad_id_with_its_position_and_a_bad_checksum_too(tmp_path):
    p = _good(tmp_path, n=5000)
    assert scan_tokens(p) == 299  # the largest id
    ids = np.arange(5000, dtype=np.uint16) % 300
    ids[4321] = 60_000
    raw = bytearray(p.read_bytes())
    _patch(p, HEADER_SIZE, ids.tobytes())  # header kept: its crc no longer matches either
    with pytest.raises(ShardError, match=r"train-00000\.bin: token id 60000 at position 4,321 is not below the "
                                         r"vocabulary size 300; checksum mismatch"):
        scan_tokens(p)
    head = bytearray(raw[:HEADER_SIZE])
    struct.pack_into("<I", head, 32, zlib.crc32(ids.tobytes()))  # a matching crc: the id alone is reported
    _patch(p, 0, bytes(head))
    with pytest.raises(ShardError, match=r"position 4,321 is not below the vocabulary size 300 \(the file"):
        read_shard(p, verify=True)


def test_missing_file(tmp_path):
    with pytest.raises(ShardError, match=r"nope\.bin.*does not exist"):
        read_shard(tmp_path / "nope.bin")


# ----------------------------------------------------------------- atomicity


def test_failed_write_never_exposes_partial_file(tmp_path, monkeypatch):
    final = tmp_path / "train-00000.bin"
    write_shard(final, np.arange(10), 300)
    before = final.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(shards_mod.os, "fsync", boom)  # fails after the tokens were written
    with pytest.raises(OSError, match="simulated"):
        write_shard(final, np.arange(1000) % 300, 300)
    assert final.read_bytes() == before  # the old complete shard is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-00000.bin"]  # temp file removed


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    final = tmp_path / "val-00000.bin"
    real_write = ShardWriter.write

    def half(self, tokens):
        real_write(self, tokens[: len(tokens) // 2])
        raise RuntimeError("crash mid-write (simulated)")

    monkeypatch.setattr(ShardWriter, "write", half)
    with pytest.raises(RuntimeError, match="simulated"):
        write_shard(final, np.arange(100), 300)
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_names_the_shard_and_discarding_never_raises_again(tmp_path, monkeypatch):
    """A full disk: the write fails, and so does the flush when the file is closed to discard it."""
    final = tmp_path / "train-00003.bin"
    w = ShardWriter(final, 300)

    class FullDisk:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            raise OSError(28, "No space left on device")

    real, w._f = w._f, FullDisk()
    with pytest.raises(OSError, match=r"No space left on device: '.*train-00003\.bin'") as e:
        w.write(np.arange(10))
    assert e.value.errno == 28
    w.abort()  # does not raise
    real.close()
    assert list(tmp_path.iterdir()) == []


def test_write_goes_through_replace(tmp_path, monkeypatch):
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append((os.path.dirname(src), os.fspath(dst)))
        assert read_header(src).n_tokens == 5  # complete before it gets the final name
        real(src, dst)

    monkeypatch.setattr(shards_mod.os, "replace", spy)
    write_shard(tmp_path / "t.bin", np.arange(5), 300)
    assert seen == [(str(tmp_path), str(tmp_path / "t.bin"))]
