"""A prepared data directory: ``meta.json``, ``tokenizer.json`` and ``SPLIT-NNNNN.bin`` shards.

:class:`DataDir` checks the whole directory when it is opened (cheap: headers and
file sizes only, no token is read), so a problem is reported before a model is
allocated, naming the file and field at fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .shards import FORMAT_VERSION, ShardError, dtype_for_vocab, read_header, read_shard
from .tokenizer import file_sha256, load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ..config import DataConfig


class DataDirError(ValueError):
    """The data directory is incomplete or inconsistent."""


_REQUIRED = ("format_version", "tokenizer", "vocab_size", "eos_id", "splits")


class DataDir:
    def __init__(self, path: str | os.PathLike, verify: bool = False):
        """Open and validate ``path``. ``verify=True`` also checksums every shard (slow)."""
        self.path = Path(path).expanduser()
        self._tokenizer: Tokenizer | None = None
        self._shards: dict[str, list[np.ndarray]] = {}
        p = self.path
        if not p.is_dir():
            raise DataDirError(f"data directory {p} does not exist (run `flopwise prepare` first)")
        meta_path = p / "meta.json"
        if not meta_path.is_file():
            raise DataDirError(f"{meta_path}: missing; {p} is not a prepared data directory")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DataDirError(f"{meta_path}: not valid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise DataDirError(f"{meta_path}: expected a JSON object")
        missing = [k for k in _REQUIRED if k not in meta]
        if missing:
            raise DataDirError(f"{meta_path}: missing field(s) {', '.join(missing)}")
        if meta["format_version"] != FORMAT_VERSION:
            raise DataDirError(
                f"{meta_path}: format_version {meta['format_version']} is not supported "
                f"(this flopwise reads {FORMAT_VERSION}); prepare the data again"
            )
        vocab = meta["vocab_size"]
        if not isinstance(vocab, int) or vocab <= 0:
            raise DataDirError(f"{meta_path}: vocab_size must be a positive integer, got {vocab!r}")
        eos = meta["eos_id"]
        if not isinstance(eos, int) or not 0 <= eos < vocab:
            raise DataDirError(f"{meta_path}: eos_id {eos!r} is not a token id below vocab_size {vocab}")
        self.meta: dict[str, Any] = meta

        tok_path = p / str(meta["tokenizer"])
        if not tok_path.is_file():
            raise DataDirError(f"{tok_path}: tokenizer file missing (meta.json field 'tokenizer')")
        want = meta.get("tokenizer_sha256")
        if want and file_sha256(tok_path) != want:
            raise DataDirError(
                f"{tok_path}: sha256 does not match meta.json field 'tokenizer_sha256' "
                "(the tokenizer was replaced after the shards were written)"
            )
        self.tokenizer_path = tok_path

        splits = meta["splits"]
        if not isinstance(splits, dict) or not splits:
            raise DataDirError(f"{meta_path}: field 'splits' must be a non-empty object")
        dtype = dtype_for_vocab(vocab)
        self._paths: dict[str, list[Path]] = {}
        self._counts: dict[str, list[int]] = {}
        for split, info in splits.items():
            where = f"{meta_path}: splits.{split}"
            if not isinstance(info, dict) or not isinstance(info.get("shards"), list) or not info["shards"]:
                raise DataDirError(f"{where}.shards must be a non-empty list of shard file names")
            paths, counts = [], []
            for name in info["shards"]:
                sp = p / str(name)
                if not sp.is_file():
                    raise DataDirError(f"{sp}: shard missing (listed in {where}.shards)")
                try:
                    h = read_header(sp)
                except ShardError as e:
                    raise DataDirError(str(e)) from None
                if h.vocab_size != vocab:
                    raise DataDirError(
                        f"{sp}: header vocab_size {h.vocab_size} does not match meta.json vocab_size {vocab}"
                    )
                if h.dtype != dtype:
                    raise DataDirError(f"{sp}: dtype {h.dtype.name} but vocab_size {vocab} needs {dtype.name}")
                if verify:
                    try:
                        read_shard(sp, verify=True)
                    except ShardError as e:
                        raise DataDirError(str(e)) from None
                paths.append(sp)
                counts.append(h.n_tokens)
            if "tokens" in info and info["tokens"] != sum(counts):
                raise DataDirError(
                    f"{where}.tokens is {info['tokens']} but its shards hold {sum(counts)} tokens"
                )
            self._paths[split] = paths
            self._counts[split] = counts

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def bos_id(self) -> int | None:
        """The id framing the start of every document, when the tokenizer defines one."""
        bos = self.meta.get("bos_id")
        return None if bos is None else int(bos)

    @property
    def splits(self) -> list[str]:
        return list(self._paths)

    @property
    def tokenizer(self) -> "Tokenizer":
        """The tokenizer, loaded on first use."""
        if self._tokenizer is None:
            tok = load_tokenizer(self.tokenizer_path)
            if tok.get_vocab_size() != self.vocab_size:
                raise DataDirError(
                    f"{self.tokenizer_path}: vocabulary of {tok.get_vocab_size()} tokens does not "
                    f"match meta.json vocab_size {self.vocab_size}"
                )
            self._tokenizer = tok
        return self._tokenizer

    def has_split(self, split: str) -> bool:
        return split in self._paths

    def _check_split(self, split: str) -> None:
        if split not in self._paths:
            raise DataDirError(
                f"split {split!r} is not in data directory {self.path} "
                f"(meta.json has: {', '.join(self._paths)})"
            )

    def shard_paths(self, split: str) -> list[Path]:
        self._check_split(split)
        return list(self._paths[split])

    def shards(self, split: str) -> list[np.ndarray]:
        """Read-only memory maps of the split's shards (opened once, then reused)."""
        self._check_split(split)
        if split not in self._shards:
            self._shards[split] = [read_shard(sp) for sp in self._paths[split]]
        return self._shards[split]

    def shard_token_counts(self, split: str) -> list[int]:
        self._check_split(split)
        return list(self._counts[split])

    def num_tokens(self, split: str) -> int:
        self._check_split(split)
        return sum(self._counts[split])

    def num_documents(self, split: str) -> int | None:
        self._check_split(split)
        return self.meta["splits"][split].get("documents")

    def __repr__(self) -> str:
        parts = ", ".join(f"{s}={self.num_tokens(s):,}" for s in self._paths)
        return f"DataDir({str(self.path)!r}, vocab_size={self.vocab_size}, tokens: {parts})"


def resolve_data_dir(cfg: "DataConfig", log=print) -> Path:
    """The data directory a config points at: ``cfg.path``, else the prepared embedded corpus."""
    if cfg.path:
        return Path(cfg.path).expanduser()
    from .builtin import prepare_builtin

    return prepare_builtin(cfg.cache_dir, vocab_size=cfg.builtin_vocab_size, max_mb=cfg.builtin_max_mb, log=log)


def open_data_dir(cfg: "DataConfig", log=print, verify: bool = False) -> DataDir:
    """``DataDir(resolve_data_dir(cfg))``: prepares the embedded corpus on first use."""
    return DataDir(resolve_data_dir(cfg, log=log), verify=verify)
