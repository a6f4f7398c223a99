"""``flopwise prepare``: text -> tokenizer -> validated token shards, tokenized in parallel.

Pipeline (bounded memory whatever the corpus size)::

    source.documents()  ->  batches of documents  ->  worker processes (encode_batch)
        ->  in order  ->  router (train / val / test by token budget)  ->  rolling shards

- **Tokenizer**: a ``tokenizer.json`` given with ``--tokenizer`` (SmolLM's, Llama-3's,
  Qwen's ...) or a byte-level BPE of ``--vocab-size`` trained on the first
  ``--tokenizer-sample-mb`` of the source. Documents are encoded without the tokenizer's
  own special-token template; flopwise adds BOS (where the tokenizer defines one) before
  and EOS after every document itself, so every tokenizer gets the same layout.
- **Budgets**: ``--train-tokens`` / ``--val-tokens`` / ``--test-tokens`` are met exactly
  (the last document of a split is cut). Documents are routed as the stream goes: each
  goes to the split furthest behind its share of the budget, so every split samples the
  whole stream evenly rather than its beginning, and the first document always goes to
  validation (a long one: its tail). Documents go whole to one split, so held-out text does not share a document
  with training text -- except a document over ``ROUTE_PIECE_TOKENS`` (4,096) too long
  for the held-out split's room (its budget's rest, and at most one share ahead of its
  share so far: a book in one ``.txt``, or a long document early in the stream), which
  gives that split its tail and train its head (:class:`Router`). Such a document is
  counted once, in the split holding its first token (``documents`` per split in
  ``meta.json``), and as ``continued_documents`` in the other, so the splits' document
  counts add up to the documents used (``meta.json`` ``documents``, and the count in the
  final summary; documents read but left out once the budget is met are not counted).
  Without a train budget the whole source is used and validation gets
  ``--val-fraction`` of the tokens, spread along the stream; an explicit ``--val-tokens``
  or ``--test-tokens`` is then taken from the head of the stream, the only way to meet it
  without knowing the source's size in advance. When neither ``--val-tokens`` nor
  ``--val-fraction`` is given, the default share (0.5%) has a floor, :func:`default_val_floor`:
  the tokens the default run's validation windows need side by side, capped at a tenth of
  the tokens (:class:`ValFloor`). Tokens per
  document (mean and median) are estimated from the first encoded batch, the sample that
  tells how many documents the budget needs; streaming stops as soon as it is met, so the
  source is never tokenized beyond the budget (plus the batches in flight).
- **Workers**: processes (forked where possible; each loads the tokenizer once) encode batches of
  documents; results are consumed in submission order, so the output is deterministic
  and independent of the worker count. At most ``2 x workers`` batches are in flight.
  The default worker count is the usable cores, lowered so that the per-worker memory
  estimate fits in half the available memory. Workers die with the prepare that started
  them, however it ends (``kill -9`` included: see :func:`die_with_parent`), so a killed
  prepare leaves no process holding cores and memory.
- **Atomic**: everything is written into a hidden sibling directory ``.NAME.partial`` and
  renamed to ``--out`` at the end, ``meta.json`` included; an interrupted prepare leaves
  no directory that looks prepared, and a rerun starts over cleanly. A rerun with the same
  inputs on a finished directory is a no-op; different inputs need ``--overwrite``. A
  replaced directory is renamed aside (``.NAME.old``) just before the new one takes its
  name; a kill between those two renames is undone by the next prepare.
- **Failures**: a write that fails (a full disk, a read-only or vanished folder) removes
  the partial output and stops with one line naming the file and the reason; an earlier
  complete ``--out`` is untouched.
- **One writer**: a prepare holds a lock (:func:`output_lock`) for its whole run; a second
  prepare into the same ``--out`` is refused with the holder's pid and command. The kernel
  drops the lock when its holder dies, so a killed prepare never blocks the next one.
- **Optional packages**: the ones the source needs (``hf:`` -> datasets, ``.parquet`` ->
  pyarrow, ``.zst`` -> zstandard) are all checked, and all named with the command that
  installs them, before the source is opened or anything is written
  (:func:`flopwise.deps.missing_for_source`).
- **Links**: a folder SOURCE's symbolic links are read only while they stay inside it
  unless ``follow_links`` (``--follow-links``); links not followed are listed in the log
  (see :mod:`flopwise.data.sources`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import multiprocessing as mp
import os
import select
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np
from tokenizers import Tokenizer

from flopwise.config import NAME_MAX, path_problems
from flopwise.errors import FlopwiseError

from ..deps import missing_for_source
from ..fsio import (
    DirLock,
    LockedError,
    describe_write_error,
    fsync_dir,
    is_disk_full,
    read_json,
    replace_dir,
    write_file,
    write_reason,
)
from .datadir import DataDir
from .meta import TOKENIZER_FILE, write_meta
from .shards import FORMAT_VERSION, SplitWriter, dtype_for_vocab
from .sources import Source, open_source
from .tokenizer import encode_documents, file_sha256, load_tokenizer, special_ids, train_bpe

Log = Callable[[str], None]
RECIPE_VERSION = 3  # 2: long documents routed in pieces; 3: whole, or a train head and a held-out tail
ROUTE_PIECE_TOKENS = 4096  # the least a held-out split takes of a long document it shares with train
SPLITS = ("val", "test", "train")  # routing priority on ties: validation first


DEFAULT_VAL_FRACTION = 0.005  # validation's share when neither --val-tokens nor --val-fraction is given
# The most of the tokens the default validation floor may take: train keeps at least 90%
# (the 90/10 split of small corpora, nanoGPT's shakespeare among them). Past that a corpus
# is too small for the default eval without overlap, and more validation would starve train.
VAL_FLOOR_MAX_SHARE = 0.1
# Validation's share is met a whole document at a time, so it is overshot by up to a document;
# past this many times the share asked, the summary says what validation got and why.
OVER_SHARE = 2
# A fixed request (--val-tokens, --test-tokens) that holds out more than this share of the source's
# tokens is said in the summary: the docs' --val-tokens 200K is 15% of a 1.4M-token corpus.
LARGE_HOLDOUT = 0.10


class PrepareError(FlopwiseError, ValueError):
    """Bad ``flopwise prepare`` input; the message names the flag, file or value."""


@dataclass(frozen=True)
class ValFloor:
    """The least validation a default split gets: ``windows`` windows of ``seq_len + 1``
    tokens side by side (``tokens``), for the eval of the default preset ``preset``; never
    more than ``max_share`` of the tokens (of validation's and train's over the whole source,
    of the three budgets with a train budget)."""

    tokens: int
    windows: int
    seq_len: int
    preset: str
    max_share: float = VAL_FLOOR_MAX_SHARE

    def describe(self) -> str:
        return (f"the default run (preset {self.preset}) validates on {self.windows:,} windows of "
                f"{self.seq_len:,}+1 tokens, {self.tokens:,} without overlap")


@functools.lru_cache(maxsize=1)
def default_val_floor() -> ValFloor:
    """The validation floor of a default split: what the default run's validation needs so its
    windows do not overlap. The run is ``flopwise train`` with no preset (``DEFAULT_PRESET``,
    ``tiny``: its ``train.seq_len``, not the model's ``max_seq_len`` nor a larger preset's):
    ``eval.windows`` windows (as the trainer builds them,
    :func:`flopwise.train.setup.setup`) of ``seq_len + 1`` tokens, the count
    :func:`flopwise.data.loader.overlap_note` checks against the split."""
    from flopwise.config import build_config  # lazy: the config is only needed for a default split

    cfg = build_config()
    windows = cfg.eval.windows
    return ValFloor(tokens=windows * (cfg.train.seq_len + 1), windows=windows, seq_len=cfg.train.seq_len,
                    preset=cfg.preset)


@dataclass
class PrepareOptions:
    source: str
    out: str
    tokenizer: str = ""  # path to a tokenizer.json; empty = train a byte-level BPE
    vocab_size: int = 0  # for the trained BPE
    train_tokens: int = 0  # 0 = the whole source
    val_tokens: int = 0  # 0 = val_fraction of the train budget (or of the source)
    test_tokens: int = 0
    # None = DEFAULT_VAL_FRACTION with a floor (default_val_floor) unless val_tokens is given;
    # a number = exactly that share, no floor
    val_fraction: float | None = None
    workers: int = 0  # 0 = chosen from cores and memory
    text_field: str = "text"
    hf_split: str = "train"
    shuffle_buffer: int = 0  # hf: streaming shuffle buffer (0 = source order)
    seed: int = 0
    tokenizer_sample_mb: float = 100.0
    shard_tokens: int = 100_000_000
    batch_chars: int = 2_000_000  # characters per encode batch (bounds memory per worker)
    batch_docs: int = 1024
    overwrite: bool = False
    data_files: list[str] = field(default_factory=list)  # hf: local data files (hf:json etc.)
    follow_links: bool = False  # folder SOURCE: also read symbolic links that lead out of it

    def validate(self) -> None:
        p = []
        if not self.out:
            p.append("--out DIR is required")
        if bool(self.tokenizer) == bool(self.vocab_size):
            p.append("give exactly one of --tokenizer FILE (load) and --vocab-size N (train a byte-level BPE)")
        if self.vocab_size and self.vocab_size < 257:
            p.append(f"--vocab-size must be >= 257 (256 bytes + EOS), got {self.vocab_size}")
        for flag, v in (("--train-tokens", self.train_tokens), ("--val-tokens", self.val_tokens),
                        ("--test-tokens", self.test_tokens), ("--workers", self.workers),
                        ("--shuffle-buffer", self.shuffle_buffer)):
            if v < 0:
                p.append(f"{flag} must be >= 0, got {v}")
        if self.val_fraction is not None and not 0 <= self.val_fraction < 1:
            p.append(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_tokens and self.val_fraction is not None:  # one of them would be ignored
            p.append(f"--val-tokens {self.val_tokens} and --val-fraction {self.val_fraction} both size validation: "
                     "give one (--val-tokens holds out exactly that many tokens, --val-fraction a share)")
        if self.val_tokens == 0 and self.fraction == 0:
            p.append("no validation split: give --val-tokens or a --val-fraction above 0")
        if not self.tokenizer_sample_mb > 0 or self.tokenizer_sample_mb == float("inf"):  # NaN fails the first
            p.append(f"--tokenizer-sample-mb must be a finite number > 0, got {self.tokenizer_sample_mb}")
        if self.shard_tokens <= 0:
            p.append(f"--shard-tokens must be > 0, got {self.shard_tokens}")
        if self.tokenizer and not Path(self.tokenizer).is_file():
            p.append(f"--tokenizer {self.tokenizer!r}: file does not exist")
        p += self._nesting_problems()
        if self.out:  # the output is written as ".NAME.partial" (and locked as ".NAME.lock") beside it
            p += path_problems("--out", self.out)
            name = os.fsencode(Path(self.out).name)
            if not p and len(name) + len(".partial") + 1 > NAME_MAX:
                p.append(f"--out: the name {Path(self.out).name[:60]!r}... is {len(name)} bytes; prepare writes it "
                         f"as .NAME.partial first, so it may be at most {NAME_MAX - len('.partial') - 1}")
        if p:
            raise PrepareError("; ".join(p))

    def _nesting_problems(self) -> list[str]:
        """An output inside a local source (the next read of the source would take the shards
        and meta.json for documents), or a source inside the output (--overwrite would delete
        it). Symbolic links are followed; ``builtin`` and ``hf:`` sources are not local."""
        if not self.out or self.source == "builtin" or self.source.startswith("hf:") or not self.source:
            return []
        src, out = Path(self.source).expanduser().resolve(), Path(self.out).expanduser().resolve()
        if src.is_dir() and (out == src or src in out.parents):
            return [f"--out {self.out} is inside the source {self.source}: its shards would be read as "
                    "documents by the next prepare of it; write it elsewhere"]
        if out in src.parents:
            return [f"the source {self.source} is inside --out {self.out}: writing the output would replace it"]
        return []

    @property
    def fraction(self) -> float:
        """Validation's share: ``val_fraction``, or ``DEFAULT_VAL_FRACTION`` when it was not given."""
        return DEFAULT_VAL_FRACTION if self.val_fraction is None else self.val_fraction

    def val_floor(self) -> ValFloor | None:
        """The floor of a default split (neither ``val_tokens`` nor ``val_fraction`` given), else None."""
        return default_val_floor() if not self.val_tokens and self.val_fraction is None else None

    def fraction_tokens(self) -> int:
        """Validation's budget from the share alone, with a train budget (no floor)."""
        return max(1, round(self.fraction * self.train_tokens))

    def targets(self) -> dict[str, int | None]:
        """Token budget per split (None = unbounded: the rest of the source).

        With a train budget and a default split, validation gets at least the floor's tokens,
        at most ``max_share`` of the three budgets together (whichever is less)."""
        if self.train_tokens:
            val = self.val_tokens or self.fraction_tokens()
            floor = self.val_floor()
            if floor is not None:
                rest = self.train_tokens + self.test_tokens
                val = max(val, min(floor.tokens, int(floor.max_share * rest / (1 - floor.max_share) + 1e-6)))
            return {"val": val, "test": self.test_tokens, "train": self.train_tokens}
        return {"val": self.val_tokens or None, "test": self.test_tokens, "train": None}

    def weights(self) -> dict[str, float]:
        """Share of the stream each split should receive while routing.

        With a train budget the shares are the budgets. Without one, validation gets
        ``val_fraction`` and train the rest; a split with an explicit budget (``--val-tokens``,
        ``--test-tokens``) is instead filled first (see ``fill_first``), its budget its share.
        """
        t = self.targets()
        if self.train_tokens:
            return {k: float(v or 0) for k, v in t.items()}
        share = 0.0 if self.val_tokens else self.fraction  # the floor is the Router's (val_floor)
        return {"val": float(self.val_tokens) or share, "test": float(self.test_tokens), "train": 1.0 - share}

    def fill_first(self) -> frozenset[str]:
        """Splits filled from the head of the stream before the others get a document.

        The source's size is unknown while streaming, so with an unbounded train split an
        explicit validation or test budget can only be met for sure by filling it first.
        """
        if self.train_tokens:
            return frozenset()
        return frozenset(s for s, n in (("val", self.val_tokens), ("test", self.test_tokens)) if n)


