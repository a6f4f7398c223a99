"""Building blocks of a decoder-only transformer: norms, positions, attention, MLPs.

Components are picked by name in ``ModelConfig`` (``norm``, ``mlp``, ``pos_emb``,
biases, ``qk_norm``, ``attention``), covering Llama 2/3, SmolLM, Qwen3 (+MoE, in
``moe.py``) and GPT-2 with one code path each. Shapes in comments use B = batch,
T = sequence length, D = d_model, H = query heads, KV = key/value heads, hd = head
dimension, F = MLP hidden width.

Nothing here knows about losses, optimisers or distributed training: the model is
a pure function from token ids to logits, so that wrappers (compile, checkpointing,
DDP/FSDP) can be applied from the outside in a fixed order.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flopwise.config import ModelConfig
from flopwise.model.attention import attend_to_cache, attention
from flopwise.model.moe import MoE

# --------------------------------------------------------------------------- RMSNorm

_HAS_FUSED_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, no bias, no mean subtraction (Llama, Qwen3).

    The normalisation runs in float32 and is cast back before the weight multiply,
    exactly as Hugging Face's ``LlamaRMSNorm``/``Qwen3RMSNorm`` do, so that bf16 runs
    match the reference implementation and float32 parity is exact.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # no-op in float32
        if _HAS_FUSED_RMS_NORM:
            y = F.rms_norm(xf, (xf.shape[-1],), eps=self.eps)
        else:  # pragma: no cover - torch < 2.4
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """RMSNorm (Llama, Qwen3) or LayerNorm with or without bias (GPT-2: with)."""
    dim = cfg.d_model if dim is None else dim
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.norm_bias)
    return RMSNorm(dim, cfg.norm_eps)


# --------------------------------------------------------------------------- RoPE

def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings, float32, each (max_seq_len, head_dim).

    Rotate-half convention (Hugging Face Llama/Qwen): the frequencies are laid out as
    ``cat(freqs, freqs)`` and the pair for frequency i is (x[i], x[i + hd/2]), so HF
    checkpoints load without permuting the q/k projection rows (Meta's original
    checkpoints interleave pairs instead; HF's conversion script already permuted them).
    Always computed in float32: bf16 angles lose precision at long positions.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))  # (hd/2,)
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)  # (T_max,)
    freqs = torch.outer(pos, inv_freq)  # (T_max, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T_max, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, n, hd) by position; cos/sin are (T, hd) slices of the tables."""
    # Cast the tables to the activation dtype, as HF does, so bf16 stays bf16.
    cos = cos[None, :, None, :].to(x.dtype)  # (1, T, 1, hd)
    sin = sin[None, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- attention

class Attention(nn.Module):
    """Grouped-query self-attention, optional RoPE, per-head QK-norm (Qwen3) and biases (GPT-2).

    One fused ``wqkv`` projection (one GEMM instead of three); its rows are
    [q (H*hd) | k (KV*hd) | v (KV*hd)], which is how ``hf.py`` splits and joins them.
    The kernel is chosen by name (``backend``, see :mod:`flopwise.model.attention`); the
    model sets it on every layer.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.resolved_head_dim  # may differ from d_model // n_heads (Qwen3)
        q_dim = self.n_heads * self.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.wqkv = nn.Linear(cfg.d_model, q_dim + 2 * kv_dim, bias=cfg.attn_bias)
        self.wo = nn.Linear(q_dim, cfg.d_model, bias=cfg.attn_bias)
        if cfg.qk_norm:
            # One weight of size hd shared by all heads, as in Qwen3.
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, cfg.norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        self.backend = "sdpa"

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                doc_ids: torch.Tensor | None = None, cache: "LayerCache | None" = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)  # (B, T, (H + 2*KV) * hd)
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        q = q.view(B, T, H, hd)  # (B, T, H, hd)
        k = k.view(B, T, KV, hd)  # (B, T, KV, hd)
        v = v.view(B, T, KV, hd)  # (B, T, KV, hd)
        if self.q_norm is not None and self.k_norm is not None:  # set together
            # Qwen3 normalises each head's q and k BEFORE the rotation: it bounds the
            # attention logits, which keeps bf16/large-lr training stable.
            # Back to v's dtype: the norm's fp32 weight promotes its output to fp32 under
            # autocast, and SDPA on CUDA takes fp32 GQA to the math kernel, (B, H, T, T) scores
            # stored (found by the dry run's trace: tests/integration/test_dryrun.py).
            q = self.q_norm(q).to(v.dtype)
            k = self.k_norm(k).to(v.dtype)
        if rope is not None:
            cos, sin = rope
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if cache is not None:  # incremental decoding: attend to everything cached so far
            k, v = cache.append(k, v)  # (B, T_cached + T, KV, hd)
        # The kernels want heads before time.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, hd)
        if cache is not None and k.shape[2] > T:
            y = attend_to_cache(q, k, v)  # (B, H, T, hd)
        else:
            y = attention(q, k, v, self.backend, doc_ids)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H*hd)
        return self.wo(y)  # (B, T, D)


class LayerCache:
    """One layer's keys and values for incremental decoding, preallocated: (B, max_len, KV, hd)."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype, device):
        self.k = torch.empty(batch, max_len, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, T, KV, hd) after what is cached; return all of it (B, length, KV, hd)."""
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:
            raise ValueError(f"KV cache full: {end} positions > its {self.k.shape[1]}")
        self.k[:, self.length : end] = k
        self.v[:, self.length : end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


# --------------------------------------------------------------------------- MLP

class SwiGLU(nn.Module):
    """out = w_down(silu(gate) * up), with gate and up from one fused projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ffn_hidden = cfg.ffn_hidden
        # Rows are [gate (F) | up (F)]: one GEMM instead of two.
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # each (B, T, F)
        return self.w_down(F.silu(gate) * up)  # (B, T, D)


class MLP(nn.Module):
    """out = w_down(act(w_up(x))): GELU with the tanh approximation (GPT-2's ``gelu_new``)
    or squared ReLU (Primer; modded-nanogpt), two matrices instead of SwiGLU's three."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = cfg.mlp
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_up(x)  # (B, T, F)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu" else F.relu(h).square()
        return self.w_down(h)  # (B, T, D)


def make_mlp(cfg: ModelConfig) -> nn.Module:
    """The block's feed-forward: a mixture of SwiGLU experts, SwiGLU, or a two-matrix MLP."""
    if cfg.is_moe:
        return MoE(cfg.d_model, cfg.n_experts, cfg.moe_top_k, cfg.expert_ffn_hidden, cfg.moe_norm_topk_prob)
    return SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)
