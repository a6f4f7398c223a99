"""Byte-level BPE tokenizers, trained and loaded with Hugging Face ``tokenizers``.

Byte-level (GPT-2 style): text is split by the GPT-2 regex into words, each word is
mapped to its UTF-8 bytes, and BPE merges are learned over those bytes.  The initial
alphabet holds all 256 bytes, so any text encodes and ``decode(encode(s)) == s``.
One special token, ``<|endoftext|>``, separates documents (it is the EOS id).

:func:`encode_documents` frames every document the same way whatever the tokenizer (BOS
where it has one, EOS after); ``flopwise prepare`` and the embedded corpus both call it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..fsio import FileFormatError

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # 256 byte tokens + EOS


def new_byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE tokenizer (pre-tokenizer and decoder set)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens on ``texts``.

    Deterministic for the same input (the BPE trainer breaks count ties by pair order).
    The result may be smaller than ``vocab_size`` when the text has too few distinct
    pairs; use ``tok.get_vocab_size()`` for the real size.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte tokens + {EOS_TOKEN}), got {vocab_size}"
        )
    tok = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


MAX_PARSER_MESSAGE = 200  # characters of the tokenizers parser's message kept in an error


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a ``tokenizer.json`` -- every tokenizer file flopwise reads goes through here.
    Raises FileNotFoundError naming the file, or :class:`~flopwise.fsio.FileFormatError` (a
    ``ValueError``) naming it with the first line of the parser's message, shortened."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer file does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        if len(first) > MAX_PARSER_MESSAGE:
            first = f"{first[:MAX_PARSER_MESSAGE]}... ({len(first):,} characters)"
        raise FileFormatError(path, f"cannot load tokenizer: {first}") from None


def eos_id(tok: Tokenizer) -> int:
    """Id of ``<|endoftext|>``; ValueError if the tokenizer lacks it."""
    i = tok.token_to_id(EOS_TOKEN)
    if i is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN} token (needed as the end-of-document id)")
    return int(i)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# End-of-text and begin-of-text tokens of common tokenizers, most specific first:
# GPT-2/SmolLM/Qwen "<|endoftext|>", Llama 3 "<|end_of_text|>"/"<|begin_of_text|>",
# Llama 2/Mistral "</s>"/"<s>", Gemma "<eos>"/"<bos>".
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")


def special_ids(tok: Tokenizer) -> dict:
    """``{"eos_id", "bos_id", "eos_candidates"}`` of a tokenizer; ids are None when absent.

    EOS ends every document; BOS, where the tokenizer defines a distinct one, starts it.
    """
    # Only *special* added tokens count: a learned merge may spell "<s>" as ordinary text.
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def first(candidates):
        for token in candidates:
            if token in specials:
                return int(specials[token])
        return None

    eos = first(EOS_CANDIDATES)
    bos = first(BOS_CANDIDATES)
    return {"eos_id": eos, "bos_id": bos if bos != eos else None, "eos_candidates": EOS_CANDIDATES}


def encode_documents(tok: Tokenizer, texts: list[str], bos: int | None, eos: int,
                     dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
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
