"""Training batches from memory-mapped token shards, and the fixed validation windows.

Two loaders, one interface (``next_batch()``, iteration, ``state_dict()`` /
``load_state_dict()``), both built by :func:`make_loader` from a data directory, a split
and a :class:`LoaderOptions` (the geometry, the seed, the ranks, the device and the
settings below):

- :class:`RandomWindowLoader` (mode ``"random"``): each row is a random contiguous window
  of ``seq_len + 1`` tokens from one shard, sampled *with replacement*.  The shard is
  drawn with probability proportional to its number of start positions
  (``n_tokens - seq_len``), then the offset uniformly, so every start position of the
  split is equally likely.
- :class:`EpochLoader` (mode ``"epoch"``): the split is packed into samples of
  ``seq_len + 1`` tokens with stride ``seq_len`` and read in a seeded order, so every
  token is a target exactly once per epoch across all data-parallel ranks.

In both, ``x = window[:-1]`` and ``y = window[1:]`` (int64, ``(batch_size, seq_len)``).
Windows may cross document boundaries (documents are separated by EOS, and start with
BOS where the tokenizer has one, as in GPT-2/nanoGPT pretraining); with
``doc_boundaries=True`` a batch is ``(x, y, doc_ids)`` where ``doc_ids`` numbers the
documents within each row (see :func:`document_ids`), which is what a per-document
causal mask needs.

**Resume.** ``state_dict()`` is a small JSON-able dict; a loader of the same geometry
given it by ``load_state_dict()`` continues with exactly the batches an uninterrupted
run would have drawn -- in the middle of an epoch and in the middle of a gradient
accumulation window alike, since a training step simply draws its micro-batches one
after another from the same loader.

**Data parallelism.** Give every rank its ``rank`` and ``world_size`` (in its options).  The
epoch loader splits each global batch of ``batch_size * world_size`` samples into disjoint
slices, and its state counts samples globally (identical on every rank), so a run may
resume on a different number of ranks as long as the global batch is unchanged.  The
random loader gives each rank its own generator (seeded with ``(seed, rank)``; rank 0 with
``seed`` alone, which is the same stream): ranks are independent, not disjoint, and its
state is per rank.

**Devices and prefetch.** On CUDA the host batch is put in pinned memory and copied with
``non_blocking=True``; ``pin_memory=False`` keeps it in pageable memory and copies it with
a plain ``.to(device)`` (on a CPU the option does nothing).  ``prefetch=N`` (an int; ``True``
is 1, ``False`` and ``0`` are off) keeps up to ``N`` next batches assembled ahead, in order,
on one background thread while the caller computes on the current one (numpy releases the
GIL for large copies, torch releases it in its kernels).  The positions are still drawn on
the caller's thread, so the batches are exactly those without prefetch, and ``state_dict()``
reports the position as of the batches handed out, not counting those in flight.  On CUDA
the thread also issues the host-to-device copies on a side stream, and ``next_batch`` makes
the caller's stream wait for its batch's copy (a CUDA event); a batch's pinned sources are
kept alive until its copy has completed, whether it is still queued or already handed out.
Prefetch is **off by default**: on a CPU (``benchmarks/loader.py``; the figures are in
docs/benchmarks.md#loader) waiting for a batch is a fraction of a percent of a tiny-preset
step without it and no measurably less with it, while the hand-off to the thread slows
batch assembly down (and the thread competes with torch's compute threads for the same
cores).  It is there for GPU runs whose steps are short enough for batch assembly to show.
"""

from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .datadir import DataDir, DataDirError

Batch = tuple[torch.Tensor, ...]  # (x, y) or (x, y, doc_ids), each (batch_size, seq_len) int64


