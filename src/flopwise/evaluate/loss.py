"""Validation loss on a fixed held-out subset, as nats per token, perplexity and bits per byte.

Bits per byte (``loss * tokens / (bytes * ln 2)``) is the number to compare across
tokenizers: a larger vocabulary lowers the loss per token without modelling text better.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flopwise.data.loader import document_ids
from flopwise.model.loss import loss_sum


@dataclass(frozen=True)
class Shard:
    """This rank's share of an evaluation under data parallelism: rank ``rank`` of ``world``,
    and ``reduce``, which sums a list of floats element-wise over the ranks and gives every rank
    the sums."""

    rank: int = 0
    world: int = 1
    reduce: Callable[[list[float]], list[float]] | None = None


UNSHARDED = Shard()  # one process evaluates everything


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    windows: torch.Tensor,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    doc_eos: int | None = None,
    doc_bos: int | None = None,
    shard: Shard = UNSHARDED,
) -> float:
    """Mean token loss over ``windows`` (N, seq_len + 1), evaluated ``batch_size`` at a time.

    A model trained with ``doc_mask`` is evaluated with the same per-document attention
    when ``doc_eos`` (and ``doc_bos``, if the tokenizer has one) say where documents end.

    Under data parallelism (``shard``) each rank evaluates a contiguous ~1/world of the
    windows and ``shard.reduce`` sums (loss, tokens) over ranks, so every rank returns the
    same mean as one process would. All ranks run the same number of forwards (a rank with
    fewer windows repeats one and does not count it): FSDP2 gathers weights collectively
    inside every forward."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    cfg = getattr(model, "cfg", None)
    rank, world = shard.rank, shard.world
    per_rank = -(-windows.size(0) // world)
    mine = windows[rank * per_rank : (rank + 1) * per_rank]
    for i in range(0, per_rank, batch_size):
        w = mine[i : i + batch_size]
        counted = w.size(0) > 0
        w = (w if counted else windows[:1]).to(device, non_blocking=True)
        x, y = w[:, :-1], w[:, 1:]
        with autocast():
            if doc_eos is not None and cfg is not None and cfg.doc_mask:  # as in training
                logits = model(x, document_ids(x, doc_eos, doc_bos))
            else:
                logits = model(x)
        if counted:
            total += loss_sum(logits, y)
            count += y.numel()
    model.train(was_training)
    values = [float(total), float(count)]
    if shard.reduce is not None:
        values = shard.reduce(values)
    return values[0] / max(values[1], 1)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def target_bytes(windows: torch.Tensor, tokenizer) -> int:
    """UTF-8 bytes of the text the windows' targets (all but each window's first token) spell."""
    texts = tokenizer.decode_batch(windows[:, 1:].tolist(), skip_special_tokens=False)
    return sum(len(t.encode("utf-8")) for t in texts)


def bits_per_byte(loss: float, n_tokens: int, n_bytes: int) -> float:
    """Nats per token -> bits per byte of the underlying text."""
    return loss * n_tokens / (max(n_bytes, 1) * math.log(2))
