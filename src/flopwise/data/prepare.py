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
  validation. A document over ``ROUTE_PIECE_TOKENS`` (4,096) is routed in pieces of that
  size, so a source of a few long documents (a book in one ``.txt``) is shared out too;
  the pieces of one long document may then land in different splits. Without a train budget the whole source is used and validation gets
  ``--val-fraction`` of the tokens, spread along the stream; an explicit ``--val-tokens``
  or ``--test-tokens`` is then taken from the head of the stream, the only way to meet it
  without knowing the source's size in advance. Tokens per
  document (mean and median) are estimated from the first encoded batch, the sample that
  tells how many documents the budget needs; streaming stops as soon as it is met, so the
  source is never tokenized beyond the budget (plus the batches in flight).
- **Workers**: processes (forked where possible; each loads the tokenizer once) encode batches of
  documents; results are consumed in submission order, so the output is deterministic
  and independent of the worker count. At most ``2 x workers`` batches are in flight.
  The default worker count is the usable cores, lowered so that the per-worker memory
  estimate fits in half the available memory.
- **Atomic**: everything is written into a hidden sibling directory ``.NAME.partial`` and
  renamed to ``--out`` at the end, ``meta.json`` included; an interrupted prepare leaves
  no directory that looks prepared, and a rerun starts over cleanly. A rerun with the same
  inputs on a finished directory is a no-op; different inputs need ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .shards import FORMAT_VERSION, ShardWriter, _fsync_dir, dtype_for_vocab, shard_name
from .tokenizer import file_sha256, load_tokenizer, special_ids, train_bpe

Log = Callable[[str], None]
RECIPE_VERSION = 2  # 2: documents longer than ROUTE_PIECE_TOKENS are routed in pieces
ROUTE_PIECE_TOKENS = 4096
SPLITS = ("val", "test", "train")  # routing priority on ties: validation first


class PrepareError(ValueError):
    """Bad ``flopwise prepare`` input; the message names the flag, file or value."""


