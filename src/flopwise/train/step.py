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
from typing import cast

import torch

from flopwise.model.attention import doc_spans
from flopwise.model.loss import loss_sum
from flopwise.train.losses import linear_cross_entropy


def make_loss_fn(model: torch.nn.Module, impl: str = "plain", chunk_tokens: int = 4096,
                 compile_mode: str | None = None) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """``fn(x, y, doc_ids) -> (sum of token losses, weighted aux loss or None)`` for ``model``.

    ``impl``: ``plain`` -- logits (B, T, V) then float32 cross-entropy; ``chunked`` -- the LM
    head and the loss over chunks of ``chunk_tokens`` rows, never holding the whole logits
    (``train/losses.py``); ``fused`` -- a fused linear+CE kernel where one is installed.
    ``compile_mode`` (not None) compiles the whole function: forward, head and loss in one
    graph -- except the fused kernel, which dynamo cannot trace (a Triton launch and host
    reads inside Liger): then the model's forward is compiled as one graph and the kernel
    runs after it, outside, instead of breaking the graph in the middle of the step.
    """
    inner = getattr(model, "module", model)  # DDP holds the model in .module; FSDP2 shards it in place
    moe = bool(getattr(getattr(inner, "cfg", None), "is_moe", False))

    def loss_fn(x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None):
        if impl == "plain":
            s = loss_sum(model(x, doc_ids) if doc_ids is not None else model(x), y)
        else:
            # Through the (wrapped) model's forward, so DDP/FSDP hooks run; the head weight is
            # read after it, when FSDP has gathered the root's parameters.
            hidden = model(x, doc_ids, return_hidden=True)  # (B, T, D)
            # The backward follows at once, so computing the gradients during the forward costs
            # no extra peak memory and saves recomputing the logits (docs/benchmarks.md#chunked-cross-entropy).
            head = cast(torch.Tensor, inner.head_weight)  # a flopwise Transformer's property
            s = linear_cross_entropy(hidden.flatten(0, 1), head, y.reshape(-1), impl=impl,
                                     chunk_tokens=chunk_tokens, grads_in_forward=torch.is_grad_enabled())
        return s, (inner.aux_loss if moe else None)

    if compile_mode is None:
        return loss_fn
    mode = None if compile_mode == "default" else compile_mode  # None: torch.compile's default
    flash_docs = getattr(inner, "attention_backend", None) == "flash"

    def docs(x: torch.Tensor, doc_ids: torch.Tensor | None):
        # flash's documents are cut here, before the graph (attention.doc_spans): no break, no
        # host read per layer, and T bounds a document so the graph is the same for every batch
        return doc_spans(doc_ids, bound=x.shape[1]) if flash_docs and doc_ids is not None else doc_ids

    if impl != "fused":
        compiled = torch.compile(loss_fn, mode=mode)
        return lambda x, y, doc_ids=None: compiled(x, y, docs(x, doc_ids))
    forward = torch.compile(lambda x, doc_ids: model(x, doc_ids, return_hidden=True), mode=mode)

    def fused_after_compiled_forward(x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None):
        hidden = forward(x, docs(x, doc_ids))
        head = cast(torch.Tensor, inner.head_weight)  # a flopwise Transformer's property
        s = linear_cross_entropy(hidden.flatten(0, 1), head, y.reshape(-1), impl=impl)
        return s, (inner.aux_loss if moe else None)

    return fused_after_compiled_forward


def forward_backward(
    model: torch.nn.Module,
    micro_batches: Iterable[tuple[torch.Tensor, ...]],
    step_tokens: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    scaler: "torch.amp.GradScaler | None" = None,
    sync: Callable[[int], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Accumulate gradients over ``micro_batches``; return the step's mean loss (detached).

    ``step_tokens`` is the number of target tokens in the whole step, known in advance
    from the batch geometry, so each backward can be issued as soon as its micro-batch
    is done without holding activations for the others. A micro-batch is ``(x, y)`` or
    ``(x, y, doc_ids)``. The returned loss is the language-model loss only (a model's
    aux loss -- MoE load balance -- is trained on, not reported in it). ``loss_fn`` is
    :func:`make_loss_fn`'s (default: the plain one); ``scaler`` scales fp16 losses.
    ``sync(i)`` is the context micro-batch ``i`` runs in: under data parallelism it holds
    back the gradient all-reduce until the last micro-batch of the step (``train/parallel.py``).
    Under data parallelism ``step_tokens`` is this rank's share: DDP and FSDP average the
    ranks' gradients, which turns the ranks' ``sum / local tokens`` into the global mean.
    """
    loss_fn = loss_fn or make_loss_fn(model)
    total = None
    for i, batch in enumerate(micro_batches):
        x, y = batch[0], batch[1]
        doc_ids = batch[2] if len(batch) > 2 else None  # per-document attention (model.doc_mask)
        with sync(i) if sync is not None else contextlib.nullcontext():
            with autocast():
                s, aux = loss_fn(x, y, doc_ids)
            loss = s / step_tokens
            if aux is not None:
                # MoE: the weighted load-balance (+ z) loss of this micro-batch. Its weight is per
                # micro-batch, so each adds aux * its share of the step's tokens.
                loss = loss + aux * (y.numel() / step_tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = s.detach() if total is None else total + s.detach()
    assert total is not None, "a step needs at least one micro-batch"
    return total / step_tokens
