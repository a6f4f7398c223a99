"""One optimizer step's forward and backward passes, with gradient accumulation.

The loss is a mean over *all tokens of the global batch*: each micro-batch contributes
``sum of token losses / tokens in the whole step``. With equal-length windows this is the
same as dividing each micro-batch mean by the number of micro-batches, but it stays
right when micro-batches carry different numbers of target tokens (masking, packing),
where averaging micro-batch means would over-weight the short ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token cross-entropies, computed in float32 (logits may be bf16 under autocast)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
        reduction="sum", ignore_index=ignore_index,
    )


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Iterable[tuple[torch.Tensor, ...]],
    step_tokens: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """Accumulate gradients over ``micro_batches``; return the step's mean loss (detached).

    ``step_tokens`` is the number of target tokens in the whole step, known in advance
    from the batch geometry, so each backward can be issued as soon as its micro-batch
    is done without holding activations for the others. A micro-batch is ``(x, y)`` or
    ``(x, y, doc_ids)``. The returned loss is the language-model loss only (a model's
    ``aux_loss`` is trained on, not reported in it).
    """
    total = None
    for batch in micro_batches:
        x, y = batch[0], batch[1]
        doc_ids = batch[2] if len(batch) > 2 else None  # per-document attention (model.doc_mask)
        with autocast():
            logits = model(x) if doc_ids is None else model(x, doc_ids)
        s = loss_sum(logits, y)
        loss = s / step_tokens
        aux = getattr(model, "aux_loss", None)
        if aux is not None:
            # MoE: the weighted load-balance (+ z) loss of this micro-batch. Its weight is per
            # micro-batch, so each adds aux * its share of the step's tokens.
            loss = loss + aux * (y.numel() / step_tokens)
        loss.backward()
        total = s.detach() if total is None else total + s.detach()
    assert total is not None, "a step needs at least one micro-batch"
    return total / step_tokens