@dataclass
class PrepareOptions:
    source: str
    out: str
    tokenizer: str = ""  # path to a tokenizer.json; empty = train a byte-level BPE
    vocab_size: int = 0  # for the trained BPE
    train_tokens: int = 0  # 0 = the whole source
    val_tokens: int = 0  # 0 = val_fraction of the train budget (or of the source)
    test_tokens: int = 0
    val_fraction: float = 0.005
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
        if not 0 <= self.val_fraction < 1:
            p.append(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_tokens == 0 and self.val_fraction == 0:
            p.append("no validation split: give --val-tokens or a --val-fraction above 0")
        if self.tokenizer_sample_mb <= 0:
            p.append(f"--tokenizer-sample-mb must be > 0, got {self.tokenizer_sample_mb}")
        if self.shard_tokens <= 0:
            p.append(f"--shard-tokens must be > 0, got {self.shard_tokens}")
        if self.tokenizer and not Path(self.tokenizer).is_file():
            p.append(f"--tokenizer {self.tokenizer!r}: file does not exist")
        if p:
            raise PrepareError("; ".join(p))

    def targets(self) -> dict[str, int | None]:
        """Token budget per split (None = unbounded: the rest of the source)."""
        if self.train_tokens:
            val = self.val_tokens or max(1, round(self.val_fraction * self.train_tokens))
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
        share = 0.0 if self.val_tokens else self.val_fraction
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
    log(f"prepare: trained a byte-level BPE of vocab {tok.get_vocab_size():,} on {taken / 1e6:.1f} MB "
        f"in {time.perf_counter() - t:.1f}s")
    return tok


# --------------------------------------------------------------------------- workers

_WORKER_TOK = None
_WORKER_SPECIAL: tuple[int | None, int, np.dtype] | None = None


def _worker_init(tokenizer_json: str, bos: int | None, eos: int, dtype: str) -> None:
    global _WORKER_TOK, _WORKER_SPECIAL
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    from tokenizers import Tokenizer

    _WORKER_TOK = Tokenizer.from_str(tokenizer_json)
    _WORKER_SPECIAL = (bos, eos, np.dtype(dtype))


def encode_documents(tok, texts: list[str], bos: int | None, eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts``; return (all ids with BOS/EOS framing each document, per-document lengths)."""
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # no offsets: faster
    # Each ``Encoding.ids`` access builds a new Python list: read it once per document.
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    n = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    lengths = n + 1 + (bos is not None)
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for doc, k in zip(ids, n.tolist()):
        if bos is not None:
            out[pos] = bos
            pos += 1
        out[pos : pos + k] = doc
        out[pos + k] = eos
        pos += k + 1
    return out, lengths


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
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
                   max_docs: int, max_chars: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
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
    import multiprocessing as mp

    # fork where the platform has it: workers start in milliseconds and need not re-import
    # the caller's __main__ (spawn cannot even do that for `python -`). The tokenizers
    # library marks a fork after its thread pool was used and turns parallelism off in
    # the child, which is what we want: one core per worker (the initializer says so
    # explicitly, which also keeps its warning quiet).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method), initializer=_worker_init,
                               initargs=(tok.to_str(), bos, eos, dtype.name))
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
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


class Router:
    """Sends each document to the split furthest behind its share; cuts at exact budgets.

    A document longer than ``piece_tokens`` is routed in pieces of that size, so that a
    source of a few long documents (one book in a ``.txt`` file) is still shared out
    by the splits' shares instead of landing whole in validation, its first split.
    """

    def __init__(self, targets: dict[str, int | None], weights: dict[str, float],
                 fill_first: frozenset[str] = frozenset(), piece_tokens: int = ROUTE_PIECE_TOKENS):
        self.targets = targets
        self.weights = weights
        self.fill_first = fill_first
        self.piece_tokens = piece_tokens
        self.tokens = {s: 0 for s in SPLITS}
        self.cut_documents = 0

    def open_splits(self) -> list[str]:
        return [s for s in SPLITS if self.weights.get(s, 0) > 0 and
                (self.targets[s] is None or self.tokens[s] < self.targets[s])]

    def done(self) -> bool:
        """Every split is full (never, while train is unbounded)."""
        return not self.open_splits()

    def route(self, n_tokens: int) -> tuple[str, int] | None:
        """(split, tokens to keep) for a document of ``n_tokens``, or None when all are full."""
        candidates = self.open_splits()
        if not candidates:
            return None
        candidates = [s for s in candidates if s in self.fill_first] or candidates
        split = min(candidates, key=lambda s: (self.tokens[s] / self.weights[s], SPLITS.index(s)))
        keep = n_tokens
        if self.targets[split] is not None:
            keep = min(n_tokens, self.targets[split] - self.tokens[split])
            if keep < n_tokens:
                self.cut_documents += 1
        self.tokens[split] += keep
        return split, keep

    def route_document(self, n_tokens: int) -> list[tuple[str, int, int]]:
        """(split, offset, tokens to keep) per piece of a document; empty when all splits are full."""
        if n_tokens <= self.piece_tokens:  # nearly every document: one piece
            routed = self.route(n_tokens)
            return [] if routed is None else [(routed[0], 0, routed[1])]
        pieces = []
        for offset in range(0, n_tokens, self.piece_tokens):
            routed = self.route(min(self.piece_tokens, n_tokens - offset))
            if routed is None:
                break
            pieces.append((routed[0], offset, routed[1]))
        return pieces


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
            from tqdm import tqdm

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
    for k in ("out", "workers", "overwrite", "batch_chars", "batch_docs"):
        keys.pop(k)
    keys["tokenizer"] = tokenizer_sha  # the file's content, not its path
    blob = json.dumps({"options": keys, "source": source_identity, "format": FORMAT_VERSION,
                       "recipe": RECIPE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _existing_fingerprint(out: Path) -> str | None:
    try:
        return json.loads((out / "meta.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def prepare(opts: PrepareOptions, log: Log = print) -> Path:
    """Run the pipeline; return the data directory. Raises PrepareError / SourceError on bad input."""
    from .sources import open_source  # optional packages are imported by the source that needs them

    t_start = time.perf_counter()
    opts.validate()
    out = Path(opts.out).expanduser()
    source = open_source(opts.source, text_field=opts.text_field, split=opts.hf_split,
                         shuffle_buffer=opts.shuffle_buffer, seed=opts.seed, data_files=opts.data_files or None)
    tok_sha = file_sha256(opts.tokenizer) if opts.tokenizer else None
    fp = fingerprint(opts, source.identity, tok_sha)
    if out.exists():
        if _existing_fingerprint(out) == fp and (out / "meta.json").is_file():
            log(f"prepare: {out} already holds this data (same inputs, fingerprint {fp[:12]}); nothing to do")
            return out
        if any(out.iterdir()) and not opts.overwrite:
            what = "a prepared data directory with other inputs" if (out / "meta.json").is_file() else "files"
            raise PrepareError(f"--out {str(out)!r} already holds {what}; pass --overwrite to replace it "
                               "(it is only replaced once the new data is complete)")
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        log(f"prepare: removing {partial} left by an interrupted prepare")
        shutil.rmtree(partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    writers: dict[str, SplitWriter] = {}
    try:
        tok = resolve_tokenizer(opts, source.documents(), log)
        specials = special_ids(tok)
        bos, eos = specials["bos_id"], specials["eos_id"]
        if eos is None:
            raise PrepareError(f"--tokenizer {opts.tokenizer!r} defines no end-of-text token "
                               f"(looked for {', '.join(specials['eos_candidates'])})")
        vocab = tok.get_vocab_size()
        dtype = dtype_for_vocab(vocab)
        tok.save(str(partial / "tokenizer.json"))

        targets, weights = opts.targets(), opts.weights()
        budget = sum(v for v in targets.values() if v) if opts.train_tokens else None
        workers, why = choose_workers(opts.workers, opts.batch_chars, len(tok.to_str()))
        log(f"prepare: {source.description} -> {out} · {workers} worker(s) ({why}) · "
            f"budgets " + ", ".join(f"{s} {'all' if targets[s] is None else f'{targets[s]:,}'}"
                                     for s in ("train", "val", "test") if weights.get(s, 0) > 0))

        writers = {s: SplitWriter(partial, s, vocab, opts.shard_tokens) for s in SPLITS if weights.get(s, 0) > 0}
        router = Router(targets, weights, opts.fill_first())
        progress = Progress(budget, log)
        stream = encoded_stream(source.documents(), tok, bos, eos, dtype, workers, opts.batch_docs, opts.batch_chars)
        try:
            per_doc = None
            for ids, lengths, _ in stream:
                if per_doc is None:  # the first batch is the sample: no text is encoded twice
                    per_doc = summarize_document_lengths(lengths)
                    need = f" · the budget needs ~{budget / per_doc['mean']:,.0f} documents" if budget else ""
                    log(f"prepare: ~{per_doc['mean']:,.0f} tokens per document (median {per_doc['median']:,.0f}, "
                        f"from the first {per_doc['documents']:,} documents){need}")
                pos = 0
                written = 0
                for n in lengths.tolist():
                    pieces = router.route_document(n)
                    if not pieces:
                        break
                    for split, offset, keep in pieces:
                        writers[split].write(ids[pos + offset : pos + offset + keep])
                        written += keep
                    for split in {p[0] for p in pieces}:
                        writers[split].documents += 1
                    pos += n
                progress.update(len(lengths), written)
                if opts.train_tokens and router.done():
                    break
        finally:
            stream.close()
            progress.close()

        splits = {s: w.close() for s, w in writers.items()}
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
        meta = {
            "format_version": FORMAT_VERSION,
            "source": source.description,
            "tokenizer": "tokenizer.json",
            "tokenizer_sha256": file_sha256(partial / "tokenizer.json"),
            "vocab_size": vocab,
            "dtype": dtype.name,
            "eos_id": eos,
            "bos_id": bos,
            "splits": splits,
            "fingerprint": fp,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "recipe": {
                "version": RECIPE_VERSION,
                "requested": {s: targets[s] for s in SPLITS},
                "val_fraction": opts.val_fraction,
                "tokens_per_document": per_doc,
                "documents_cut_at_budget": router.cut_documents,
                "shard_tokens": opts.shard_tokens,
                "text_field": opts.text_field,
                "shuffle_buffer": opts.shuffle_buffer,
                "seed": opts.seed,
            },
        }
        with open(partial / "meta.json", "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
    except BaseException:
        for w in writers.values():
            w.abort()
        shutil.rmtree(partial, ignore_errors=True)
        raise

    # Publish: the old directory (if replaced) is set aside first, so `out` is either the
    # old complete data or the new complete data, never a mix.
    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(partial, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, out)
    _fsync_dir(out.parent)
    total = sum(s["tokens"] for s in splits.values())
    log(f"prepare: done in {time.perf_counter() - t_start:.1f}s · {progress.line()}")
    for s, info in splits.items():
        log(f"  {s:<5} {info['tokens']:>14,} tokens · {info['documents']:>10,} documents · "
            f"{len(info['shards'])} shard(s)")
    log(f"  {out} ({total * dtype.itemsize / 1e6:,.1f} MB of {dtype.name} tokens)")
    return out


def verify(path: str | os.PathLike, log: Log = print) -> None:
    """Full check of a data directory: headers, sizes, checksums and every id < vocab size."""
    from .datadir import DataDir

    t = time.perf_counter()
    dd = DataDir(path, verify=True)
    for split in dd.splits:
        n = dd.num_tokens(split)
        docs = dd.num_documents(split)
        log(f"  {split:<5} {n:>14,} tokens · {'?' if docs is None else f'{docs:,}':>10} documents · "
            f"{len(dd.shard_paths(split))} shard(s) · checksums and id range OK")
    log(f"verify: {dd.path} OK (vocab {dd.vocab_size:,}, {dd.meta.get('dtype')}) in {time.perf_counter() - t:.1f}s")
