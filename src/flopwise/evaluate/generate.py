"""Sampling text from a model: temperature and top-k.

This is the plain recompute-everything loop (each new token runs the whole context);
fine for the short samples written at the end of training.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 0.8,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by up to ``max_new_tokens``; temperature 0 is greedy."""
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        context = idx[:, -max_seq_len:]
        logits = model(context)[:, -1, :].float()  # (B, vocab)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
        if eos_id is not None and bool((nxt == eos_id).all()):
            break
    model.train(was_training)
    return idx
