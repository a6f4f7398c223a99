"""A decoder-only transformer (Llama 2/3, SmolLM, Qwen3, Qwen3-MoE, GPT-2), readable top to bottom.

    idx (B, T) -> tok_emb (+ pos_emb) -> n_layers x Block -> norm -> head -> logits (B, T, V)
    Block:  x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))     (pre-norm)

Components come from the config (see ``layers.py``). The model holds no loss and no
distributed code: ``forward_hidden`` and ``head_weight`` exist so that a chunked
cross-entropy elsewhere can avoid materialising the (B, T, V) logits, and a
mixture-of-experts model leaves its weighted auxiliary losses of the last forward in
``aux_loss`` for the training step to add.

Build with :func:`build_model`: the module is created on the meta device (no memory, no
wasted random init), moved to the target device with ``to_empty`` and then initialised
once by :func:`init_weights` from a seeded generator.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from flopwise.config import ModelConfig
from flopwise.model.attention import DocSpans, doc_spans, select_backend
from flopwise.model.layers import Attention, LayerCache, make_mlp, make_norm, rope_tables
from flopwise.model.moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                doc_ids: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, doc_ids, cache)  # (B, T, D)
        x = x + self.mlp(self.mlp_norm(x))  # (B, T, D)
        return x


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # buffers (register_buffer in __init__)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Learned absolute positions (GPT-2); RoPE rotates q and k inside attention instead.
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        # Tied: the head reuses tok_emb.weight (see head_weight), so there is exactly one
        # parameter and no tie that a meta->device move or a wrapper could silently break.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # RoPE tables: derived state, not saved in checkpoints (persistent=False) and
        # recomputed by init_weights after to_empty (a meta buffer holds no values).
        cos, sin = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len if cfg.pos_emb == "rope" else 0, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd) float32; empty without RoPE
        self.register_buffer("rope_sin", sin, persistent=False)
        self.aux_loss: torch.Tensor | None = None  # MoE: weighted load-balance + z-loss of the last forward
        self.attention_backend = "sdpa"
        # flash with documents: T bounds a document's length instead of the longest one's exact
        # length (a Python int that changes every batch), so compiled blocks do not recompile
        # for each; set by train/wrap.py when it compiles the blocks.
        self.doc_length_bound = False

    def set_attention_backend(self, name: str) -> None:
        """Use kernel ``name`` (a concrete backend, see ``flopwise.model.attention``) in every layer."""
        self.attention_backend = name
        for block in self.layers:
            cast(Block, block).attn.backend = name  # (a ModuleList's items are typed Module)

    @property
    def head_weight(self) -> torch.Tensor:
        """The (V, D) output projection: the embedding matrix when tied."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, batch: int, max_len: int | None = None) -> list[LayerCache]:
        """Empty per-layer key/value caches for incremental decoding (see ``forward``'s ``cache``)."""
        cfg, w = self.cfg, self.tok_emb.weight
        n = max_len or cfg.max_seq_len
        return [LayerCache(batch, n, cfg.n_kv_heads, cfg.resolved_head_dim, w.dtype, w.device) for _ in self.layers]

    def forward_hidden(self, idx: torch.Tensor, doc_ids: torch.Tensor | DocSpans | None = None,
                       cache: list[LayerCache] | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> final-normed hidden states (B, T, D).

        ``doc_ids`` (B, T), when given, restricts attention to each token's own document
        (positions still count from the start of the window, as in packed pretraining).
        ``cache`` (from :meth:`new_cache`): ``idx`` continues the cached tokens -- its
        positions start where the cache ends, and its keys and values are appended.
        """
        B, T = idx.shape
        cfg = self.cfg
        start = cache[0].length if cache else 0
        if start + T > cfg.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds model.max_seq_len {cfg.max_seq_len}")
        rope = ((self.rope_cos[start : start + T], self.rope_sin[start : start + T])
                if cfg.pos_emb == "rope" else None)  # each (T, hd)
        x = self.tok_emb(idx)  # (B, T, D)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[start : start + T]  # (T, D) broadcast over the batch
        if isinstance(doc_ids, torch.Tensor) and self.attention_backend == "flash":
            doc_ids = doc_spans(doc_ids, T if self.doc_length_bound else None)  # once, for every layer
        for i, block in enumerate(self.layers):
            x = block(x, rope, doc_ids, cache[i] if cache else None)
        if cfg.is_moe:
            aux = [cast(MoE, block.mlp).aux for block in self.layers]  # every block's mlp is a MoE
            # (sum() of tensors is typed Tensor | int: n_layers >= 1 makes it a tensor)
            self.aux_loss = (cfg.moe_aux_loss_coef * sum(a["load_balance"] for a in aux)  # type: ignore[assignment]
                             + cfg.moe_z_loss_coef * sum(a["z"] for a in aux)) / cfg.n_layers
        return self.norm(x)  # (B, T, D)

    def forward(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None,
                cache: list[LayerCache] | None = None, return_hidden: bool = False) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V); with ``return_hidden``, the final-normed hidden
        states (B, T, D) instead, for a loss that applies the head itself (chunked, fused).
        That goes through ``forward`` rather than :meth:`forward_hidden` so a DDP or FSDP
        wrapper's hooks (gradient sync, parameter gathering) see the call."""
        hidden = self.forward_hidden(idx, doc_ids, cache)
        return hidden if return_hidden else F.linear(hidden, self.head_weight)

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
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the RoPE tables in float32 on the buffers' device."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len if cfg.pos_emb == "rope" else 0,
                               cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos = cos
        self.rope_sin = sin


@torch.no_grad()
def init_weights(model: Transformer, cfg: ModelConfig, seed: int = 1337) -> Transformer:
    """The one place weights get their initial values; deterministic given ``seed``.

    - embedding, learned positions, q/k/v, gate/up (up), router, experts' gate/up and an
      untied head: N(0, init_std)
    - output projections of each residual branch (wo, w_down, experts' w_down):
      N(0, init_std / sqrt(2 n_layers)), GPT-2's scaling: 2 residual additions per layer,
      so the residual stream's variance stays O(1) at init independently of depth
    - norm weights: 1; biases (linear layers, LayerNorm): 0; RoPE tables recomputed
      (after to_empty they hold garbage)

    Parameters are visited in ``named_parameters`` order with one generator on the
    model's device, so the same seed gives identical weights on that device type.
    """
    device = model.tok_emb.weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif name.endswith("norm.weight"):  # attn_norm, mlp_norm, q_norm, k_norm, final norm
            p.fill_(1.0)
        elif name.endswith(("attn.wo.weight", "mlp.w_down.weight", "mlp.w_down")):
            p.normal_(0.0, out_std, generator=gen)
        else:  # tok_emb, pos_emb, wqkv, w_gate_up / w_up, router, lm_head
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
    init_weights(model, cfg, seed)
    configure_attention(model, torch.device(device), torch.float32)
    return model


def configure_attention(model: Transformer, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Resolve ``model.attention`` for the device and compute dtype, set it on every layer,
    and return the notes to show the user (what was chosen, what was skipped and why).
    Raises ``AttentionBackendError`` for an unavailable backend under ``attention_strict``."""
    cfg = model.cfg
    name, notes = select_backend(cfg.attention, device, dtype, doc_mask=cfg.doc_mask, strict=cfg.attention_strict)
    model.set_attention_backend(name)
    return notes
