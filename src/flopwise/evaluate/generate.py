"""Sampling text from a model: temperature, top-k, top-p, a seed, and a key/value cache.

With the cache (the default for flopwise models) the prompt is run once and each new
token costs one position of compute; without it (``use_cache=False``, or a model that
has no ``new_cache``) every step re-runs the whole context, the simple reference the
tests compare the cached path against. Once the context fills ``max_seq_len``, the
cached path hands over to the window-sliding recompute loop.

The attention kernel training chose need not run here: training picks it for its compute
dtype (flash-attn under bf16 autocast), while sampling at the end of a run runs the fp32
weights without autocast, which flash-attn refuses. :func:`generate` therefore re-checks
the model's backend for the dtype it will actually compute in (the active autocast dtype,
else the parameters' dtype) and, for the duration of the call only, falls back to one
that runs there (``select_backend``'s choice, SDPA for fp32); the model's own setting is
restored afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from flopwise.model import attention as _attention


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1
    keep every candidate; ``generator`` seeds the draws (a CPU one serves a model on any device)."""

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None


def _pick(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Next token ids (B, 1) from float32 logits (B, V)."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)  # greedy
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < s.top_p < 1:
        # Keep the smallest set of tokens whose probability reaches top_p (the top one always).
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= s.top_p  # mass before this token already enough
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    generator = s.generator
    if probs.device.type != "cpu" and generator is not None and generator.device.type == "cpu":
        return torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)


def compute_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the model's matmuls run in here: the autocast dtype when autocast is on for
    ``device``'s type, else the dtype of its first floating-point parameter (fp32 without any)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


@contextlib.contextmanager
def attention_for_inference(model: torch.nn.Module, device: torch.device) -> Iterator[list[str]]:
    """Within the block, every flopwise transformer in ``model`` (wrappers included) uses an
    attention backend that runs on ``device`` in the dtype computed there; yields the notes
    of any fallback (empty when the configured backend runs as it is). Restored on exit."""
    dtype = compute_dtype(model, device)
    changed: list[tuple[torch.nn.Module, str]] = []
    notes: list[str] = []
    try:
        for m in model.modules():
            current = getattr(m, "attention_backend", None)
            if current is None or not hasattr(m, "set_attention_backend"):
                continue
            if current in _attention.CONCRETE_BACKENDS and \
                    _attention.available_backends(device, dtype).get(current) is None:
                continue
            name, why = _attention.select_backend(current, device, dtype, doc_mask=False, strict=False)
            if name != current:
                changed.append((m, current))
                m.set_attention_backend(name)  # type: ignore[operator]  # duck-typed: hasattr above
                notes += why
        yield notes
    finally:
        for m, previous in reversed(changed):
            m.set_attention_backend(previous)  # type: ignore[operator]  # duck-typed, as above


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    max_seq_len: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by up to ``max_new_tokens``, each drawn as ``sampling`` says. Stops
    early when every row has produced ``eos_id``. Runs whatever attention backend the model was
    configured with: one that cannot compute in this dtype here (flash-attn on fp32 weights
    without autocast) is swapped for the call (:func:`attention_for_inference`)."""
    was_training = model.training
    model.eval()
    try:
        with attention_for_inference(model, idx.device):
            return _generate(model, idx, max_new_tokens, max_seq_len, sampling, eos_id, use_cache)
    finally:
        model.train(was_training)


def _generate(model: torch.nn.Module, idx: torch.Tensor, max_new_tokens: int, max_seq_len: int, sampling: Sampling,
              eos_id: int | None, use_cache: bool) -> torch.Tensor:
    cache = None
    if use_cache and hasattr(model, "new_cache") and idx.shape[1] < max_seq_len:
        cache = model.new_cache(idx.shape[0], max_seq_len)  # type: ignore[operator]  # duck-typed: hasattr above
        logits = model(idx, cache=cache)[:, -1, :].float()  # the prompt, once
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(idx[:, -max_seq_len:])[:, -1, :].float()  # (B, V)
        nxt = _pick(logits, sampling)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
        if eos_id is not None:
            done |= nxt[:, 0] == eos_id
            if bool(done.all()):
                break
        if cache is not None:
            if cache[0].length >= max_seq_len:  # full: slide the window by recomputing from here on
                cache = None
            else:
                logits = model(nxt, cache=cache)[:, -1, :].float()
    return idx
