"""A prepared data directory: ``meta.json``, ``tokenizer.json`` and ``SPLIT-NNNNN.bin`` shards.

:class:`DataDir` checks the whole directory when it is opened (cheap: headers and
file sizes only, no token is read), so a problem is reported before a model is
allocated, naming the file and field at fault.

:func:`open_data_dir` -- how ``train`` and ``preflight`` open their data, and ``eval`` the
data of a run -- also reads every shard once (:meth:`DataDir.check_shards`): its crc32
against the header and its largest id against the vocabulary. Without it a shard overwritten with valid ids
would train silently, and an id beyond the vocabulary would be found only if a sampled
window happened to hit it. Reading a 20 GB corpus at every start would cost minutes,
so a shard that passed is remembered in a small JSON file in the user's cache folder
(``data.cache_dir``/``verified/``, one per data directory) by its identity: size,
mtime and ctime (ns), inode, and the header's crc32, token count and vocabulary. Any
write to a shard changes its mtime and ctime, so a changed shard is read again. The
record lives in the cache folder, not in the data directory, so a read-only or shared
data directory is checked once per user too, and someone who can write the data
directory cannot also mark it checked; where the cache folder cannot be written the
shards are simply read at every start.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flopwise.errors import FlopwiseError

from ..fsio import FileFormatError, WriteError, describe_write_error, read_json, write_json
from .builtin import prepare_builtin
from .shards import FORMAT_VERSION, ShardError, ShardHeader, dtype_for_vocab, read_header, read_shard, scan_tokens
from .tokenizer import file_sha256, load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ..config import DataConfig


class DataDirError(FlopwiseError, ValueError):
    """The data directory is incomplete or inconsistent."""


_REQUIRED = ("format_version", "tokenizer", "vocab_size", "eos_id", "splits")
CHECK_CACHE_VERSION = 1


class DataDir:
    def __init__(self, path: str | os.PathLike, verify: bool = False):
        """Open and validate ``path``. ``verify=True`` also reads every shard (:meth:`check_shards`
        without a cache: ``flopwise prepare --verify``)."""
        self.path = Path(path).expanduser()
        self._tokenizer: Tokenizer | None = None
        self._shards: dict[str, list[np.ndarray]] = {}
        p = self.path
        if not p.is_dir():
            where = "" if p.is_absolute() else f" (from {Path.cwd()}: {p.absolute()})"
            raise DataDirError(f"data directory {p} does not exist{where}: run `flopwise prepare`, "
                               "or point at where it is")
        meta_path = p / "meta.json"
        if not meta_path.is_file():
            raise DataDirError(f"{meta_path}: missing; {p} is not a prepared data directory")
        try:
            meta = read_json(meta_path)  # too large, not UTF-8, nested too deeply, not JSON: named
        except FileFormatError as e:
            raise DataDirError(str(e)) from None
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
        self._headers: dict[str, list[ShardHeader]] = {}
        for split, info in splits.items():
            where = f"{meta_path}: splits.{split}"
            if not isinstance(info, dict) or not isinstance(info.get("shards"), list) or not info["shards"]:
                raise DataDirError(f"{where}.shards must be a non-empty list of shard file names")
            paths, counts, headers = [], [], []
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
                paths.append(sp)
                counts.append(h.n_tokens)
                headers.append(h)
            if "tokens" in info and info["tokens"] != sum(counts):
                raise DataDirError(
                    f"{where}.tokens is {info['tokens']} but its shards hold {sum(counts)} tokens"
                )
            self._paths[split] = paths
            self._counts[split] = counts
            self._headers[split] = headers
        if verify:
            self.check_shards()

    # ------------------------------------------------------------------ contents
    def check_shards(self, cache_file: Path | None = None, force: bool = False) -> dict[str, Any]:
        """Read every shard: crc32 against its header, every id below the vocabulary.

        A shard whose identity (see the module docstring) matches its record in
        ``cache_file`` from an earlier pass is not read again (``force`` reads all);
        the records of this pass are written back atomically when anything changed.
        Raises :class:`DataDirError` naming the shard. Returns what it did:
        ``{"read": shards read, "bytes": bytes read, "cached": shards taken from the
        record, "saved": None or why the record could not be written}``.
        """
        known = {} if force or cache_file is None else _read_check_cache(cache_file, self.path)
        records: dict[str, Any] = {}
        read, nbytes = 0, 0
        for split, paths in self._paths.items():
            for sp, h in zip(paths, self._headers[split]):
                identity = _shard_identity(sp, h)
                rec = known.get(sp.name)
                if isinstance(rec, dict) and rec.get("identity") == identity and isinstance(rec.get("max_id"), int):
                    top = rec["max_id"]
                else:
                    try:
                        top = scan_tokens(sp, h)
                    except ShardError as e:
                        raise DataDirError(str(e)) from None
                    read, nbytes = read + 1, nbytes + h.nbytes
                if top >= self.vocab_size:  # (scan_tokens checks the header's vocabulary, equal to meta's)
                    raise DataDirError(f"{sp}: token id {top} is not below the vocabulary size {self.vocab_size:,}")
                records[sp.name] = {"identity": identity, "max_id": top}
        saved = None
        if cache_file is not None and records != known:
            blob = {"version": CHECK_CACHE_VERSION, "data_dir": os.path.realpath(self.path), "shards": records}
            try:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                write_json(cache_file, blob)
            except OSError as e:  # a read-only or full cache folder: check again next time
                saved = str(e) if isinstance(e, WriteError) else f"{cache_file}: {describe_write_error(e)}"
        return {"read": read, "bytes": nbytes, "cached": sum(len(v) for v in self._paths.values()) - read,
                "saved": saved}

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


def _shard_identity(path: Path, h: ShardHeader) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, h.crc32, h.n_tokens, h.vocab_size]


def check_cache_path(cache_dir: str | os.PathLike, data_dir: Path) -> Path:
    """Where the shard-check record of ``data_dir`` lives: one small file per data directory."""
    key = hashlib.blake2b(os.path.realpath(data_dir).encode(), digest_size=8).hexdigest()
    return Path(cache_dir).expanduser() / "verified" / f"{key}.json"


def _read_check_cache(cache_file: Path, data_dir: Path) -> dict[str, Any]:
    try:
        blob = read_json(cache_file)
    except (OSError, ValueError):
        return {}
    if (not isinstance(blob, dict) or blob.get("version") != CHECK_CACHE_VERSION
            or blob.get("data_dir") != os.path.realpath(data_dir) or not isinstance(blob.get("shards"), dict)):
        return {}
    return blob["shards"]


def resolve_data_dir(cfg: "DataConfig", log=print) -> Path:
    """The data directory a config points at: ``cfg.path``, else the prepared embedded corpus."""
    if cfg.path:
        return Path(cfg.path).expanduser()
    try:
        return prepare_builtin(cfg.cache_dir, vocab_size=cfg.builtin_vocab_size, max_mb=cfg.builtin_max_mb, log=log)
    except OSError as e:  # a full or read-only cache folder: one line, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        raise DataDirError(f"the embedded corpus could not be prepared in {cfg.cache_dir}: {where}"
                           f"{describe_write_error(e)} (data.cache_dir chooses the folder)") from e


def open_data_dir(cfg: "DataConfig", log=print, verify: bool = False) -> DataDir:
    """``DataDir(resolve_data_dir(cfg))``, every shard's checksum and id range checked (once per
    shard identity, remembered under ``cfg.cache_dir``; ``verify=True`` reads them all again)."""
    dd = DataDir(resolve_data_dir(cfg, log=log))
    t = time.perf_counter()
    done = dd.check_shards(check_cache_path(cfg.cache_dir, dd.path), force=verify)
    if done["read"]:
        note = f"; not remembered ({done['saved']}): the next start reads them again" if done["saved"] else ""
        log(f"data: checked {done['read']} shard(s) of {dd.path} ({done['bytes'] / 1e6:,.1f} MB: checksums, "
            f"id range) in {time.perf_counter() - t:.1f}s{note}")
    return dd