@dataclass(frozen=True)
class LoaderOptions:
    """How a training loader cuts its batches and hands them out: all but what it reads (a
    data directory and a split) and, for :func:`make_loader`, which loader.

    The loader checks them when it is built: a ``ValueError`` names the field at fault
    (``seq_len``, ``batch_size``, ``rank`` and ``world_size``, ``prefetch``, ``step_samples``).
    """

    seq_len: int  # tokens per row; a window is seq_len + 1 tokens (inputs and shifted targets)
    batch_size: int  # rows per batch on this rank: the micro-batch
    seed: int  # the random loader's windows; the epoch loader's orders
    device: torch.device | str = "cpu"  # where batches are delivered
    rank: int = 0  # this data-parallel rank, 0 <= rank < world_size
    world_size: int = 1
    doc_boundaries: bool = False  # batches are (x, y, doc_ids): what a per-document causal mask needs
    eos_id: int | None = None  # the document separator for doc_ids; None = the data directory's
    prefetch: int | bool = 0  # batches assembled ahead on a background thread (True = 1; 0 = off)
    pin_memory: bool = True  # on CUDA: pinned host batches, copied asynchronously
    # The epoch loader's only (the random loader ignores them):
    shuffle: bool = True  # a seeded order per epoch; False = storage order
    step_samples: int | None = None  # samples per optimizer step over all ranks; None = one global batch


def _usable(counts: list[int], seq_len: int) -> np.ndarray:
    """Number of start positions of a (seq_len+1)-token window in each shard."""
    return np.array([max(0, n - seq_len) for n in counts], dtype=np.int64)


def _check_enough(datadir: DataDir, split: str, seq_len: int, usable: np.ndarray) -> None:
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    if usable.sum() == 0:
        counts = datadir.shard_token_counts(split)
        raise DataDirError(
            f"split {split!r} of {datadir.path} is too small for seq_len={seq_len}: a window needs "
            f"{seq_len + 1} tokens within one shard, but its {len(counts)} shard(s) hold "
            f"{sum(counts)} tokens (largest {max(counts)}); use a shorter train.seq_len or more data"
        )


def document_ids(x: torch.Tensor, eos_id: int, bos_id: int | None = None) -> torch.Tensor:
    """Number the documents within each row of ``x`` ``(B, T)``: a LongTensor ``(B, T)``.

    The rule: position 0 of every row is in document 0, and position ``t > 0`` starts a
    new document (the id goes up by one) when ``x[t-1]`` is EOS or ``x[t]`` is BOS.  So an
    EOS belongs to the document it ends and a BOS to the one it begins; ``... EOS BOS ...``
    is *one* boundary (both conditions hold at the same position), and a BOS or a
    previous-window EOS at position 0 starts nothing.  Tokens may attend to each other
    exactly when their ids are equal (and causality allows).
    """
    starts = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    starts[:, 1:] = x[:, :-1] == eos_id
    if bos_id is not None:
        starts[:, 1:] |= x[:, 1:] == bos_id
    return starts.to(torch.int64).cumsum(dim=1)


@dataclass
class _Ready:
    """One assembled batch: tokens ``(B, T+1)`` and doc ids ``(B, T)`` (host, or device when
    ``event`` is set: copied on the side stream, ``host`` keeps the host sources alive)."""

    tokens: torch.Tensor
    docs: torch.Tensor | None
    event: Any = None  # torch.cuda.Event recorded on the side stream after the copy
    host: tuple | None = None


