"""The embedded corpus: the Python standard library's own source, prepared once and cached.

Every machine that runs flopwise has it (about 1,800 ``.py`` files, ~31 MB, ~8.6M
tokens with an 8192-token BPE on CPython 3.11) and no network is needed, so
``flopwise train`` with no arguments always has data.

Recipe (any change to it must bump ``RECIPE_VERSION``):

- files: ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, excluding
  ``site-packages``/``dist-packages``/``__pycache__``; sorted by relative path (``/``
  separators); read as UTF-8 with ``errors="replace"``; one document per file.
- ``max_mb > 0``: files are taken in sorted order until their total size reaches
  ``max_mb`` * 10^6 bytes (at least two files), then split.
- split by file: a file is ``val`` when ``crc32(relative path) % 100 < VAL_PERCENT``
  (~4.5% of the text, ~390k tokens at full size). Both splits are kept non-empty.
- tokenizer: byte-level BPE trained on the train split only (seconds for the full
  corpus; docs/data.md shows a real run), ``<|endoftext|>`` after every document.

The output directory is ``<cache_dir>/builtin-<fingerprint[:12]>``, where the
fingerprint hashes every input (Python version, each file's path, size and content
hash, vocab size, cap, recipe/shard format versions, tokenizers version).  It is built
in a hidden temporary directory next to it and renamed into place at the end, so a
directory under the final name is always complete.  Concurrent prepares (every rank
under torchrun) serialise on a lock file, so one builds and the others find the cache;
even without the lock they could not corrupt each other (the loser discards its copy).
The lock is a blocking ``flock`` (not :class:`flopwise.fsio.DirLock`, which refuses a
second holder): a second process should wait for the corpus, not fail. The kernel drops it
when its holder dies, so a build killed with ``kill -9`` never blocks the next one, and
the next one removes the killed build's temporary directory (under the lock, no build of
the same fingerprint can be running). A failed build (a full disk) removes its temporary
directory and raises the ``OSError``, naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from ..fsio import fsync_dir, read_json, umask, write_file
from .meta import write_meta
from .shards import FORMAT_VERSION, ShardError, SplitWriter, dtype_for_vocab, read_header
from .tokenizer import encode_documents, eos_id, train_bpe

RECIPE_VERSION = 1
VAL_PERCENT = 5
MAX_SHARD_TOKENS = 100_000_000
ENCODE_BATCH_DOCS = 256  # documents per encode_batch call ...
ENCODE_BATCH_CHARS = 8_000_000  # ... and at most this many characters (bounded memory)
STALE_TMP_SECONDS = 3600  # hidden build directories older than this are leftovers of a crash
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class SourceFile:
    rel: str  # relative path with "/" separators
    path: Path
    size: int


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: str | os.PathLike | None = None) -> list[SourceFile]:
    """Every ``.py`` file of the standard library, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    files: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            p = Path(dirpath) / name
            try:
                size = p.stat().st_size
            except OSError:  # dangling link, permission: not part of the corpus
                continue
            files.append(SourceFile(p.relative_to(root).as_posix(), p, size))
    files.sort(key=lambda f: f.rel)
    return files


def select_files(files: list[SourceFile], max_mb: float) -> list[SourceFile]:
    """All files, or (max_mb > 0) a sorted-order prefix reaching max_mb*1e6 bytes (>= 2 files)."""
    if max_mb <= 0:
        return list(files)
    cap = max_mb * 1_000_000
    out: list[SourceFile] = []
    total = 0
    for f in files:
        if total >= cap and len(out) >= 2:
            break
        out.append(f)
        total += f.size
    return out


def is_val(rel: str) -> bool:
    return zlib.crc32(rel.encode("utf-8")) % 100 < VAL_PERCENT


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """Deterministic (train, val) split by file; both non-empty when there are >= 2 files."""
    if len(files) < 2:
        raise ValueError(f"the embedded corpus needs at least 2 source files, found {len(files)}")
    train = [f for f in files if not is_val(f.rel)]
    val = [f for f in files if is_val(f.rel)]

    def key(f: SourceFile) -> tuple[int, str]:
        return zlib.crc32(f.rel.encode("utf-8")) % 100, f.rel

    if not val:  # a small cap can miss every val file: move the most val-like one
        moved = min(train, key=key)
        train.remove(moved)
        val.append(moved)
    elif not train:
        moved = max(val, key=key)
        val.remove(moved)
        train.append(moved)
    return train, val


def fingerprint(files: list[SourceFile], vocab_size: int, max_mb: float) -> str:
    """Hash of every input of the prepared directory (hex blake2b-256)."""
    h = hashlib.blake2b(digest_size=32)
    head = {
        "recipe": RECIPE_VERSION,
        "shard_format": FORMAT_VERSION,
        "python": sys.version.split()[0],
        "tokenizers": tokenizers.__version__,
        "vocab_size": int(vocab_size),
        "max_mb": float(max_mb),
        "val_percent": VAL_PERCENT,
        "max_shard_tokens": MAX_SHARD_TOKENS,
    }
    h.update(json.dumps(head, sort_keys=True).encode())
    for f in files:
        content = hashlib.blake2b(f.path.read_bytes(), digest_size=16).hexdigest()
        h.update(f"\n{f.rel}\0{f.size}\0{content}".encode())
    return h.hexdigest()


