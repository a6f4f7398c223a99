"""Parameters and training FLOPs per token, analytically from a ``ModelConfig``.

This module is the single source of truth: the planner, the MFU printed during
training, preflight and the report all call it. It needs no torch.

Conventions
-----------
``N_matmul`` ("matmul" in :func:`param_counts`) counts every weight that takes part in
a matrix multiply: per layer the fused q/k/v and output projections and the MLP's
matrices (three for SwiGLU, two for GELU / ReLU²; the router and the ``top_k`` active
experts for a mixture of experts), plus the LM head -- counted once, also when it is
tied to the embedding (the tied matrix is then used in one matmul and one gather; only
the matmul costs FLOPs). The embedding and learned-position lookups (gathers), the
norm weights and the biases (elementwise adds) are excluded.

``flops_per_token(cfg, T) = 6 * N_matmul + 12 * n_layers * d_attn * T`` with
``d_attn = n_heads * head_dim`` -- PaLM (Chowdhery et al. 2022) appendix B, also used by
nanoGPT, torchtitan and llm-foundry:

* 6 N_matmul: each weight does one multiply-add (2 FLOPs) per token in the forward
  pass and two in the backward pass (gradient w.r.t. the input and w.r.t. the weight).
* 12 L d_attn T: per layer and token, the forward pass computes ``q @ k^T`` and
  ``att @ v`` against all T positions, 2 * 2 * d_attn * T FLOPs, and the backward pass
  twice that. The causal mask is ignored (as in PaLM): the term counts the full T x T
  score matrix, which is also what dense attention kernels' FLOP counters report.
  For GQA the cost follows the *query* heads: every query head still attends over
  all T keys.

Elementwise work (norms, RoPE, SiLU, softmax, residual adds, the loss) is not counted.

``flops_per_token_6n(cfg) = 6 * total parameters`` is the blog-calculator convention
(embedding included, attention ignored); it is reported next to the above for
comparison, never instead of it. With activation checkpointing, hardware FLOPs add
the recomputed forward pass of each checkpointed block: see
:func:`hardware_flops_per_token`, :func:`recompute_flops_per_token` and
:func:`checkpointed_blocks` (``selective_op`` recomputes no matmul: :func:`recomputed_fraction`).
"""

from __future__ import annotations

from flopwise.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts of ``flopwise.model.Transformer(cfg)``.

    Keys: ``total`` (what the module holds; a tied head counted once), ``embedding``
    (token embedding), ``position`` (learned position table, 0 with RoPE), ``lm_head``
    (0 when tied), ``non_embedding`` (total - embedding - position - lm_head),
    ``matmul`` (N_matmul, see the module docstring: for a mixture of experts only the
    router and the ``moe_top_k`` experts a token passes through; biases excluded),
    ``active`` (parameters a token touches: total less the experts it skips), and the
    breakdown ``attention``, ``mlp`` (all experts), ``mlp_active``, ``router``, ``norm``
    (all layers together; ``norm`` includes QK-norm and the final norm), ``bias`` (of the
    linear layers, included in ``attention`` and ``mlp``).
    """
    D, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    attn_w = D * (H + 2 * KV) * hd + (H * hd) * D  # wqkv + wo
    attn_b = ((H + 2 * KV) * hd + D) if cfg.attn_bias else 0
    if cfg.is_moe:  # SwiGLU experts, no biases
        swiglu = 3 * D * cfg.expert_ffn_hidden  # w_gate_up (E x 2F x D) + w_down (E x D x F), per expert
        router = D * cfg.n_experts
        mlp_w, mlp_active_w, mlp_b = router + cfg.n_experts * swiglu, router + cfg.moe_top_k * swiglu, 0
    else:
        F = cfg.ffn_hidden
        router = 0
        mlp_w = mlp_active_w = cfg.mlp_matrices * D * F  # SwiGLU: gate, up, down; else up, down
        mlp_b = ((cfg.mlp_matrices - 1) * F + D) if cfg.mlp_bias else 0
    one_norm = D * (2 if cfg.norm == "layernorm" and cfg.norm_bias else 1)
    norm = 2 * one_norm + (2 * hd if cfg.qk_norm else 0)  # attn_norm, mlp_norm (+ q_norm, k_norm: RMSNorm)
    embedding = V * D
    position = cfg.max_seq_len * D if cfg.pos_emb == "learned" else 0
    lm_head = 0 if cfg.tie_embeddings else V * D
    norms = L * norm + one_norm  # + final norm
    attn, mlp = attn_w + attn_b, mlp_w + mlp_b
    total = embedding + position + lm_head + L * (attn + mlp) + norms
    return {
        "total": total,
        "active": total - L * (mlp_w - mlp_active_w),
        "embedding": embedding,
        "position": position,
        "lm_head": lm_head,
        "non_embedding": total - embedding - position - lm_head,
        "matmul": L * (attn_w + mlp_active_w) + V * D,  # head once, tied or not
        "attention": L * attn,
        "mlp": L * mlp,
        "mlp_active": L * (mlp_active_w + mlp_b),
        "router": L * router,
        "norm": norms,
        "bias": L * (attn_b + mlp_b),
    }


# The most parameters (and rotary-table entries, 2 x max_seq_len x head_dim floats) a model
# read from a file may have: twice the largest published models (~1e12). A config.json above
# it is a typo or a hostile file -- its float32 weights alone would need 8 TB -- and is refused
# with this number before any tensor is allocated, not met as an allocator's failure.
MAX_PARAMETERS = 2 * 10**12


def size_problems(cfg: ModelConfig) -> list[str]:
    """Why a model of ``cfg`` is too large to build (empty when it is not): more than
    :data:`MAX_PARAMETERS` parameters and rotary-table entries. ``cfg`` must have passed
    ``flopwise.config.model_problems`` (positive integer sizes)."""
    n = param_counts(cfg)["total"]
    rope = 2 * cfg.max_seq_len * cfg.resolved_head_dim if cfg.pos_emb == "rope" else 0
    if n + rope <= MAX_PARAMETERS:
        return []
    what = f"{n:.3g} parameters"
    sizes = ["model.vocab_size", "model.d_model", "model.n_layers"]
    sizes += ["model.n_experts", "model.moe_ffn_hidden"] if cfg.is_moe else ["model.ffn_hidden"]
    if rope > n:
        what += f" and {rope:.3g} rotary-table entries (2 x model.max_seq_len x head dimension)"
        sizes = ["model.max_seq_len"]
    return [f"the model would hold {what}, {4 * (n + rope) / 1e12:,.3g} TB in float32: more than the "
            f"{MAX_PARAMETERS:.0e} flopwise builds (see {', '.join(sizes)})"]


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training (fwd+bwd) FLOPs of the attention score/value matmuls: 12 * L * d_attn * T."""
    return 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM convention:
    ``6 * N_matmul + 12 * n_layers * (n_heads * head_dim) * seq_len``. Model FLOPs: no recompute."""
    return 6 * param_counts(cfg)["matmul"] + attention_flops_per_token(cfg, seq_len)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward-only FLOPs per token (evaluation, generation without KV cache):
    ``2 * N_matmul + 4 * n_layers * d_attn * seq_len`` -- a third of :func:`flops_per_token`."""
    return 2 * param_counts(cfg)["matmul"] + 4 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len


