"""A decoder-only Llama-family transformer (Llama 2/3, SmolLM, Qwen3), readable top to bottom.

    idx (B, T) -> tok_emb -> n_layers x Block -> norm -> head -> logits (B, T, V)
    Block:  x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))     (pre-norm)

No biases anywhere. The model holds no loss and no distributed code: ``forward_hidden``
and ``head_weight`` exist so that a chunked cross-entropy elsewhere can avoid
materialising the (B, T, V) logits.

Build with :func:`build_model`: the module is created on the meta device (no memory, no
wasted random init), moved to the target device with ``to_empty`` and then initialised
once by :func:`init_weights` from a seeded generator.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from flopwise.config import ModelConfig
from flopwise.model.layers import Attention, RMSNorm, SwiGLU, rope_tables


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, D)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, D)
        return x


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.is_moe:  # counted by the planner; the layer itself is not built yet
            raise ValueError(f"model.n_experts={cfg.n_experts}: mixture-of-experts layers are not implemented yet")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Tied: the head reuses tok_emb.weight (see head_weight), so there is exactly one
        # parameter and no tie that a meta->device move or a wrapper could silently break.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # RoPE tables: derived state, not saved in checkpoints (persistent=False) and
        # recomputed by init_weights after to_empty (a meta buffer holds no values).
        cos, sin = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd) float32
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def head_weight(self) -> torch.Tensor:
        """The (V, D) output projection: the embedding matrix when tied."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def forward_hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> final-normed hidden states (B, T, D)."""
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd)
        x = self.tok_emb(idx)  # (B, T, D)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.norm(x)  # (B, T, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V)."""
        return F.linear(self.forward_hidden(idx), self.head_weight)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters held by the module (a tied head counted once).

        ``non_embedding=True`` leaves out the token embedding and an untied head, the
        usual "non-embedding parameters" of scaling-law papers.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.lm_head is not None:
                n -= self.lm_head.weight.numel()
        return n

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables in float32 on the buffers' device."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos = cos
        self.rope_sin = sin


@torch.no_grad()
def init_weights(model: Transformer, cfg: ModelConfig, seed: int = 1337) -> Transformer:
    """The one place weights get their initial values; deterministic given ``seed``.

    - embedding, q/k/v, gate/up and an untied head: N(0, init_std)
    - output projections of each residual branch (wo, w_down): N(0, init_std / sqrt(2 n_layers)),
      GPT-2's scaling: 2 residual additions per layer, so the residual stream's variance
      stays O(1) at init independently of depth
    - norms: 1; RoPE tables recomputed (after to_empty they hold garbage)

    Parameters are visited in ``named_parameters`` order with one generator on the
    model's device, so the same seed gives identical weights on that device type.
    """
    device = model.tok_emb.weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # attn_norm, mlp_norm, q_norm, k_norm, final norm
            p.fill_(1.0)
        elif name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
            p.normal_(0.0, out_std, generator=gen)
        else:  # tok_emb, wqkv, w_gate_up, lm_head
            p.normal_(0.0, std, generator=gen)
    model.reset_rope()
    return model


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 1337) -> Transformer:
    """Construct on the meta device, materialise on ``device``, initialise once.

    ``device="meta"`` returns a shape-only model (for counting parameters of a 2B model
    without allocating it).
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    return init_weights(model, cfg, seed)
