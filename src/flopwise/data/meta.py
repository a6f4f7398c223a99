"""``meta.json``, the index of a data directory, and its one writer.

Both ways of making a data directory -- ``flopwise prepare`` (``prepare.py``) and the embedded
corpus (``builtin.py``) -- describe what they wrote through :func:`write_meta`, so every data
directory carries the same fields whichever path made it; :class:`flopwise.data.datadir.DataDir`
reads and checks them. Fields: ``format_version`` (of the shards), ``source``, ``tokenizer``
(file name) and ``tokenizer_sha256``, ``vocab_size``, ``dtype``, ``eos_id``, ``bos_id`` (None
when the tokenizer has none), ``splits`` (per split: shard names, tokens, documents ...),
``documents`` (each counted once), ``fingerprint`` (of every input), ``created``, ``recipe``
(how the maker chose what it wrote).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..fsio import write_json
from .shards import FORMAT_VERSION, dtype_for_vocab
from .tokenizer import file_sha256

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"


def write_meta(directory: Path, *, source: str, vocab_size: int, eos_id: int, bos_id: int | None,
               splits: dict[str, dict[str, Any]], fingerprint: str, recipe: dict[str, Any]) -> dict[str, Any]:
    """Write ``directory/meta.json`` atomically for the shards and ``tokenizer.json`` already in
    ``directory``; return what was written. A failed write raises ``fsio.WriteError`` naming meta.json."""
    meta = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": file_sha256(directory / TOKENIZER_FILE),
        "vocab_size": vocab_size,
        "dtype": dtype_for_vocab(vocab_size).name,
        "eos_id": eos_id,
        "bos_id": bos_id,
        "splits": splits,
        "documents": sum(info["documents"] for info in splits.values()),  # each counted once
        "fingerprint": fingerprint,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe,
    }
    write_json(directory / META_FILE, meta)
    return meta


def held_out_overlap_note(meta: dict[str, Any]) -> str:
    """"" unless ``meta`` is of a directory ``flopwise prepare`` wrote with its recipe 2, which
    routed documents over 4,096 tokens in pieces that could alternate between splits; then how
    many documents validation (and test) hold pieces of that began in another split -- text
    whose own document train also holds, which makes their loss read low."""
    recipe = meta.get("recipe")
    splits = meta.get("splits")
    if not isinstance(recipe, dict) or recipe.get("version") != 2 or not isinstance(splits, dict):
        return ""
    held = {s: (info or {}).get("continued_documents") for s, info in splits.items() if s in ("val", "test")}
    held = {s: n for s, n in held.items() if isinstance(n, int) and n > 0}
    if not held:
        return ""
    return (" and ".join(f"{s} holds pieces of at least {n:,} documents" for s, n in held.items())
            + " that train also holds (flopwise prepare's recipe 2 cut long documents into pieces that could "
            "alternate between splits), so held-out loss reads low; run the same flopwise prepare again with "
            "--overwrite for whole-document splits")