class _BatchLoader:
    """What both loaders share: batch assembly, device transfer, prefetch, iteration.

    A subclass implements ``_draw()`` (the next batch's (shard index, offset) pairs;
    advances its position; always called on the caller's thread), ``_position()`` (a
    snapshot of that position) and ``_set_position()``.

    The options are copied into plain attributes (``seq_len``, ``batch_size``, ``rank``,
    ``device``, ...), normalized, so the per-batch path reads them directly; ``opts`` keeps
    the options as given.
    """

    def __init__(self, datadir: DataDir, split: str, opts: LoaderOptions):
        if opts.batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {opts.batch_size}")
        if opts.world_size <= 0 or not 0 <= opts.rank < opts.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={opts.rank}, world_size={opts.world_size}")
        self.opts = opts
        self.datadir = datadir
        self.split = split
        self.seq_len = int(opts.seq_len)
        self.batch_size = int(opts.batch_size)
        self.rank = int(opts.rank)
        self.world_size = int(opts.world_size)
        self.device = torch.device(opts.device)
        self.doc_boundaries = bool(opts.doc_boundaries)
        self.eos_id = datadir.eos_id if opts.eos_id is None else int(opts.eos_id)
        bos = datadir.meta.get("bos_id")
        self.bos_id = None if bos is None else int(bos)
        if int(opts.prefetch) < 0:
            raise ValueError(f"prefetch must be >= 0 (batches assembled ahead; 0 = off), got {opts.prefetch}")
        self.prefetch = int(opts.prefetch)  # True -> 1, False -> 0
        self.pin_memory = bool(opts.pin_memory)
        self._shards = datadir.shards(split)
        self._vocab = datadir.vocab_size
        self.batches = 0  # batches handed out by this loader (see state_dict for what resumes)
        # Prefetched batches, oldest first: (the position before its draw, its future).  The
        # oldest one's position is the position as of the batches handed out.
        self._pending: collections.deque[tuple[Any, concurrent.futures.Future]] = collections.deque()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None  # CUDA side stream for prefetched copies
        # (event, host sources) of handed-out prefetched CUDA batches whose copy may not have
        # completed, oldest first (queued ones keep theirs in their futures' results).
        self._held: collections.deque[tuple[Any, tuple]] = collections.deque()

    # ------------------------------------------------------------- subclass hooks
    def _draw(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _position(self) -> Any:
        raise NotImplementedError

    def _set_position(self, position: Any) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- assembly
    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def _assemble(self, plan: tuple[np.ndarray, np.ndarray]) -> _Ready:
        """Host batch for ``plan`` (thread-safe: reads the memory maps, writes fresh buffers)."""
        shard, offset = plan
        w = self.seq_len + 1
        buf = np.empty((len(shard), w), dtype=np.int64)
        for i, (s, o) in enumerate(zip(shard.tolist(), offset.tolist())):
            buf[i] = self._shards[s][o : o + w]  # uint16/uint32 -> int64
        if buf.max(initial=0) >= self._vocab:  # ~microseconds; an embedding lookup would fail far less clearly
            self._bad_token(buf, shard, offset)
        tokens = torch.from_numpy(buf)  # (B, T+1)
        docs = document_ids(tokens[:, :-1], self.eos_id, self.bos_id) if self.doc_boundaries else None
        if self.device.type == "cuda":
            if self.pin_memory:  # pinned host memory lets the copy run asynchronously and overlap compute
                tokens = tokens.pin_memory()
                docs = docs.pin_memory() if docs is not None else None
            if self._stream is not None:  # prefetching: copy now, on the side stream
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    dev_tokens = tokens.to(self.device, non_blocking=self.pin_memory)
                    dev_docs = docs.to(self.device, non_blocking=self.pin_memory) if docs is not None else None
                    event = torch.cuda.Event()
                    event.record(self._stream)
                return _Ready(dev_tokens, dev_docs, event, (tokens, docs))
        return _Ready(tokens, docs)

    def _bad_token(self, buf: np.ndarray, shard: np.ndarray, offset: np.ndarray) -> None:
        row, col = np.argwhere(buf >= self._vocab)[0]
        path = self.datadir.shard_paths(self.split)[int(shard[row])]
        raise DataDirError(
            f"{path}: token id {int(buf[row, col])} at position {int(offset[row]) + int(col):,} is not below the "
            f"vocabulary size {self._vocab:,}: the shard is corrupted (`flopwise prepare --verify "
            f"{self.datadir.path}` checks every shard)")

    def _finish(self, r: _Ready) -> Batch:
        tokens, docs = r.tokens, r.docs
        if r.event is not None:
            # Order the caller's stream after the side-stream copy, and tell the caching
            # allocator the device tensors are used there (not to be reused before).
            current = torch.cuda.current_stream(self.device)
            current.wait_event(r.event)
            tokens.record_stream(current)
            if docs is not None:
                docs.record_stream(current)
            assert r.host is not None  # set with the event (see _Ready)
            self._hold(r.event, r.host)
        elif self.device.type != "cpu":
            tokens = tokens.to(self.device, non_blocking=tokens.is_pinned())
            docs = docs.to(self.device, non_blocking=docs.is_pinned()) if docs is not None else None
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each
        return (x, y) if docs is None else (x, y, docs)

    def _hold(self, event: Any, host: tuple) -> None:
        """Keep a handed-out batch's host sources until its side-stream copy has completed."""
        while self._held and self._held[0][0].query():  # completed copies: their sources may go
            self._held.popleft()
        while len(self._held) >= max(1, self.prefetch):  # bound the list: copies issued batches ago
            self._held.popleft()[0].synchronize()
        self._held.append((event, host))

    # ------------------------------------------------------------- iteration
    def next_batch(self) -> Batch:
        """The next ``(x, y)`` (or ``(x, y, doc_ids)`` with ``doc_boundaries``), on ``device``."""
        if self._pending:
            ready = self._pending[0][1].result()  # an assembly error leaves it queued: raised again
            self._pending.popleft()
        else:
            ready = self._assemble(self._draw())
        self.batches += 1
        if self.prefetch:
            self._fill_prefetch()
        return self._finish(ready)

    def _fill_prefetch(self) -> None:
        """Queue draws until ``prefetch`` batches are in flight (drawn here, on the caller's thread)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flopwise-prefetch")
            if self.device.type == "cuda":
                self._stream = torch.cuda.Stream(device=self.device)
        while len(self._pending) < self.prefetch:
            position = self._position()  # before this draw: what state_dict reports while it is in flight
            self._pending.append((position, self._executor.submit(self._assemble, self._draw())))

    def _drop_prefetch(self) -> None:
        """Forget all prefetched batches, restoring the position as of the batches handed out.

        Waits for each (its side-stream copy completes before its pinned sources go).  An
        assembly error of a dropped batch (a corrupt shard) is not raised here: the batch was
        never handed out, and drawing it again raises it again.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, collections.deque()
        try:
            for _, future in pending:
                try:
                    dropped = future.result()
                except Exception:
                    continue
                if dropped.event is not None:
                    dropped.event.synchronize()
        finally:
            self._set_position(pending[0][0])

    def _current_position(self) -> Any:
        return self._pending[0][0] if self._pending else self._position()

    def close(self) -> None:
        """Stop the prefetch thread (a later ``next_batch`` starts a new one)."""
        self._drop_prefetch()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        while self._held:
            self._held.popleft()[0].synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return self.next_batch()


class RandomWindowLoader(_BatchLoader):
    """Endless random windows: ``(x, y)`` int64 tensors of shape ``(batch_size, seq_len)``.

    Sampled with replacement; a seeded ``numpy.random.Generator`` drives shard and offset
    choice, so the same seed gives the same batches (rank 0 draws exactly what this
    loader drew before it knew about ranks).  Under data parallelism each rank seeds its
    generator with ``(seed, rank)``: the ranks' streams are independent, not disjoint
    (use :class:`EpochLoader` for disjoint data).  The state (generator state and batch
    count) is per rank: each rank must save and restore its own, and loading a state
    taken on another rank or world size is refused.  The options' ``shuffle`` and
    ``step_samples`` (the epoch loader's) do not apply.
    """

    mode = "random"

    def __init__(self, datadir: DataDir, split: str, opts: LoaderOptions):
        super().__init__(datadir, split, opts)
        self.seed = int(opts.seed)
        self._usable = _usable(datadir.shard_token_counts(split), self.seq_len)
        _check_enough(datadir, split, self.seq_len, self._usable)
        self._p = self._usable / self._usable.sum()
        # default_rng((seed, 0)) is the same stream as default_rng(seed); spelled out anyway.
        self._rng = np.random.default_rng(self.seed if self.rank == 0 else (self.seed, self.rank))

    def sample_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Draw the next batch's (shard index, offset) pairs; advances the generator."""
        if len(self._shards) == 1:
            shard = np.zeros(self.batch_size, dtype=np.int64)
        else:
            shard = self._rng.choice(len(self._shards), size=self.batch_size, p=self._p)
        offset = self._rng.integers(0, self._usable[shard])
        return shard, offset

    _draw = sample_positions

    def _position(self) -> dict[str, Any]:
        return self._rng.bit_generator.state  # type: ignore[return-value]  # a fresh dict; numpy's stubs say Mapping

    def _set_position(self, position: dict[str, Any]) -> None:
        rng = np.random.default_rng()
        rng.bit_generator.state = position
        self._rng = rng

    def state_dict(self) -> dict[str, Any]:
        """A resume point for this rank: generator state and batches drawn (JSON-able)."""
        return {
            "mode": self.mode,
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_tokens": self.datadir.num_tokens(self.split),
            "batches": self.batches,
            "rng": self._current_position(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (same data; same shapes for identical batches)."""
        mode = state.get("mode", "random")
        if mode != self.mode:
            raise ValueError(f"loader state is for mode {mode!r}, this loader is mode {self.mode!r}")
        if state.get("split") != self.split:
            raise ValueError(f"loader state is for split {state.get('split')!r}, this loader reads {self.split!r}")
        n = self.datadir.num_tokens(self.split)
        if state.get("num_tokens", n) != n:
            raise ValueError(
                f"loader state was taken on a split of {state['num_tokens']} tokens, but split "
                f"{self.split!r} of {self.datadir.path} has {n}: the data changed"
            )
        rank, world = int(state.get("rank", 0)), int(state.get("world_size", 1))
        if (rank, world) != (self.rank, self.world_size):
            raise ValueError(
                f"random-window loader state was taken on rank {rank} of {world}, this loader is rank "
                f"{self.rank} of {self.world_size}: each rank has its own random stream, so its state only "
                "resumes on the same rank of the same world size (restore each rank's own state, or use "
                "mode 'epoch', whose position is global and survives a change of world size)"
            )
        self._drop_prefetch()
        self._set_position(state["rng"])
        self.batches = int(state["batches"])


class EpochLoader(_BatchLoader):
    """Deterministic epochs over packed samples: every token a target exactly once per epoch.

    **Packing.** Each shard is cut into samples of ``seq_len + 1`` tokens with stride
    ``seq_len`` (sample ``j`` of a shard is its tokens ``[j*T, j*T + T + 1)``), so
    consecutive samples share one token and every token but the shard's first is a
    target exactly once.  No sample crosses a shard boundary; the trailing remainder of a
    shard shorter than a sample is not used (:attr:`remainder_tokens`).

    **Order.** Epoch ``e`` reads all samples of the split in the order
    ``numpy.random.default_rng((seed, e)).permutation(num_samples)`` (``shuffle=False``:
    in storage order).  The order is cut into *global batches* of
    ``batch_size * world_size`` samples; rank ``r`` takes samples
    ``[g*B*W + r*B, g*B*W + (r+1)*B)`` of global batch ``g``, so ranks are disjoint and
    together read each sample of an epoch once.  An epoch holds whole optimizer steps of
    ``step_samples`` (default one global batch; the trainer passes its global batch): the
    last partial step is **dropped** (wrapping it into the next epoch would show some
    samples twice in one epoch): :attr:`dropped_samples_per_epoch` =
    ``num_samples % step_samples`` samples, a different set each epoch when shuffled,
    always the last ones when not.  Epochs roll over by themselves: after the last full
    step the next batch comes from epoch ``e + 1`` and its own permutation.

    **State** is global -- epoch, the position in that epoch's order counted in samples
    over all ranks, and the count of global batches -- identical on every rank, so any rank's
    state resumes every rank.  It resumes exactly on another ``world_size`` or micro-batch
    when the samples per step are unchanged (2 ranks x 4 x 2 micro-batches -> 1 rank x 4 x 4,
    or -> 1 rank x 8 x 2): a step takes the same consecutive samples of the order whoever
    computes them.  Different samples per step, ``seq_len``, seed, shuffle, split or data
    are refused.
    """

    mode = "epoch"

    def __init__(self, datadir: DataDir, split: str, opts: LoaderOptions):
        super().__init__(datadir, split, opts)
        if self.seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {opts.seq_len}")
        G = self.global_batch_size
        self.step_samples = int(opts.step_samples) if opts.step_samples else G
        if self.step_samples % G:
            raise ValueError(f"step_samples ({self.step_samples}) must be a multiple of batch_size x world_size ({G})")
        self.seed = int(opts.seed)
        self.shuffle = bool(opts.shuffle)
        T = self.seq_len
        self._counts = datadir.shard_token_counts(split)
        _check_enough(datadir, split, T, _usable(self._counts, T))  # not even one window: say so, as random does
        per_shard = np.array([(n - 1) // T if n > T else 0 for n in self._counts], dtype=np.int64)
        self._bounds = np.cumsum(per_shard)  # sample g lies in shard searchsorted(bounds, g, "right")
        self._first = self._bounds - per_shard  # global index of each shard's first sample
        self.num_samples = int(per_shard.sum())
        self.remainder_tokens = int(sum(n - (k * T + 1) if k else n for n, k in zip(self._counts, per_shard)))
        if self.num_samples < self.step_samples:
            raise DataDirError(
                f"split {split!r} of {datadir.path} is too small for seq_len={T} with this batch: {self.num_samples} "
                f"packed samples of {T + 1} tokens (none across a shard boundary, "
                f"{sum(self._counts)} tokens in {len(self._counts)} shard(s)) but a global batch takes "
                f"{self.batch_size} x {self.world_size} rank(s)"
                + (f" x {self.step_samples // G} micro-batches" if self.step_samples != G else "")
                + f" = {self.step_samples}; use a shorter seq_len, a smaller batch "
                "or more data"
            )
        self._set_geometry(self.step_samples)
        self._epoch = 0
        self._pos = 0  # samples of this epoch's order already drawn, over all ranks
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _set_geometry(self, step_samples: int) -> None:
        """Epochs end on a step boundary: whole steps of ``step_samples`` per epoch."""
        self.step_samples = step_samples
        steps = self.num_samples // step_samples
        self.batches_per_epoch = steps * (step_samples // self.global_batch_size)  # global = per rank
        self.dropped_samples_per_epoch = self.num_samples - steps * step_samples

    # ------------------------------------------------------------- accounting
    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def target_tokens_per_epoch(self) -> int:
        """Tokens trained on (as targets) per epoch, over all ranks."""
        return self.batches_per_epoch * self.global_batch_size * self.seq_len

    @property
    def dropped_tokens_per_epoch(self) -> int:
        """Tokens of the split that are not a target in an epoch: the shards' remainders,
        each shard's first token, and the targets of the dropped samples."""
        return sum(self._counts) - self.target_tokens_per_epoch

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._current_position()[0]

    @property
    def global_sample_position(self) -> int:
        """Samples of the current epoch's order drawn so far, over all ranks."""
        return self._current_position()[1]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch`` (read-only; cached for the current epoch)."""
        cache = self._order_cache
        if cache is not None and cache[0] == epoch:
            return cache[1]
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples, dtype=np.int64)
        order.flags.writeable = False
        self._order_cache = (epoch, order)
        return order

    def sample_location(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, token offset) of global sample indices."""
        shard = np.searchsorted(self._bounds, index, side="right")
        return shard, (index - self._first[shard]) * self.seq_len

    # ------------------------------------------------------------- position
    def _draw(self) -> tuple[np.ndarray, np.ndarray]:
        B, G = self.batch_size, self.global_batch_size
        lo = self._pos + self.rank * B
        idx = self.epoch_order(self._epoch)[lo : lo + B]
        self._pos += G
        S = self.step_samples
        if self._pos % S == 0 and self._pos + S > self.num_samples:  # only a partial step left: next epoch
            self._epoch += 1
            self._pos = 0
        return self.sample_location(idx)

    def _position(self) -> tuple[int, int]:
        return self._epoch, self._pos

    def _set_position(self, position: tuple[int, int]) -> None:
        self._epoch, self._pos = position

    def state_dict(self) -> dict[str, Any]:
        """The global resume point (the same on every rank; JSON-able)."""
        epoch, pos = self._current_position()
        return {
            "mode": self.mode,
            "split": self.split,
            "seq_len": self.seq_len,
            "shard_tokens": list(self._counts),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": epoch,
            "global_sample_position": pos,
            "batches": self.batches,  # global batches handed out = batches per rank, all epochs
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "step_samples": self.step_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken, on this rank; refuses what cannot."""
        mode = state.get("mode", "random")
        if mode != self.mode:
            raise ValueError(f"loader state is for mode {mode!r}, this loader is mode {self.mode!r}")
        problems = []
        for key, mine in (("split", self.split), ("seq_len", self.seq_len), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                problems.append(f"{key} {state.get(key)!r} in the state, {mine!r} here")
        if list(state.get("shard_tokens", [])) != self._counts:
            problems.append(
                f"the data changed: the state was taken on shards of {state.get('shard_tokens')} tokens, split "
                f"{self.split!r} of {self.datadir.path} has {self._counts}"
            )
        b, w = int(state["batch_size"]), int(state["world_size"])
        # States from before step_samples existed cut epochs into global micro-batches (b x w).
        saved_step = int(state.get("step_samples", b * w))
        step = self.step_samples if "step_samples" in state else b * w
        if saved_step != step or saved_step % self.global_batch_size:
            problems.append(
                f"batch geometry changed: the state was taken with {w} rank(s) x batch_size {b}, "
                f"{saved_step} samples per optimizer step; this loader has {self.world_size} rank(s) x batch_size "
                f"{self.batch_size}, {step} samples per step; epochs are cut into whole steps, so any geometry "
                f"with the same samples per step ({saved_step}) and batch_size x world_size dividing it "
                "continues exactly"
            )
        if problems:
            raise ValueError("cannot resume the epoch loader: " + "; ".join(problems))
        epoch, pos = int(state["epoch"]), int(state["global_sample_position"])
        if epoch < 0 or pos < 0 or pos % self.global_batch_size or pos + self.global_batch_size > self.num_samples:
            raise ValueError(f"loader state has an impossible position: epoch {epoch}, sample {pos} of "
                             f"{self.num_samples} with global batches of {self.global_batch_size}")
        self._drop_prefetch()
        self._set_geometry(saved_step)
        self._set_position((epoch, pos))
        self.batches = int(state.get("batches", 0))


def make_loader(mode: str, datadir: DataDir, split: str, opts: LoaderOptions) -> RandomWindowLoader | EpochLoader:
    """The training loader of ``split`` of ``datadir``: ``mode`` ``"random"``
    (:class:`RandomWindowLoader`) or ``"epoch"`` (:class:`EpochLoader`), as ``opts`` says."""
    if mode == "random":
        return RandomWindowLoader(datadir, split, opts)
    if mode == "epoch":
        return EpochLoader(datadir, split, opts)
    raise ValueError(f"unknown loader mode {mode!r}: expected 'random' or 'epoch'")


def overlap_note(n_windows: int, seq_len: int, split_tokens: int) -> str:
    """"" when ``n_windows`` windows of ``seq_len + 1`` tokens fit in the split side by side;
    else that they overlap (each token is scored about N times: the loss is of fewer tokens
    than the count of windows suggests, and noisier)."""
    need = n_windows * (seq_len + 1)
    if need <= split_tokens:
        return ""
    return (f"{n_windows:,} windows need {need:,} tokens and the split holds {split_tokens:,}, so they overlap "
            f"(each token scored ~{need / max(split_tokens, 1):.1f}x)")


def fixed_windows(datadir: DataDir, split: str, seq_len: int, n_windows: int) -> torch.Tensor:
    """``n_windows`` evenly spaced windows of ``seq_len + 1`` tokens: ``(n, seq_len + 1)`` int64.

    The same every call (no randomness): a fixed held-out subset for validation.  The
    windows are centred in equal slices of all start positions of the split, so they do
    not overlap unless ``n_windows * (seq_len + 1)`` exceeds the split's size.
    """
    if n_windows <= 0:
        raise ValueError(f"n_windows must be > 0, got {n_windows}")
    usable = _usable(datadir.shard_token_counts(split), seq_len)
    _check_enough(datadir, split, seq_len, usable)
    shards = datadir.shards(split)
    total = int(usable.sum())
    starts = (np.arange(n_windows, dtype=np.int64) * 2 + 1) * total // (2 * n_windows)
    bounds = np.cumsum(usable)  # start position g lies in shard searchsorted(bounds, g, "right")
    out = np.empty((n_windows, seq_len + 1), dtype=np.int64)
    for i, g in enumerate(starts.tolist()):
        s = int(np.searchsorted(bounds, g, side="right"))
        o = g - (int(bounds[s - 1]) if s > 0 else 0)
        out[i] = shards[s][o : o + seq_len + 1]
    return torch.from_numpy(out)
