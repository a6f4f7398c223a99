"""Random-window batches from memory-mapped token shards.

Each row of a batch is a random contiguous window of ``seq_len + 1`` tokens from one
shard (windows may cross document boundaries; documents are separated by EOS, as in
GPT-2/nanoGPT pretraining).  ``x = window[:-1]``, ``y = window[1:]``.

The shard is drawn with probability proportional to its number of start positions
(``n_tokens - seq_len``), then the offset uniformly, so every start position of the
split is equally likely.  A seeded ``numpy.random.Generator`` drives both, so the same
seed gives the same batches, and its state plus the batch count is a complete resume
point (``state_dict``).  Under data parallelism give each rank its own seed
(e.g. ``seed + rank``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .datadir import DataDir, DataDirError


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


def _to_device(buf: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(buf)  # (B, T+1) int64
    if device.type == "cuda":
        # Pinned host memory (from torch's caching host allocator, so it is not freed
        # while the copy is in flight) lets the copy overlap with compute.
        t = t.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        t = t.to(device)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()  # x, y: (B, T)


class RandomWindowLoader:
    """Endless iterator of ``(x, y)`` int64 tensors of shape ``(batch_size, seq_len)``."""

    def __init__(
        self,
        datadir: DataDir,
        split: str,
        seq_len: int,
        batch_size: int,
        seed: int,
        device: torch.device | str = "cpu",
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.datadir = datadir
        self.split = split
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.device = torch.device(device)
        self._shards = datadir.shards(split)
        self._usable = _usable(datadir.shard_token_counts(split), self.seq_len)
        _check_enough(datadir, split, self.seq_len, self._usable)
        self._p = self._usable / self._usable.sum()
        self._rng = np.random.default_rng(self.seed)
        self.batches = 0  # batches drawn so far

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def sample_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Draw the next batch's (shard index, offset) pairs; advances the generator."""
        if len(self._shards) == 1:
            shard = np.zeros(self.batch_size, dtype=np.int64)
        else:
            shard = self._rng.choice(len(self._shards), size=self.batch_size, p=self._p)
        offset = self._rng.integers(0, self._usable[shard])
        return shard, offset

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        shard, offset = self.sample_positions()
        w = self.seq_len + 1
        buf = np.empty((self.batch_size, w), dtype=np.int64)
        for i, (s, o) in enumerate(zip(shard.tolist(), offset.tolist())):
            buf[i] = self._shards[s][o : o + w]  # uint16/uint32 -> int64
        self.batches += 1
        return _to_device(buf, self.device)

    def __iter__(self) -> "RandomWindowLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """A resume point: generator state and batches drawn (plain JSON-able values)."""
        return {
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_tokens": self.datadir.num_tokens(self.split),
            "batches": self.batches,
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (same data; same shapes for identical batches)."""
        if state.get("split") != self.split:
            raise ValueError(f"loader state is for split {state.get('split')!r}, this loader reads {self.split!r}")
        n = self.datadir.num_tokens(self.split)
        if state.get("num_tokens", n) != n:
            raise ValueError(
                f"loader state was taken on a split of {state['num_tokens']} tokens, but split "
                f"{self.split!r} of {self.datadir.path} has {n}: the data changed"
            )
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        self._rng = rng
        self.batches = int(state["batches"])


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
