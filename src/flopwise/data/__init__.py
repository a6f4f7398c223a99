"""Data: token shards, byte-level BPE tokenizers, the embedded corpus, and loaders.

Text becomes a *data directory* (``tokenizer.json``, ``meta.json``,
``SPLIT-NNNNN.bin`` shards); :class:`DataDir` opens and validates one;
:func:`make_loader` builds a training loader over it (:class:`RandomWindowLoader` or
:class:`EpochLoader`, set up by a :class:`LoaderOptions`) and :func:`fixed_windows` draws
a fixed validation subset.
"""

import importlib

# Names are imported on first use (PEP 562): tokenizer worker processes import
# flopwise.data.prepare and must not pay for torch, which only the loader needs.
_EXPORTS = {
    "prepare_builtin": ".builtin",
    "DataDir": ".datadir", "DataDirError": ".datadir", "open_data_dir": ".datadir", "resolve_data_dir": ".datadir",
    "LoaderOptions": ".loader", "RandomWindowLoader": ".loader", "EpochLoader": ".loader", "make_loader": ".loader",
    "document_ids": ".loader", "fixed_windows": ".loader",
    "ShardError": ".shards", "ShardWriter": ".shards", "SplitWriter": ".shards", "read_header": ".shards",
    "read_shard": ".shards", "scan_tokens": ".shards", "shard_name": ".shards", "write_shard": ".shards",
    "Source": ".sources", "SourceError": ".sources", "open_source": ".sources",
    "EOS_TOKEN": ".tokenizer", "encode_documents": ".tokenizer", "eos_id": ".tokenizer",
    "load_tokenizer": ".tokenizer", "train_bpe": ".tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