# --------------------------------------------------------------------------- tokenizer

def resolve_tokenizer(opts: PrepareOptions, documents: Iterator[str], log: Log):
    """Load ``--tokenizer`` or train a BPE on the first ``tokenizer_sample_mb`` of text."""
    if opts.tokenizer:
        try:
            tok = load_tokenizer(opts.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise PrepareError(f"--tokenizer: {e}") from None
        log(f"prepare: tokenizer {opts.tokenizer} (vocab {tok.get_vocab_size():,})")
        return tok
    limit = int(opts.tokenizer_sample_mb * 1e6)
    taken = 0

    def sample() -> Iterator[str]:
        nonlocal taken
        for text in documents:
            yield text
            taken += len(text)
            if taken >= limit:
                return

    t = time.perf_counter()
    tok = train_bpe(sample(), opts.vocab_size)
    # counted in characters of text: beside a compressed source's size, "MB" read as the same unit
    log(f"prepare: trained a byte-level BPE of vocab {tok.get_vocab_size():,} on {taken / 1e6:.1f}M characters "
        f"of text in {time.perf_counter() - t:.1f}s")
    return tok


# --------------------------------------------------------------------------- workers

_WORKER_TOK: Tokenizer | None = None
_WORKER_SPECIAL: tuple[int | None, int, np.dtype] | None = None
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0  # the fallback watcher's period where prctl is unavailable


def die_with_parent(parent_pid: int, prctl: bool = True) -> None:
    """End this process when ``parent_pid`` (the prepare that started it) ends, however it ends.

    A worker blocked on its task queue never sees its parent die: the queue's pipe is
    also held open by the other forked workers, so no EOF comes, and a ``kill -9``ed
    prepare would leave every worker running. On Linux the kernel delivers SIGKILL to
    this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``); the parent may
    already be gone before that call, hence the check of ``getppid()`` after it.
    Elsewhere (or if prctl fails, or with ``prctl=False``) a daemon thread checks the
    parent once a second.
    """
    armed = False
    if prctl and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL),
                               ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
        except (OSError, AttributeError):  # no libc symbol table, no prctl
            armed = False
    if os.getppid() != parent_pid:  # orphaned before the death signal was armed
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="flopwise-parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def die_with(pid: int, before_exit: Callable[[], None] | None = None) -> None:
    """End this process when process ``pid`` ends, however it ends, where ``pid`` is not its
    parent: a process forked by a forkserver (its parent) for a client (``pid``); or where this
    process must clean up first (``before_exit``, called on the watching thread).

    prctl's death signal follows the parent, and a forkserver outlives a killed client for as
    long as any process it forked holds the client's pipe open -- so not before they end. A
    daemon thread waits instead on a pidfd of ``pid``, which is readable once ``pid`` has exited
    (a reused pid cannot fool it); where there is no pidfd it polls ``pid`` once a second."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        _exit_after(before_exit)
    except (AttributeError, OSError):  # no pidfd_open: not Linux 5.3+
        fd = None
    threading.Thread(target=_wait_for_exit, args=(pid, fd, before_exit), name="flopwise-client-watch",
                     daemon=True).start()


def _wait_for_exit(pid: int, fd: int | None, before_exit: Callable[[], None] | None = None) -> None:
    if fd is not None:
        select.select([fd], [], [])
    else:
        while _alive(pid):
            time.sleep(PARENT_POLL_S)
    _exit_after(before_exit)


def _exit_after(before_exit: Callable[[], None] | None) -> NoReturn:
    try:
        if before_exit is not None:
            before_exit()
    finally:
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _worker_init(tokenizer_json: str, bos: int | None, eos: int, dtype: str, parent_pid: int) -> None:
    global _WORKER_TOK, _WORKER_SPECIAL
    die_with_parent(parent_pid)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER_TOK = Tokenizer.from_str(tokenizer_json)
    _WORKER_SPECIAL = (bos, eos, np.dtype(dtype))


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOK is not None and _WORKER_SPECIAL is not None  # set by _worker_init, the pool's initializer
    bos, eos, dtype = _WORKER_SPECIAL
    return encode_documents(_WORKER_TOK, texts, bos, eos, dtype)


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_workers(requested: int, batch_chars: int, tokenizer_bytes: int) -> tuple[int, str]:
    """Worker processes: the usable cores, fewer when memory would not hold them all.

    Per worker: the interpreter and libraries (~150 MB), the tokenizer in memory (~10x its
    JSON size) and one batch in flight (~60 bytes per character: the text, the
    ``Encoding`` objects of ~0.3 tokens per character and the id arrays).
    """
    if requested:
        return requested, "as requested"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    per_worker = 150e6 + 10 * tokenizer_bytes + 60 * batch_chars
    avail = available_memory_bytes()
    by_memory = max(1, int(0.5 * avail / per_worker)) if avail else cores
    n = max(1, min(cores, by_memory))
    why = f"{cores} cores" + (f", memory for {by_memory} at ~{per_worker / 1e6:.0f} MB each" if avail else "")
    return n, why


def _batches(documents: Iterable[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encoded_stream(documents: Iterable[str], tok, bos: int | None, eos: int, dtype: np.dtype, workers: int,
                   max_docs: int, max_chars: int) -> Generator[tuple[np.ndarray, np.ndarray, int], None, None]:
    """(ids, per-document lengths, characters) per batch, in source order.

    ``workers <= 1`` encodes in this process (the tokenizer then uses its own threads).
    The generator can be closed early (a budget met): pending batches are cancelled.
    """
    batches = _batches(documents, max_docs, max_chars)
    if workers <= 1:
        for batch in batches:
            ids, lengths = encode_documents(tok, batch, bos, eos, dtype)
            yield ids, lengths, sum(map(len, batch))
        return
    # fork where the platform has it: workers start in milliseconds and need not re-import
    # the caller's __main__ (spawn cannot even do that for `python -`). The tokenizers
    # library marks a fork after its thread pool was used and turns parallelism off in
    # the child, which is what we want: one core per worker (the initializer says so
    # explicitly, which also keeps its warning quiet).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method), initializer=_worker_init,
                               initargs=(tok.to_str(), bos, eos, dtype.name, os.getpid()))
    pending: deque[tuple[Future, int]] = deque()
    try:
        for batch in batches:
            pending.append((pool.submit(_worker_encode, batch), sum(map(len, batch))))
            if len(pending) >= 2 * workers:
                fut, chars = pending.popleft()
                yield (*fut.result(), chars)
        while pending:
            fut, chars = pending.popleft()
            yield (*fut.result(), chars)
    finally:
        for fut, _ in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- writing

class Router:
    """Sends each document, whole, to the split furthest behind its share; cuts at exact budgets.

    A held-out split (val, test) takes a document whole when it fits the split's room: what
    is left of its budget, and no more than one share ahead of its share of the stream so
    far (this document counted). A longer document -- a book in a ``.txt`` file, or a long
    one early in the stream -- gives that split its tail instead, what it owes of its share
    (at least ``piece_tokens``, at most what its budget has left), and train its head. So
    held-out text is whole documents, drawn whatever their length, except for those tails:
    never a stretch of a document with training text on both sides, and a source of one
    long document is still shared out. Short documents (up to ``piece_tokens``) are always
    whole, cut only where a budget ends.

    ``val_floor`` (an unbounded validation share, the default split): validation's share of
    the tokens validation and train have had so far is raised to what keeps it at
    ``min(val_floor.tokens, val_floor.max_share x those tokens)``, train's lowered as much
    (:meth:`weight`). The source's size is unknown while streaming, so that is the only way
    to have the floor whenever the source turns out large enough to spare it: validation
    takes ``max_share`` of the head of the stream until it holds the floor, then nothing
    more until its own share of the stream passes the floor, then its share.
    """

    def __init__(self, targets: dict[str, int | None], weights: dict[str, float],
                 fill_first: frozenset[str] = frozenset(), piece_tokens: int = ROUTE_PIECE_TOKENS,
                 val_floor: ValFloor | None = None):
        self.targets = targets
        self.weights = weights
        self.fill_first = fill_first
        self.piece_tokens = piece_tokens
        self.val_floor = val_floor
        self.tokens = {s: 0 for s in SPLITS}
        self.cut_documents = 0

    def weight(self, split: str) -> float:
        """``split``'s weight now: as given, except validation's raised to its floor (``val_floor``)
        and train's lowered as much, so the weights still add up to the same."""
        w = self.weights.get(split, 0.0)
        f = self.val_floor
        if f is None or split not in ("val", "train") or w <= 0:
            return w
        seen = self.tokens["val"] + self.tokens["train"]
        want = f.max_share if seen * f.max_share < f.tokens else f.tokens / seen  # of val + train
        pair = self.weights["val"] + self.weights["train"]
        extra = max(0.0, want * pair - self.weights["val"])
        return w + extra if split == "val" else w - extra

    def open_splits(self) -> list[str]:
        return [s for s in SPLITS if self.weights.get(s, 0) > 0 and
                ((target := self.targets[s]) is None or self.tokens[s] < target)]

    def done(self) -> bool:
        """Every split is full (never, while train is unbounded)."""
        return not self.open_splits()

    def pick(self) -> str | None:
        """The split furthest behind its share (a split filled first before the others), or None when all are full."""
        candidates = self.open_splits()
        if not candidates:
            return None
        candidates = [s for s in candidates if s in self.fill_first] or candidates
        return min(candidates, key=lambda s: (self.tokens[s] / self.weight(s), SPLITS.index(s)))

    def take(self, split: str, n_tokens: int) -> int:
        """Count up to ``n_tokens`` into ``split``; the tokens kept (fewer where its budget ends)."""
        keep = n_tokens
        target = self.targets[split]
        if target is not None:
            keep = min(n_tokens, target - self.tokens[split])
            if keep < n_tokens:
                self.cut_documents += 1
        self.tokens[split] += keep
        return keep

    def route(self, n_tokens: int) -> tuple[str, int] | None:
        """(split, tokens to keep) for a whole document of ``n_tokens``, or None when all are full."""
        split = self.pick()
        return None if split is None else (split, self.take(split, n_tokens))

    def owed(self, split: str, n_tokens: int) -> int:
        """Tokens ``split`` is short of its share once a document of ``n_tokens`` is counted (a
        split filled first: short of its budget)."""
        target = self.targets[split]
        left = None if target is None else target - self.tokens[split]
        if split in self.fill_first:
            return max(0, left or 0)
        need = self.share(split) * (sum(self.tokens.values()) + n_tokens) - self.tokens[split]
        return max(0, int(need if left is None else min(need, left)))

    def share(self, split: str) -> float:
        return self.weight(split) / sum(w for w in self.weights.values() if w > 0)

    def room(self, split: str, n_tokens: int) -> float:
        """Tokens a held-out ``split`` may take of a document of ``n_tokens``: what is left of its
        budget, and (unless it is filled first) no more than puts it one share ahead -- twice
        its share of the stream so far, this document counted."""
        target = self.targets[split]
        room = float("inf") if target is None else target - self.tokens[split]
        if split not in self.fill_first:
            room = min(room, 2 * self.share(split) * (sum(self.tokens.values()) + n_tokens) - self.tokens[split])
        return room

    def route_document(self, n_tokens: int) -> list[tuple[str, int, int]]:
        """(split, offset, tokens to keep) per part of a document, in document order: the whole
        document in one split, or a long one's head in train and its tail in a held-out split
        (the class docstring says when); empty when all splits are full."""
        split = self.pick()
        if split is None:
            return []
        if (n_tokens <= self.piece_tokens or split == "train" or "train" not in self.open_splits()
                or n_tokens <= self.room(split, n_tokens)):
            return [(split, 0, self.take(split, n_tokens))]
        target = self.targets[split]
        left = n_tokens if target is None else target - self.tokens[split]
        tail = min(n_tokens, left, max(self.owed(split, n_tokens), self.piece_tokens))
        return [("train", 0, self.take("train", n_tokens - tail)), (split, n_tokens - tail, self.take(split, tail))]