def checkpointed_blocks(n_layers: int, mode: str, every: int = 2) -> list[int]:
    """The blocks that run under activation checkpointing with ``train.activation_checkpointing``
    = ``mode``: none; ``full``: all; ``selective``: 0, k, 2k, ... (k = ``every``,
    ``train.activation_checkpointing_every``); ``selective_op``: all, each keeping its matmul and
    attention outputs (``train/wrap.py``: ``selective_op_policy``)."""
    if mode in ("full", "selective_op"):
        return list(range(n_layers))
    if mode == "selective":
        return list(range(0, n_layers, max(1, every)))
    if mode != "none":
        raise ValueError(f"activation checkpointing {mode!r}: choose none, full, selective or selective_op")
    return []


def recomputed_fraction(n_layers: int, mode: str, every: int = 2) -> float:
    """The fraction of blocks whose forward is recomputed in backward (see
    :func:`checkpointed_blocks`), the weight of :func:`recompute_flops_per_token` in HFU.
    ``selective_op``: 0 -- its blocks save every matmul's and the attention kernel's output and
    recompute only elementwise work (norms, RoPE, activation functions, casts), which the FLOPs
    convention does not count (module docstring): HFU equals MFU there."""
    if mode == "selective_op":
        return 0.0
    return len(checkpointed_blocks(n_layers, mode, every)) / n_layers if n_layers else 0.0


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """FLOPs per token of recomputing every block's forward in backward (activation
    checkpointing): each block's forward less its last projection. torch's non-reentrant
    checkpoint (what flopwise uses) stops recomputing once every tensor backward needs
    exists, and the MLP's down projection's output is needed by nothing (its input is what
    backward uses); a mixture of experts' is (the routing weights multiply it). Checked
    against ``FlopCounterMode`` in the tests."""
    counts = param_counts(cfg)
    head = cfg.vocab_size * cfg.d_model
    down = 0 if cfg.is_moe else cfg.n_layers * cfg.d_model * cfg.ffn_hidden  # w_down of each dense block
    return 2 * (counts["matmul"] - head - down) + 4 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, recomputed: float = 0.0) -> int:
    """FLOPs the hardware executes per token (the numerator of HFU): model FLOPs plus the
    recomputed forward of the checkpointed blocks (:func:`recompute_flops_per_token`).
    ``recomputed`` is the fraction of blocks that are (:func:`recomputed_fraction`; 1 or
    True = every block, 0 = none). The LM head and the embedding are never inside a
    checkpointed block: not recomputed."""
    if not 0 <= recomputed <= 1:
        raise ValueError(f"recomputed must be a fraction of the blocks in [0, 1], got {recomputed}")
    return flops_per_token(cfg, seq_len) + round(float(recomputed) * recompute_flops_per_token(cfg, seq_len))


def flops_per_token_6n(cfg: ModelConfig) -> int:
    """``6 * parameters`` (embedding included, attention ignored): the convention of
    simple calculators, reported as ``mfu_6n`` for comparison. For a mixture of experts
    the parameters a token touches (``active``), as in the 6N of MoE papers."""
    return 6 * param_counts(cfg)["active"]
