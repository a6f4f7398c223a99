"""Data: token shards, byte-level BPE tokenizers, the embedded corpus, and loaders.

Text becomes a *data directory* (``tokenizer.json``, ``meta.json``,
``SPLIT-NNNNN.bin`` shards); :class:`DataDir` opens and validates one;
:class:`RandomWindowLoader` draws training batches from it and :func:`fixed_windows`
a fixed validation subset.
"""

from .builtin import prepare_builtin
from .datadir import DataDir, DataDirError, open_data_dir, resolve_data_dir
from .loader import RandomWindowLoader, fixed_windows
from .shards import ShardError, ShardWriter, read_header, read_shard, shard_name, write_shard
from .sources import Source, SourceError, open_source
from .tokenizer import EOS_TOKEN, eos_id, load_tokenizer, train_bpe

__all__ = [
    "DataDir",
    "DataDirError",
    "EOS_TOKEN",
    "RandomWindowLoader",
    "ShardError",
    "ShardWriter",
    "eos_id",
    "fixed_windows",
    "load_tokenizer",
    "open_data_dir",
    "prepare_builtin",
    "read_header",
    "read_shard",
    "resolve_data_dir",
    "shard_name",
    "train_bpe",
    "write_shard",
]
