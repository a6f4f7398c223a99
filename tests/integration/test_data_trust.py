"""Data that can be trusted after a full disk, a second writer, a kill -9, a corrupted shard or a
symbolic link: ``flopwise prepare`` and the data check a run makes when it opens its data.

The full-disk tests use a real small filesystem (a tmpfs mounted by the ``small_fs``
fixture; they skip where mounting is not permitted). The kill tests start real
processes and find their children in /proc. No test measures time: every wait is a
poll with a generous bound.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.data import datadir as datadir_mod
from flopwise.data.datadir import DataDir, DataDirError, check_cache_path, open_data_dir
from flopwise.data.prepare import PrepareError, PrepareOptions, output_lock, prepare
from flopwise.data.shards import HEADER_SIZE
from flopwise.train.trainer import train

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
POLL_S = 0.02
BOUND_S = 120  # generous: only a broken implementation waits this long


# --------------------------------------------------------------------------- fixtures and helpers

def remount_read_only(point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True, capture_output=True, timeout=60)


def write_corpus(path: Path, n_docs: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n_docs):
            words = rng.choice(WORDS, size=int(rng.integers(5, 80)))
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(words)}) + "\n")
    return path


def left(folder: Path) -> list[str]:
    """What a folder holds, less prepare's (harmless, hidden) lock directories."""
    return sorted(n for n in os.listdir(folder) if not n.endswith(".lock"))


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def children(pid: int) -> dict[int, int]:
    """{child pid: its start time} of ``pid``, found by scanning /proc (no psutil here)."""
    kids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[1] == pid:
                kids[int(entry)] = st[2]
    return kids


def running(pid: int, started: int) -> bool:
    """The same process (pid and start time) exists and is not a zombie."""
    st = proc_stat(pid)
    return st is not None and st[2] == started and st[0] not in "ZX"


