"""The embedded corpus (Python stdlib source): preparation, caching, atomic publish."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from flopwise.data import builtin
from flopwise.data.builtin import (
    fingerprint,
    is_val,
    list_stdlib_files,
    prepare_builtin,
    select_files,
    split_files,
)
from flopwise.data.datadir import DataDir
from flopwise.data.loader import LoaderOptions, RandomWindowLoader

MAX_MB = 0.3
VOCAB = 512


def quiet(msg: str) -> None:
    pass


def entries(cache: Path) -> list[str]:
    """What a cache directory holds, less the (harmless, hidden) build lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def snapshot(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, prepare_builtin(cache, vocab_size=VOCAB, max_mb=MAX_MB, log=quiet)


def test_prepare_layout_and_meta(prepared):
    cache, out = prepared
    assert out.parent == cache and out.name.startswith("builtin-") and len(out.name) == len("builtin-") + 12
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format_version"] == 1
    assert meta["source"].startswith("builtin:python-stdlib-3.")
    assert meta["vocab_size"] == VOCAB and meta["dtype"] == "uint16"
    assert meta["fingerprint"].startswith(out.name[len("builtin-"):])
    for key in ("tokenizer", "tokenizer_sha256", "eos_id", "created"):
        assert meta[key] != ""
    files = select_files(list_stdlib_files(), MAX_MB)
    assert sum(f.size for f in files) >= MAX_MB * 1e6
    train, val = split_files(files)
    assert meta["splits"]["train"]["documents"] == len(train) > 0
    assert meta["splits"]["val"]["documents"] == len(val) > 0

    dd = DataDir(out, verify=True)
    for split in ("train", "val"):
        assert dd.num_tokens(split) == meta["splits"][split]["tokens"] > 0
        tokens = np.concatenate([np.asarray(s) for s in dd.shards(split)])
        # one EOS after every document, the last token included
        assert int((tokens == dd.eos_id).sum()) == meta["splits"][split]["documents"]
        assert tokens[-1] == dd.eos_id
    x, y = RandomWindowLoader(dd, "train", LoaderOptions(64, 2, seed=0)).next_batch()
    assert x.shape == (2, 64)


def test_tokenizer_round_trip(prepared):
    _, out = prepared
    tok = DataDir(out).tokenizer
    for s in [
        "def f(x):\n    return x ** 2  # square\n",
        "   leading spaces\t\ttabs\r\nand CRLF",
        "unicode: héllo wörld — 日本語 😀 \x00\x7f",
        "",
    ]:
        assert tok.decode(tok.encode(s).ids) == s


def test_second_call_is_cache_hit(prepared):
    cache, out = prepared
    before = snapshot(out)
    before_entries = entries(cache)
    logs: list[str] = []
    again = prepare_builtin(cache, vocab_size=VOCAB, max_mb=MAX_MB, log=logs.append)
    assert again == out
    assert snapshot(out) == before  # nothing rewritten
    assert entries(cache) == before_entries  # no temporary left, nothing new
    assert any("cached" in line for line in logs)


def test_deterministic(prepared, tmp_path):
    _, out = prepared
    other = prepare_builtin(tmp_path, vocab_size=VOCAB, max_mb=MAX_MB, log=quiet)
    assert other.name == out.name
    for name in ("tokenizer.json", "train-00000.bin", "val-00000.bin"):
        assert (other / name).read_bytes() == (out / name).read_bytes(), name


def test_fingerprint_tracks_inputs():
    files = select_files(list_stdlib_files(), 0.05)
    fp = fingerprint(files, VOCAB, 0.05)
    assert fp == fingerprint(files, VOCAB, 0.05)
    assert fp != fingerprint(files, VOCAB + 1, 0.05)
    assert fp != fingerprint(files, VOCAB, 0.06)
    assert fp != fingerprint(files[:-1], VOCAB, 0.05)


def test_split_by_file():
    files = list_stdlib_files()
    assert files == sorted(files, key=lambda f: f.rel)
    assert not any("site-packages" in f.rel or "dist-packages" in f.rel for f in files)
    train, val = split_files(files)
    assert {f.rel for f in val} == {f.rel for f in files if is_val(f.rel)}
    assert len(train) + len(val) == len(files)
    # a cap too small to catch a val file still yields a non-empty val split
    small = [f for f in files if not is_val(f.rel)][:3]
    train, val = split_files(small)
    assert len(train) == 2 and len(val) == 1
    assert len(select_files(files, 1e-9)) == 2


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("crash while tokenizing (simulated)")

    monkeypatch.setattr(builtin, "_write_split", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        prepare_builtin(tmp_path, vocab_size=300, max_mb=0.02, log=quiet)
    assert entries(tmp_path) == []


def test_a_killed_build_is_cleaned_up_by_the_next_one_at_once(tmp_path):
    """kill -9 during a build leaves its hidden directory; the next build (holding the lock, so
    no build of the same inputs can be running) removes it without waiting for it to age."""
    files = select_files(list_stdlib_files(), 0.02)
    fp = fingerprint(files, 300, 0.02)
    left = tmp_path / f".builtin-{fp[:12]}.tmp-killed"
    left.mkdir()
    (left / "train-00000.bin").write_bytes(b"x" * 1000)
    other = tmp_path / ".builtin-0123456789ab.tmp-running"  # another fingerprint's build: not ours to judge
    other.mkdir()
    out = prepare_builtin(tmp_path, vocab_size=300, max_mb=0.02, log=quiet)
    assert entries(tmp_path) == sorted([other.name, out.name])


def test_incomplete_directory_is_rebuilt(tmp_path):
    files = select_files(list_stdlib_files(), 0.02)
    out = tmp_path / f"builtin-{fingerprint(files, 300, 0.02)[:12]}"
    out.mkdir()
    (out / "train-00000.bin").write_bytes(b"half a shard")  # e.g. left by hand; no meta.json
    got = prepare_builtin(tmp_path, vocab_size=300, max_mb=0.02, log=quiet)
    assert got == out
    DataDir(out, verify=True)
    assert entries(tmp_path) == [out.name]


def test_concurrent_prepares(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []
    logs: list[str] = []

    def run():
        try:
            results.append(prepare_builtin(tmp_path, vocab_size=300, max_mb=0.05, log=logs.append))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 2 and results[0] == results[1]
    DataDir(results[0], verify=True)
    assert entries(tmp_path) == [results[0].name]
    assert sum("preparing" in line for line in logs) == 1  # the lock made the other one wait


def test_publish_race_keeps_the_winner(prepared, tmp_path):
    """Without the lock (two machines sharing a cache on a filesystem without flock) the loser discards its copy."""
    import shutil

    _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    winner = tmp_path / out.name
    shutil.copytree(out, winner)
    before = snapshot(winner)
    loser = tmp_path / ".builtin-loser.tmp-x"
    shutil.copytree(out, loser)
    builtin._publish(loser, winner, meta["fingerprint"])
    assert not loser.exists()
    assert snapshot(winner) == before