def read_text(f: SourceFile) -> str:
    """A source file's text, one document (undecodable bytes replaced)."""
    return f.path.read_bytes().decode("utf-8", errors="replace")


def is_complete(out: Path, fp: str | None = None) -> bool:
    """True when ``out`` holds a finished prepare (with fingerprint ``fp`` if given)."""
    try:
        meta = read_json(out / "meta.json")  # a malformed one (nested too deeply ...): not complete
        if fp is not None and meta.get("fingerprint") != fp:
            return False
        if meta.get("format_version") != FORMAT_VERSION:
            return False
        if not (out / meta["tokenizer"]).is_file():
            return False
        for split in meta["splits"].values():
            n = sum(read_header(out / name).n_tokens for name in split["shards"])
            if n != split["tokens"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ShardError):
        return False


def _batches(files: list[SourceFile]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for f in files:
        text = read_text(f)
        if batch and (len(batch) >= ENCODE_BATCH_DOCS or chars + len(text) > ENCODE_BATCH_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch


def _write_split(tok, files: list[SourceFile], split: str, out: Path, vocab_size: int, eos: int) -> dict:
    """Tokenize ``files`` (EOS after each) into ``split-NNNNN.bin`` shards under ``out``."""
    writer = SplitWriter(out, split, vocab_size, MAX_SHARD_TOKENS)
    try:
        for batch in _batches(files):
            ids, lengths = encode_documents(tok, batch, None, eos, dtype_for_vocab(vocab_size))
            writer.write(ids)
            writer.documents += len(lengths)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _clean_stale(cache_dir: Path, fp: str) -> None:
    """Remove what killed builds left: this fingerprint's temporary directories at once (the
    caller holds its lock, so none of them is being written), any other one after an hour."""
    now = time.time()
    for p in cache_dir.glob(".builtin-*.tmp*"):
        try:
            if p.name.startswith(f".builtin-{fp[:12]}.tmp") or now - p.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def prepare_builtin(
    cache_dir: str | os.PathLike,
    vocab_size: int = 8192,
    max_mb: float = 0.0,
    log: Log = print,
) -> Path:
    """Prepare (or find cached) the embedded corpus; returns its data directory."""
    t0 = time.perf_counter()
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = select_files(list_stdlib_files(), max_mb)
    fp = fingerprint(files, vocab_size, max_mb)
    out = cache_dir / f"builtin-{fp[:12]}"
    if is_complete(out, fp):
        log(f"data: embedded corpus cached at {out}")
        return out

    with _build_lock(cache_dir / f".builtin-{fp[:12]}.lock"):
        if is_complete(out, fp):  # another process built it while we waited for the lock
            log(f"data: embedded corpus cached at {out}")
            return out
        _clean_stale(cache_dir, fp)
        _build(files, fp, out, vocab_size, max_mb, log)
    log(f"data: ready in {time.perf_counter() - t0:.1f}s: {out}")
    return out


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock so concurrent prepares (e.g. every rank under torchrun)
    wait for one build instead of repeating it. The publish is atomic whatever happens;
    the lock is what makes removing this fingerprint's leftover build directories safe."""
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build(files: list[SourceFile], fp: str, out: Path, vocab_size: int, max_mb: float, log: Log) -> None:
    cache_dir = out.parent
    train_files, val_files = split_files(files)
    nbytes = sum(f.size for f in files)
    log(
        f"data: preparing the embedded corpus (Python {sys.version.split()[0]} stdlib: "
        f"{len(files)} files, {nbytes / 1e6:.1f} MB; {len(train_files)} train / {len(val_files)} val) "
        f"into {out}"
    )
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".builtin-{fp[:12]}.tmp-"))
    try:
        t = time.perf_counter()
        tok = train_bpe((read_text(f) for f in train_files), vocab_size)
        write_file(tmp / "tokenizer.json", tok.to_str(pretty=True))  # the bytes tok.save() writes
        real_vocab = tok.get_vocab_size()
        eos = eos_id(tok)
        log(f"data: trained byte-level BPE, vocab {real_vocab}, in {time.perf_counter() - t:.1f}s")

        splits = {}
        for split, split_files_ in (("train", train_files), ("val", val_files)):
            t = time.perf_counter()
            splits[split] = _write_split(tok, split_files_, split, tmp, real_vocab, eos)
            log(
                f"data: {split}: {splits[split]['tokens']:,} tokens, {len(split_files_)} documents, "
                f"{len(splits[split]['shards'])} shard(s) in {time.perf_counter() - t:.1f}s"
            )

        write_meta(tmp, source=f"builtin:python-stdlib-{sys.version.split()[0]}", vocab_size=real_vocab,
                   eos_id=eos, bos_id=None, splits=splits, fingerprint=fp,
                   recipe={"version": RECIPE_VERSION, "val_percent": VAL_PERCENT, "max_mb": max_mb,
                           "requested_vocab_size": vocab_size, "source_bytes": nbytes})
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; give the usual mode
        _publish(tmp, out, fp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path, fp: str) -> None:
    """Rename the finished ``tmp`` to ``out``; if another prepare won the race, keep theirs."""
    try:
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    except OSError:
        if not out.exists():
            raise
    if is_complete(out, fp):  # a concurrent prepare finished first: same inputs, same result
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # ``out`` exists but is not a complete prepare (edited or damaged by hand): set it aside.
    trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-old-"))
    os.rename(out, trash / "old")
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_complete(out, fp):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(trash, ignore_errors=True)