def poll(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting {BOUND_S}s for {what}")
        time.sleep(POLL_S)


# --------------------------------------------------------------------------- (a) a full disk

def test_a_full_disk_stops_prepare_with_one_line_and_leaves_the_old_output_untouched(small_fs, tmp_path, capsys):
    fs = small_fs("256k")
    out = fs / "data"
    args = ["--vocab-size", "300", "--tokenizer-sample-mb", "0.1", "--workers", "1", "--out", str(out)]
    assert cli_main(["prepare", str(write_corpus(tmp_path / "small.jsonl", 100)), *args]) == 0
    before = snapshot(out)
    capsys.readouterr()

    # ~1 MB of tokens does not fit in what is left of 256 kB.
    rc = cli_main(["prepare", str(write_corpus(tmp_path / "big.jsonl", 6000, seed=1)), *args, "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("flopwise prepare: cannot write ") and f"{fs}/.data.partial/" in line
    assert "no space left on the device" in line and f"{out} was left as it was" in line
    assert snapshot(out) == before  # the earlier complete output, byte for byte
    assert left(fs) == ["data"]  # no .data.partial: the space is given back
    DataDir(out, verify=True)

    # With no earlier output there is nothing to keep, and nothing is left either.
    rc = cli_main(["prepare", str(tmp_path / "big.jsonl"), *args[:-1], str(fs / "other")])
    assert rc == 2 and f"nothing was written to {fs / 'other'}" in capsys.readouterr().err
    assert left(fs) == ["data"]


@pytest.mark.slow
def test_a_full_disk_while_preparing_the_embedded_corpus_is_one_line(small_fs, cli, tmp_path):
    fs = small_fs("64k")
    r = cli("train", f"data.cache_dir={fs}", "data.builtin_vocab_size=300", "data.builtin_max_mb=0.5",
            "model.vocab_size=512", "train.max_steps=1", f"train.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the embedded corpus could not be prepared in" in r.stderr and "no space left on the device" in r.stderr
    assert not [p for p in fs.iterdir() if ".tmp" in p.name]  # the build directory was removed


# --------------------------------------------------------------------------- (b) one writer per output

HOLD_LOCK = """
import sys, time
from pathlib import Path
from flopwise.data.prepare import output_lock
output_lock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_prepare_into_the_same_output_is_refused_until_the_holder_dies(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 100)
    out = tmp_path / "data"
    opts = dict(source=str(corpus), out=str(out), vocab_size=300, workers=1, tokenizer_sample_mb=0.1)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(PrepareError, match=rf"being written by another flopwise prepare: .*pid {holder.pid} "):
            prepare(PrepareOptions(**opts), log=lambda s: None)
        assert not out.exists() and not (tmp_path / ".data.partial").exists()
        holder.send_signal(signal.SIGKILL)  # a killed holder: the kernel drops its lock
        holder.wait()
        DataDir(prepare(PrepareOptions(**opts), log=lambda s: None), verify=True)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()


def test_the_lock_is_beside_the_output_so_a_published_output_cannot_take_it_away(tmp_path):
    out = tmp_path / "data"
    lock = output_lock(out)
    assert lock.path.parent == tmp_path / ".data.lock"  # never inside out, which prepare replaces by a rename
    corpus = write_corpus(tmp_path / "corpus.jsonl", 100)
    with lock:  # held while another prepare (same process, another file description) tries
        with pytest.raises(PrepareError, match="being written by another flopwise prepare"):
            prepare(PrepareOptions(source=str(corpus), out=str(out), vocab_size=300, workers=1), log=lambda s: None)


# --------------------------------------------------------------------------- (c) runs check their shards

def copy_data(small_builtin, tmp_path) -> Path:
    _, path = small_builtin
    data = tmp_path / "data"
    shutil.copytree(path, data)
    return data


def test_train_refuses_a_shard_overwritten_with_one_repeated_valid_token(small_builtin, tiny_overrides, tmp_path):
    data = copy_data(small_builtin, tmp_path)
    shard = sorted(data.glob("train-*.bin"))[0]
    raw = shard.read_bytes()
    n = (len(raw) - HEADER_SIZE) // 2
    shard.write_bytes(raw[:HEADER_SIZE] + np.full(n, 42, dtype=np.uint16).tobytes())  # valid ids, header kept
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=2", f"data.path={data}"])
    with pytest.raises(DataDirError, match=rf"{shard.name}: checksum mismatch"):
        train(cfg, log=lambda s: None)


def test_a_run_on_data_of_the_piece_routing_recipe_warns_that_held_out_loss_reads_low(small_builtin, tiny_overrides,
                                                                                     tmp_path):
    data = copy_data(small_builtin, tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    meta["recipe"] = {"version": 2}  # as flopwise prepare's recipe 2 wrote it: pieces continuing into val
    meta["splits"]["val"]["continued_documents"] = 5
    (data / "meta.json").write_text(json.dumps(meta))
    lines = []
    train(build_config(overrides=tiny_overrides + ["train.max_steps=1", f"data.path={data}"]), log=lines.append)
    warning = [ln for ln in lines if "WARNING: val holds pieces of at least 5 documents that train also holds" in ln]
    assert warning and "--overwrite" in warning[0], lines[:8]


def rewrite_with_valid_crc(shard: Path, ids: np.ndarray) -> None:
    raw = bytearray(shard.read_bytes())
    magic, version, code, vocab, n, _crc = struct.unpack_from("<8sIIQQI", raw)
    head = struct.pack("<8sIIQQI", magic, version, code, vocab, n, zlib.crc32(ids.tobytes()) & 0xFFFFFFFF)
    shard.write_bytes(head + bytes(raw[len(head):HEADER_SIZE]) + ids.tobytes())


def test_an_id_beyond_the_vocabulary_is_found_when_the_data_is_opened(small_builtin, tmp_path):
    data = copy_data(small_builtin, tmp_path)
    shard = data / "val-00000.bin"
    ids = np.frombuffer(shard.read_bytes()[HEADER_SIZE:], dtype=np.uint16).copy()
    ids[-3] = 60_000  # one id, checksum made to match: no sampled window need ever hit it
    rewrite_with_valid_crc(shard, ids)
    cfg = build_config(overrides=[f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DataDirError, match=rf"val-00000.bin: token id 60000 at position {len(ids) - 3:,} "
                                           r"is not below the vocabulary size 512"):
        open_data_dir(cfg.data, log=lambda s: None)


@pytest.fixture
def count_reads(monkeypatch):
    reads: list[str] = []
    real = datadir_mod.scan_tokens

    def counting(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datadir_mod, "scan_tokens", counting)
    return reads


def test_shard_checks_are_remembered_per_file_identity(small_builtin, tmp_path, count_reads):
    data = copy_data(small_builtin, tmp_path)
    cfg = build_config(overrides=[f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"]).data
    shards = sorted(p.name for p in data.glob("*.bin"))
    lines = []
    open_data_dir(cfg, log=lines.append)
    assert sorted(count_reads) == shards and any("checked" in line for line in lines)
    assert check_cache_path(cfg.cache_dir, data).is_file()
    count_reads.clear()
    open_data_dir(cfg, log=lines.append)
    assert count_reads == []  # a second start reads no token

    # A shard corrupted in place, its mtime put back: the ctime still tells, and it is read again.
    shard = data / "train-00000.bin"
    st = shard.stat()
    raw = bytearray(shard.read_bytes())
    raw[HEADER_SIZE + 7] ^= 0x01
    with open(shard, "r+b") as f:
        f.write(raw)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataDirError, match="train-00000.bin: checksum mismatch"):
        open_data_dir(cfg, log=lines.append)
    assert count_reads == ["train-00000.bin"]


def test_read_only_data_and_cache_folders_still_work(small_builtin, small_fs, tmp_path, count_reads):
    _, path = small_builtin
    data_fs, cache_fs = small_fs("4m"), small_fs("64k")
    shutil.copytree(path, data_fs / "data")
    remount_read_only(data_fs)
    data = data_fs / "data"
    cfg = build_config(overrides=[f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"]).data
    open_data_dir(cfg, log=lambda s: None)
    count_reads.clear()
    open_data_dir(cfg, log=lambda s: None)
    assert count_reads == []  # a read-only data directory: the record is in the user's cache folder

    remount_read_only(cache_fs)
    cfg = build_config(overrides=[f"data.path={data}", f"data.cache_dir={cache_fs}"]).data
    for _ in range(2):  # nowhere to remember: every start checks again, and says why
        lines = []
        count_reads.clear()
        assert open_data_dir(cfg, log=lines.append).num_tokens("val") > 0
        assert len(count_reads) == len(list(data.glob("*.bin")))
        assert any("not remembered" in line and "read-only file system" in line.lower() for line in lines)


# --------------------------------------------------------------------------- (d) workers die with prepare

def test_workers_of_a_killed_prepare_die_with_it(tmp_path):
    # ~16 MB of text: many seconds of tokenizing, so the prepare is still running when it is killed.
    rng = np.random.default_rng(0)
    line = " ".join(rng.choice(WORDS, size=4000))
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(600):
            f.write(json.dumps({"text": f"{i} {line}"}) + "\n")
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flopwise", "prepare", str(corpus), "--vocab-size", "300",
                                 "--tokenizer-sample-mb", "0.1", "--workers", "2", "--out", str(tmp_path / "data")],
                                stdout=subprocess.DEVNULL, stderr=err)
    workers: dict[int, int] = {}
    try:
        def two_workers() -> bool:
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
            workers.update(children(proc.pid))
            return len(workers) >= 2

        poll(two_workers, "the prepare's worker processes")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL  # killed while working, not finished
        poll(lambda: not any(running(pid, t) for pid, t in workers.items()), "the workers to die with their parent")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid, t in workers.items():  # only the processes this test started
            if running(pid, t):
                os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- (e) links out of the input

def test_prepare_does_not_read_a_link_out_of_its_input_folder(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_corpus(folder / "part-0.jsonl", 100)
    secret = tmp_path / "outside" / "hostname.txt"
    secret.parent.mkdir()
    secret.write_text("SECRET-HOST-NAME " * 50)
    (folder / "host.txt").symlink_to(secret)  # like a link to /etc/hostname
    (folder / "etc").symlink_to(secret.parent, target_is_directory=True)
    lines = []
    out = prepare(PrepareOptions(source=str(folder), out=str(tmp_path / "data"), vocab_size=300, workers=1,
                                 tokenizer_sample_mb=0.1), log=lines.append)
    dd = DataDir(out)
    text = "".join(dd.tokenizer.decode(np.asarray(s).tolist()) for split in dd.splits for s in dd.shards(split))
    assert "SECRET" not in text and "doc 0:" in text
    note = next(line for line in lines if "symbolic link" in line)
    assert "host.txt -> " in note and "etc -> " in note and "--follow-links" in note
    assert "2 link(s) leading out of the folder not followed" in dd.meta["source"]

    followed = prepare(PrepareOptions(source=str(folder), out=str(tmp_path / "followed"), vocab_size=300, workers=1,
                                      tokenizer_sample_mb=0.1, follow_links=True), log=lambda s: None)
    dd = DataDir(followed)
    assert "SECRET" in "".join(dd.tokenizer.decode(np.asarray(s).tolist()) for split in dd.splits
                               for s in dd.shards(split))
