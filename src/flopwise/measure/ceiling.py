"""A measured ceiling: what this device does on this model's own matrix multiplies.

The datasheet peak is what a device could do on ideal shapes; MFU against it mixes two
losses -- matmuls that run below peak on these shapes, and time spent outside matmuls. The
ceiling separates them: every weight GEMM of one training step (:func:`step_gemms`: the
fused q/k/v and output projections, the MLP, the router and the active experts' share of
the tokens, the LM head; each in its forward, input-gradient and weight-gradient
orientation) is timed on its own at the step's token count, and the ceiling is their FLOPs
over their summed time: the FLOP/s a step made of nothing but these matmuls would reach.
``MFU x peak / ceiling`` is then the share of that ceiling a run reached: what is left to
win outside the matmuls. Attention's score/value products (FlashAttention kernels, not
plain GEMMs) and elementwise work are not in it. Seconds, not minutes: each distinct shape
runs until ``min_seconds`` of timed work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from flopwise.config import ModelConfig


@dataclass(frozen=True)
class Gemm:
    """``(M, K) @ (K, N)``, ``count`` times per training step."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


def _linear(name: str, tokens: int, d_in: int, d_out: int, count: int) -> list[Gemm]:
    """A linear layer's three GEMMs in training: forward, gradient of the input, of the weight."""
    return [Gemm(f"{name} fwd", tokens, d_out, d_in, count),
            Gemm(f"{name} dX", tokens, d_in, d_out, count),
            Gemm(f"{name} dW", d_out, d_in, tokens, count)]


def step_gemms(cfg: ModelConfig, tokens: int) -> list[Gemm]:
    """The weight GEMMs of one training step over ``tokens`` tokens (micro-batch x sequence).

    Their FLOPs sum to ``6 x N_matmul x tokens`` (``plan/flops.py``): the same matmuls MFU
    counts, less attention's score/value products. Experts: each of the ``n_experts`` sees
    ``tokens x top_k / n_experts`` tokens on average (balanced routing)."""
    D, H, KV, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    L = cfg.n_layers
    out = _linear("qkv", tokens, D, (H + 2 * KV) * hd, L) + _linear("attn out", tokens, H * hd, D, L)
    if cfg.is_moe:
        per_expert = max(1, round(tokens * cfg.moe_top_k / cfg.n_experts))
        F, E = cfg.expert_ffn_hidden, cfg.n_experts
        out += _linear("router", tokens, D, E, L)
        out += _linear("expert gate+up", per_expert, D, 2 * F, L * E) + _linear("expert down", per_expert, F, D, L * E)
    elif cfg.mlp == "swiglu":
        out += (_linear("mlp gate+up", tokens, D, 2 * cfg.ffn_hidden, L)
                + _linear("mlp down", tokens, cfg.ffn_hidden, D, L))
    else:
        out += _linear("mlp up", tokens, D, cfg.ffn_hidden, L) + _linear("mlp down", tokens, cfg.ffn_hidden, D, L)
    return out + _linear("lm head", tokens, D, cfg.vocab_size, 1)


@dataclass
class Ceiling:
    flops_per_s: float  # the step's GEMM FLOPs over their summed time
    seconds_per_step: float  # the time of one step's GEMMs at the measured rates
    shapes: list[dict]  # per GEMM: name, M, N, K, count, TFLOP/s
    dtype: str


def measure_ceiling(gemms: list[Gemm], device: torch.device, dtype: torch.dtype, min_seconds: float = 0.05,
                    clock: Callable[[], float] = time.perf_counter) -> Ceiling:
    """Time each distinct GEMM shape of ``gemms`` on ``device`` in ``dtype`` (after one warm-up
    call) until ``min_seconds`` of timed work; combine them weighted by their counts."""
    rates: dict[tuple[int, int, int], float] = {}
    cuda = device.type == "cuda"
    for g in gemms:
        key = (g.m, g.n, g.k)
        if key in rates:
            continue
        a = torch.randn(g.m, g.k, device=device, dtype=dtype)
        b = torch.randn(g.k, g.n, device=device, dtype=dtype)
        torch.matmul(a, b)  # warm-up: kernel selection, allocation
        reps, elapsed = 0, 0.0
        while elapsed < min_seconds:
            n = max(1, reps)  # doubling batches of calls: few clock reads for fast shapes
            if cuda:
                torch.cuda.synchronize(device)
            t0 = clock()
            for _ in range(n):
                torch.matmul(a, b)
            if cuda:
                torch.cuda.synchronize(device)
            elapsed += clock() - t0
            reps += n
        rates[key] = 2 * g.m * g.n * g.k * reps / elapsed
        del a, b
    total_flops = sum(g.flops for g in gemms)
    seconds = sum(g.flops / rates[(g.m, g.n, g.k)] for g in gemms)
    shapes = [{"name": g.name, "m": g.m, "n": g.n, "k": g.k, "count": g.count,
               "tflops": rates[(g.m, g.n, g.k)] / 1e12} for g in gemms]
    return Ceiling(total_flops / seconds, seconds, shapes, str(dtype).removeprefix("torch."))
