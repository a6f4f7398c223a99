"""Weight and config mapping between flopwise and Hugging Face ``transformers``.

Our layout fuses two pairs of projections that HF keeps separate:

    ours                                   HF (LlamaForCausalLM / Qwen3ForCausalLM)
    tok_emb.weight                         model.embed_tokens.weight
    layers.{i}.attn_norm.weight            model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.wqkv.weight  rows      model.layers.{i}.self_attn.{q,k,v}_proj.weight
        [q: H*hd | k: KV*hd | v: KV*hd]
    layers.{i}.attn.wo.weight              model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.attn.{q,k}_norm.weight      model.layers.{i}.self_attn.{q,k}_norm.weight  (qwen3)
    layers.{i}.mlp_norm.weight             model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.w_gate_up.weight rows   model.layers.{i}.mlp.{gate,up}_proj.weight
        [gate: F | up: F]
    layers.{i}.mlp.w_down.weight           model.layers.{i}.mlp.down_proj.weight
    norm.weight                            model.norm.weight
    lm_head.weight (untied only)           lm_head.weight (always written; equal to the
                                           embedding when tied)

RoPE uses HF's rotate-half convention, so no row permutation is needed either way.
``transformers`` is a test/export dependency only: it is imported inside functions.
"""

from __future__ import annotations

from typing import Any

import torch

from flopwise.config import ModelConfig


def hf_config(cfg: ModelConfig) -> Any:
    """A ``LlamaConfig`` (arch llama) or ``Qwen3Config`` (arch qwen3) equivalent to ``cfg``."""
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        initializer_range=cfg.init_std,
    )
    # transformers 5 keeps RoPE settings in ``rope_parameters``; 4.x reads ``rope_theta``.
    # Both accept the ``rope_theta`` keyword (5.x folds it into rope_parameters); pass the
    # dict too where the class knows it, and check below that theta landed.
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.arch == "llama":
        cls = transformers.LlamaConfig
        extra = dict(mlp_bias=False)
    elif cfg.arch == "qwen3":
        cls = transformers.Qwen3Config
        extra = dict(use_sliding_window=False)
    else:
        raise ValueError(f"no Hugging Face mapping for arch {cfg.arch!r}")
    if _config_has_rope_parameters(cls):
        hf = cls(**common, **extra, rope_parameters=rope)
    else:  # transformers 4.x
        hf = cls(**common, **extra, rope_theta=float(cfg.rope_theta))
    if _hf_rope_theta(hf) != float(cfg.rope_theta):
        raise RuntimeError(f"rope_theta {cfg.rope_theta} did not reach the {cls.__name__}")
    return hf


def _config_has_rope_parameters(cls: type) -> bool:
    import inspect

    try:
        return "rope_parameters" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _hf_rope_theta(hf: Any) -> float:
    rp = getattr(hf, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(hf.rope_theta)


def config_from_hf(hf: Any) -> ModelConfig:
    """The ``ModelConfig`` of a Llama/Qwen3 ``transformers`` config (for importing checkpoints)."""
    model_type = getattr(hf, "model_type", "")
    if model_type not in ("llama", "qwen3"):
        raise ValueError(f"no flopwise mapping for Hugging Face model_type {model_type!r}")
    rp = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    if isinstance(rp, dict) and rp.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"RoPE scaling {rp.get('rope_type')!r} is not supported")
    n_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    return ModelConfig(
        arch=model_type,
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
        head_dim=None if head_dim == hf.hidden_size // n_heads else head_dim,
        ffn_hidden=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=_hf_rope_theta(hf),
        norm_eps=hf.rms_norm_eps,
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.tie_word_embeddings),
        init_std=getattr(hf, "initializer_range", 0.02),
    )


def _splits(cfg: ModelConfig) -> tuple[list[int], int]:
    hd = cfg.resolved_head_dim
    return [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd], cfg.ffn_hidden


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's weights under HF names, projections split. Tensors are views/copies, detached."""
    cfg: ModelConfig = model.cfg
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    qkv_split, ffn = _splits(cfg)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["tok_emb.weight"]}
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = sd[p + "attn.wqkv.weight"].split(qkv_split, dim=0)
        gate, up = sd[p + "mlp.w_gate_up.weight"].split([ffn, ffn], dim=0)
        out[h + "input_layernorm.weight"] = sd[p + "attn_norm.weight"]
        out[h + "self_attn.q_proj.weight"] = q
        out[h + "self_attn.k_proj.weight"] = k
        out[h + "self_attn.v_proj.weight"] = v
        out[h + "self_attn.o_proj.weight"] = sd[p + "attn.wo.weight"]
        if cfg.qk_norm:
            out[h + "self_attn.q_norm.weight"] = sd[p + "attn.q_norm.weight"]
            out[h + "self_attn.k_norm.weight"] = sd[p + "attn.k_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "mlp_norm.weight"]
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = sd[p + "mlp.w_down.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    out["lm_head.weight"] = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    # split() returns views into the fused tensor; give each its own storage so that the
    # dict can be saved with safetensors. (When tied, lm_head.weight IS the embedding
    # tensor, as in HF's own tied models; drop it before a raw safetensors save.)
    split = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
    return {k: v.clone() if k.endswith(split) else v for k, v in out.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF Llama/Qwen3 state dict -> a state dict for ``Transformer(cfg)`` (strict load).

    A tied config takes the embedding and ignores ``lm_head.weight``; an untied one
    requires it. Missing tensors raise ``KeyError`` naming the HF key.
    """
    out: dict[str, torch.Tensor] = {"tok_emb.weight": sd["model.embed_tokens.weight"]}
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out[p + "attn_norm.weight"] = sd[h + "input_layernorm.weight"]
        out[p + "attn.wqkv.weight"] = torch.cat(
            [sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"], sd[h + "self_attn.v_proj.weight"]],
            dim=0,
        )  # ((H + 2*KV) * hd, D)
        out[p + "attn.wo.weight"] = sd[h + "self_attn.o_proj.weight"]
        if cfg.qk_norm:
            out[p + "attn.q_norm.weight"] = sd[h + "self_attn.q_norm.weight"]
            out[p + "attn.k_norm.weight"] = sd[h + "self_attn.k_norm.weight"]
        out[p + "mlp_norm.weight"] = sd[h + "post_attention_layernorm.weight"]
        out[p + "mlp.w_gate_up.weight"] = torch.cat(
            [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]], dim=0
        )  # (2F, D)
        out[p + "mlp.w_down.weight"] = sd[h + "mlp.down_proj.weight"]
    out["norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def to_hf_model(model: torch.nn.Module, attn_implementation: str = "sdpa") -> Any:
    """A ``transformers`` causal-LM with our model's weights (float32 unless the weights say otherwise)."""
    from transformers import AutoModelForCausalLM

    # Built on the CPU (not meta): HF's rotary inv_freq is a non-persistent buffer that
    # a state dict would not fill.
    hf = AutoModelForCausalLM.from_config(hf_config(model.cfg), attn_implementation=attn_implementation)
    dtype = model.tok_emb.weight.dtype
    hf.to(dtype)
    result = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [k for k in result.missing_keys if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    return hf.eval()