# --------------------------------------------------------------------------- estimate

def summarize_document_lengths(lengths: np.ndarray) -> dict[str, float]:
    """Tokens per document (mean and median) of a sample: the first encoded batch."""
    return {"documents": int(len(lengths)), "mean": float(lengths.mean()), "median": float(np.median(lengths))}


# --------------------------------------------------------------------------- progress

class Progress:
    """Documents/s, tokens/s and ETA: a live bar on a terminal, a line every 10 s otherwise."""

    def __init__(self, total_tokens: int | None, log: Log):
        self.total = total_tokens
        self.log = log
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.docs = 0
        self.tokens = 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # lazy: only a terminal shows the bar; tokenizer workers never need it

            self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True, smoothing=0.1)

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(tokens)
            self.bar.set_postfix_str(f"{self.docs / max(time.perf_counter() - self.t0, 1e-9):,.0f} docs/s")
            return
        now = time.perf_counter()
        if now - self.last >= 10:
            self.last = now
            self.log(f"prepare: {self.line()}")

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        tps = self.tokens / dt
        eta = ""
        if self.total:
            left = max(self.total - self.tokens, 0) / max(tps, 1e-9)
            eta = f" · {100 * self.tokens / self.total:.1f}% · ETA {left / 60:.1f} min"
        return (f"{self.docs:,} docs, {self.tokens:,} tokens in {dt:.1f}s · {self.docs / dt:,.0f} docs/s"
                f" · {tps / 1e6:.2f}M tokens/s{eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- main

def fingerprint(opts: PrepareOptions, source_identity: dict, tokenizer_sha: str | None) -> str:
    """Hash of every input that changes the output (not the worker count: it does not)."""
    keys = asdict(opts)
    # follow_links changes which files are read, and the source identity lists those.
    for k in ("out", "workers", "overwrite", "batch_chars", "batch_docs", "follow_links"):
        keys.pop(k)
    keys["tokenizer"] = tokenizer_sha  # the file's content, not its path
    # The share as before the floor (a fingerprint of explicit --val-fraction or --val-tokens
    # is unchanged), and the floor where it may change the output: always without a train
    # budget (the source's size decides), with one where it raises validation's budget.
    keys["val_fraction"] = opts.fraction
    floor = opts.val_floor()
    # (targets()'s val is an int wherever there is a train budget: `or 0` only for the type)
    if floor is not None and (not opts.train_tokens or (opts.targets()["val"] or 0) > opts.fraction_tokens()):
        keys["val_floor"] = asdict(floor)
    blob = json.dumps({"options": keys, "source": source_identity, "format": FORMAT_VERSION,
                       "recipe": RECIPE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _floor_state(opts: PrepareOptions, floor: ValFloor | None, splits: dict) -> tuple[bool, int, int] | None:
    """(whether the floor raised validation, validation's tokens, what the share alone gives) of a
    default split; None for an explicit one."""
    if floor is None:
        return None
    val = splits.get("val", {}).get("tokens", 0)
    if opts.train_tokens:
        by_share = opts.fraction_tokens()
        return (opts.targets()["val"] or 0) > by_share, val, by_share  # an int with a train budget
    shared = val + splits.get("train", {}).get("tokens", 0)  # what the floor's cap is a share of
    by_share = round(opts.fraction * shared)
    return min(floor.tokens, floor.max_share * shared) > opts.fraction * shared, val, by_share


def floor_record(opts: PrepareOptions, floor: ValFloor | None, splits: dict) -> dict | None:
    """``meta.json``'s ``recipe.val_floor``: None where --val-tokens or --val-fraction was given."""
    state = _floor_state(opts, floor, splits)
    if state is None:
        return None
    assert floor is not None  # _floor_state is None without a floor
    applied, val, by_share = state
    return {**asdict(floor), "applied": applied, "fraction_would_give": by_share, "reached": val >= floor.tokens}


def val_floor_note(opts: PrepareOptions, floor: ValFloor | None, splits: dict) -> str:
    """The summary's line on the floor, where it raised validation; "" elsewhere."""
    state = _floor_state(opts, floor, splits)
    if state is None or not state[0]:
        return ""
    assert floor is not None  # _floor_state is None without a floor
    _, val, by_share = state
    base = f"--val-fraction {opts.fraction:g} alone would give {'' if opts.train_tokens else '~'}{by_share:,}"
    if val >= floor.tokens:
        return f"val: {val:,} tokens, raised to the floor: {floor.describe()}; {base}"
    return (f"val: {val:,} tokens, short of the floor (it takes at most {floor.max_share:.0%} of the tokens): "
            f"{floor.describe()}, so they overlap on a source this small (--val-tokens sets validation); {base}")


def val_share_note(opts: PrepareOptions, floor: ValFloor | None, splits: dict) -> str:
    """The summary's line where validation got more than ``OVER_SHARE`` times the share it was
    given (its real share, and why); "" elsewhere. Only a share can be overshot: budgets
    (--train-tokens, --val-tokens) are met exactly, the last document cut. A share is met a
    whole document at a time, the first document to validation, so a source of a few
    documents holds out far more: two give validation half of the tokens."""
    if opts.train_tokens or opts.val_tokens:
        return ""
    val = splits["val"]["tokens"]
    shared = val + splits["train"]["tokens"]  # what the share is of (as the floor's cap)
    asked = opts.fraction if floor is None else max(opts.fraction, min(floor.tokens / shared, floor.max_share))
    if val <= OVER_SHARE * asked * shared:
        return ""
    documents = sum(info["documents"] for info in splits.values())
    what = (f"the {asked:.1%} a default split holds out here (at most {floor.max_share:.0%})" if floor is not None
            else f"the {asked:.1%} asked")
    return (f"val: {val:,} tokens, {val / shared:.0%} of validation's and train's {shared:,}, not {what}: documents "
            f"go whole to one split (the first to validation) and the source has {documents:,} documents; "
            "--val-tokens N holds out exactly N tokens")


def holdout_note(opts: PrepareOptions, splits: dict) -> str:
    """The summary's line where a fixed request (--val-tokens, --test-tokens) took more than
    ``LARGE_HOLDOUT`` of the tokens: the share, and that training gets the rest; "" elsewhere."""
    total = sum(info["tokens"] for info in splits.values())
    asked = [(name, flag) for name, flag in (("val", "--val-tokens"), ("test", "--test-tokens"))
             if getattr(opts, f"{name}_tokens") and name in splits]
    held = [(name, flag, splits[name]["tokens"]) for name, flag in asked]
    large = [(name, flag, n) for name, flag, n in held if total and n > LARGE_HOLDOUT * total]
    if not large:
        return ""
    parts = ", ".join(f"{flag} {n:,} is {n / total:.0%}" for _, flag, n in large)
    return (f"held out: {parts} of the source's {total:,} tokens (more than {LARGE_HOLDOUT:.0%}): training "
            f"gets {splits.get('train', {}).get('tokens', 0):,}; a smaller request leaves it more")


def _existing_meta(out: Path) -> dict:
    """The ``meta.json`` of the data directory at ``out``; {} when there is none readable."""
    try:
        meta = read_json(out / "meta.json")
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def output_lock(out: Path) -> DirLock:
    """The lock one prepare holds on ``out``: a small hidden directory beside it, ``.NAME.lock``.

    Not a lock inside ``out``: prepare builds ``.NAME.partial`` and renames it over
    ``out``, so a lock file inside ``out`` would move away with the replaced directory and
    the next prepare would lock a fresh file while the first still runs. The sibling is
    never renamed, guards ``.NAME.partial``, ``.NAME.old`` and ``NAME`` alike, and only
    prepares of the same output contend for it (not every output of one parent folder).
    """
    return DirLock(out.parent / f".{out.name}.lock", "flopwise prepare", dedicated=True)


def prepare(opts: PrepareOptions, log: Log = print) -> Path:
    """Run the pipeline; return the data directory. Raises PrepareError / SourceError on bad input,
    and PrepareError naming the file and the reason when a write fails (a full disk)."""
    t_start = time.perf_counter()
    opts.validate()
    missing = missing_for_source(opts.source)  # every optional package the source needs, named together
    if missing:
        raise PrepareError("; ".join(missing))
    out = Path(opts.out).expanduser()
    source = open_source(opts.source, text_field=opts.text_field, split=opts.hf_split,
                         shuffle_buffer=opts.shuffle_buffer, seed=opts.seed, data_files=opts.data_files or None,
                         follow_links=opts.follow_links)
    for note in source.notes:
        log(f"prepare: {note}")
    tok_sha = file_sha256(opts.tokenizer) if opts.tokenizer else None
    fp = fingerprint(opts, source.identity, tok_sha)
    lock = output_lock(out)
    try:
        lock.acquire()
    except LockedError as e:
        raise PrepareError(f"--out {str(out)!r} is being written by another flopwise prepare: {e}") from None
    except OSError as e:
        if e.errno == errno.EROFS and _existing_meta(out).get("fingerprint") == fp:  # nobody writes there either
            log(f"prepare: {out} already holds this data (same inputs, fingerprint {fp[:12]}; a read-only "
                "folder); nothing to do")
            return out
        raise PrepareError(f"cannot write --out {out} (its lock {lock.path}): {write_reason(e)}; "
                           f"nothing was written to {out}") from e
    try:
        return _prepare_locked(opts, out, source, fp, log, t_start)
    finally:
        lock.release()


def _prepare_locked(opts: PrepareOptions, out: Path, source: Source, fp: str, log: Log, t_start: float) -> Path:
    """:func:`prepare` once it holds the lock: build ``.NAME.partial``, publish it as ``out``, report."""
    _finish_interrupted_publish(out, log)
    if _holds_this_data(opts, out, fp):
        log(f"prepare: {out} already holds this data (same inputs, fingerprint {fp[:12]}); nothing to do")
        return out
    had_out = out.exists()
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():  # we hold the lock: whoever wrote it is gone
        log(f"prepare: removing {partial} left by an interrupted prepare")
        shutil.rmtree(partial)
    writers: dict[str, SplitWriter] = {}
    try:
        partial.mkdir()
        tok, bos, eos = _save_tokenizer(opts, source, partial, log)
        vocab = tok.get_vocab_size()
        dtype = dtype_for_vocab(vocab)

        targets, weights = opts.targets(), opts.weights()
        budget = sum(v for v in targets.values() if v) if opts.train_tokens else None
        workers, why = choose_workers(opts.workers, opts.batch_chars, len(tok.to_str()))
        log(f"prepare: {source.description} -> {out} · {workers} worker(s) ({why}) · "
            f"budgets " + ", ".join(f"{s} {'all' if targets[s] is None else f'{targets[s]:,}'}"
                                     for s in ("train", "val", "test") if weights.get(s, 0) > 0))

        writers = {s: SplitWriter(partial, s, vocab, opts.shard_tokens) for s in SPLITS if weights.get(s, 0) > 0}
        floor = opts.val_floor()
        router = Router(targets, weights, opts.fill_first(), val_floor=None if opts.train_tokens else floor)
        progress = Progress(budget, log)
        stream = encoded_stream(source.documents(), tok, bos, eos, dtype, workers, opts.batch_docs, opts.batch_chars)
        try:
            per_doc, continued = _write_documents(opts, stream, writers, router, progress, budget, log)
        finally:
            stream.close()
            progress.close()

        splits = _closed_splits(opts, writers, continued, targets, log)
        write_meta(partial, source=source.description, vocab_size=vocab, eos_id=eos, bos_id=bos, splits=splits,
                   fingerprint=fp, recipe={
                       "version": RECIPE_VERSION,
                       "requested": {s: targets[s] for s in SPLITS},
                       "val_fraction": opts.fraction,
                       "val_floor": floor_record(opts, floor, splits),
                       "tokens_per_document": per_doc,
                       "documents_cut_at_budget": router.cut_documents,
                       "shard_tokens": opts.shard_tokens,
                       "text_field": opts.text_field,
                       "shuffle_buffer": opts.shuffle_buffer,
                       "seed": opts.seed,
                   })
        _publish(partial, out)
    except BaseException as e:
        for w in writers.values():
            w.abort()
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError) or is_disk_full(e):
            where = e.filename if isinstance(e, OSError) and e.filename else partial
            kept = f"{out} was left as it was" if had_out else f"nothing was written to {out}"
            raise PrepareError(f"cannot write {where}: {write_reason(e)}; "
                               f"the partial output was removed and {kept}") from e
        raise
    try:  # make the rename durable; the data is in place either way
        fsync_dir(out.parent)
    except OSError as e:
        log(f"prepare: WARNING: could not sync {out.parent} after the rename: {describe_write_error(e)}")

    log(f"prepare: done in {time.perf_counter() - t_start:.1f}s · {progress.line()}")
    for note in source.read_notes():  # what reading found: bytes that are not UTF-8, with where
        log(f"prepare: {note}")
    _log_splits(opts, out, splits, floor, dtype, log)
    return out


def _holds_this_data(opts: PrepareOptions, out: Path, fp: str) -> bool:
    """Whether ``out`` already holds the data of these inputs (fingerprint ``fp``).

    Refuses (PrepareError) an ``out`` that is a file, or that holds other files and no
    ``--overwrite`` was given; False means ``out`` may be written.
    """
    if not out.exists():
        return False
    if not out.is_dir():
        raise PrepareError(f"--out {str(out)!r} is a file, not a directory")
    meta = _existing_meta(out)
    if meta.get("fingerprint") == fp:
        return True
    if any(out.iterdir()) and not opts.overwrite:
        what = "a prepared data directory with other inputs" if (out / "meta.json").is_file() else "files"
        recipe = meta.get("recipe")
        old = recipe.get("version") if isinstance(recipe, dict) else None
        if isinstance(old, int) and old != RECIPE_VERSION:
            what += f" (prepared by recipe {old}; this flopwise prepares recipe {RECIPE_VERSION})"
        raise PrepareError(f"--out {str(out)!r} already holds {what}; pass --overwrite to replace it "
                           "(it is only replaced once the new data is complete)")
    return False


def _save_tokenizer(opts: PrepareOptions, source: Source, partial: Path, log: Log) -> tuple[Tokenizer, int | None, int]:
    """The tokenizer (loaded or trained: :func:`resolve_tokenizer`), written to ``partial``,
    and its BOS id (None where it has none) and EOS id (refused where it has none)."""
    tok = resolve_tokenizer(opts, source.documents(), log)
    specials = special_ids(tok)
    bos, eos = specials["bos_id"], specials["eos_id"]
    if eos is None:
        raise PrepareError(f"--tokenizer {opts.tokenizer!r} defines no end-of-text token "
                           f"(looked for {', '.join(specials['eos_candidates'])})")
    write_file(partial / TOKENIZER_FILE, tok.to_str(pretty=True))  # the bytes tok.save() writes
    return tok, bos, eos


def _write_documents(opts: PrepareOptions, stream: Iterator[tuple[np.ndarray, np.ndarray, int]],
                     writers: dict[str, SplitWriter], router: Router, progress: Progress, budget: int | None,
                     log: Log) -> tuple[dict | None, dict[str, int]]:
    """Route the encoded batches of ``stream`` into the splits' writers until the budget is
    met (or the stream ends). Returns the tokens per document estimated from the first batch
    (None when there was none) and, per split, the documents begun in another split that go
    on there."""
    per_doc = None
    continued = {s: 0 for s in writers}  # documents begun in another split that go on here
    for ids, lengths, _ in stream:
        if per_doc is None:  # the first batch is the sample: no text is encoded twice
            per_doc = summarize_document_lengths(lengths)
            need = f" · the budget needs ~{budget / per_doc['mean']:,.0f} documents" if budget else ""
            log(f"prepare: ~{per_doc['mean']:,.0f} tokens per document (median {per_doc['median']:,.0f}, "
                f"from the first {per_doc['documents']:,} documents){need}")
        pos = 0
        written = 0
        routed = 0  # documents of this batch that got a split (not those after the budget was met)
        for n in lengths.tolist():
            pieces = router.route_document(n)
            if not pieces:
                break
            for split, offset, keep in pieces:
                writers[split].write(ids[pos + offset : pos + offset + keep])
                written += keep
            # counted once, in the split holding its first token, so the splits' counts
            # add up to the documents used; the other splits it reaches count it as continued
            first = pieces[0][0]
            writers[first].documents += 1
            for split in {p[0] for p in pieces} - {first}:
                continued[split] += 1
            routed += 1
            pos += n
        progress.update(routed, written)
        if opts.train_tokens and router.done():
            break
    return per_doc, continued


def _closed_splits(opts: PrepareOptions, writers: dict[str, SplitWriter], continued: dict[str, int],
                   targets: dict[str, int | None], log: Log) -> dict[str, dict]:
    """Close the writers: the ``meta.json`` record of each split that got tokens. Refuses an
    output without validation or training tokens; warns of budgets the source fell short of."""
    splits = {s: {**w.close(), "continued_documents": continued[s]} for s, w in writers.items()}
    splits = {s: info for s, info in splits.items() if info["tokens"] > 0}
    if "val" not in splits:
        raise PrepareError(f"SOURCE {opts.source!r} gave no validation tokens (too few documents?); "
                           "give --val-tokens or a larger source")
    if "train" not in splits:
        raise PrepareError(f"SOURCE {opts.source!r} gave no training tokens after validation; use a larger source")
    short = [f"{s} has {splits.get(s, {}).get('tokens', 0):,} of {targets[s]:,} tokens"
             for s in SPLITS if targets[s] and splits.get(s, {}).get("tokens", 0) < targets[s]]
    if short:
        log("prepare: WARNING: the source ran out before the budget: " + "; ".join(short))
    return splits


def _log_splits(opts: PrepareOptions, out: Path, splits: dict[str, dict], floor: ValFloor | None,
                dtype: np.dtype, log: Log) -> None:
    """The final summary: each split's tokens, documents and shards, the validation floor's
    note where it applies, and the output's size."""
    total = sum(s["tokens"] for s in splits.values())
    for s, info in splits.items():
        cont = info["continued_documents"]
        more = f" (+{cont:,} continued from another split)" if cont else ""
        log(f"  {s:<5} {info['tokens']:>14,} tokens · {info['documents']:>10,} documents{more} · "
            f"{len(info['shards'])} shard(s)")
    # where validation holds far more than its share, that is the line (a floor's "at most" would be wrong)
    note = val_share_note(opts, floor, splits) or val_floor_note(opts, floor, splits)
    for line in [note, holdout_note(opts, splits)]:
        if line:
            log(f"  {line}")
    log(f"  {out} ({total * dtype.itemsize / 1e6:,.1f} MB of {dtype.name} tokens)")


def _publish(partial: Path, out: Path) -> None:
    """Rename the finished ``partial`` to ``out``. A replaced ``out`` is set aside first and
    removed after, so ``out`` is the old complete data or the new, never a mix; a rename
    that fails puts the old one back, and a kill between the two renames is undone by the
    next prepare (:func:`_finish_interrupted_publish`)."""
    replace_dir(partial, out)


def _finish_interrupted_publish(out: Path, log: Log) -> None:
    """A prepare killed inside :func:`_publish` left ``.NAME.old``: put it back if ``out`` is
    missing (killed between the renames), else remove it (killed before the clean-up)."""
    old = out.parent / f".{out.name}.old"
    if not old.exists():
        return
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(old, out)
    fsync_dir(out.parent)
    log(f"prepare: restored {out} from {old} (a prepare was stopped while replacing it)")


def verify(path: str | os.PathLike, log: Log = print) -> None:
    """Full check of a data directory: headers, sizes, checksums and every id < vocab size."""
    t = time.perf_counter()
    dd = DataDir(path, verify=True)
    for split in dd.splits:
        n = dd.num_tokens(split)
        docs = dd.num_documents(split)
        log(f"  {split:<5} {n:>14,} tokens · {'?' if docs is None else f'{docs:,}':>10} documents · "
            f"{len(dd.shard_paths(split))} shard(s) · checksums and id range OK")
    log(f"verify: {dd.path} OK (vocab {dd.vocab_size:,}, {dd.meta.get('dtype')}) in {time.perf_counter() - t:.1f}s")
