"""Mixture-of-experts parameter counting (total vs active) against transformers' Qwen3-MoE."""

import pytest
import torch

from flopwise.config import ConfigError, ModelConfig, build_config
from flopwise.plan.flops import flops_per_token, flops_per_token_6n, param_counts


def _moe_cfg(tie: bool) -> ModelConfig:
    return ModelConfig(arch="qwen3", vocab_size=151936, d_model=896, n_layers=12, n_heads=16, n_kv_heads=8,
                       head_dim=64, ffn_hidden=1536, max_seq_len=4096, qk_norm=True, tie_embeddings=tie,
                       n_experts=16, moe_top_k=2, moe_ffn_hidden=512)


@pytest.mark.parametrize("tie", [True, False])
def test_moe_total_matches_transformers_qwen3_moe(tie):
    transformers = pytest.importorskip("transformers")
    cfg = _moe_cfg(tie)
    hf = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.ffn_hidden, moe_intermediate_size=cfg.moe_ffn_hidden, num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.moe_top_k, tie_word_embeddings=tie, decoder_sparse_step=1, mlp_only_layers=[],
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert param_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())


def test_active_parameters_count_only_top_k_experts():
    cfg = _moe_cfg(tie=True)
    c = param_counts(cfg)
    D, L, E, K, F = 896, 12, 16, 2, 512
    assert c["router"] == L * D * E
    assert c["mlp"] == L * (D * E + E * 3 * D * F)
    assert c["mlp_active"] == L * (D * E + K * 3 * D * F)
    assert c["total"] - c["active"] == L * (E - K) * 3 * D * F
    # FLOPs follow the active experts only; 6N uses active parameters.
    dense_equiv = ModelConfig(**{**cfg.__dict__, "n_experts": 0, "moe_top_k": 0, "moe_ffn_hidden": 0,
                                 "ffn_hidden": K * F})
    router_flops = 6 * L * D * E
    assert flops_per_token(cfg, 1024) == flops_per_token(dense_equiv, 1024) + router_flops
    assert flops_per_token_6n(cfg) == 6 * c["active"]


def test_moe_config_validation():
    with pytest.raises(ConfigError, match="moe_top_k must be in \\[1, model.n_experts=8\\]"):
        build_config(overrides=["model.n_experts=8", "model.moe_top_k=9"])
    with pytest.raises(ConfigError, match="needs model.n_experts > 0"):
        build_config(overrides=["model.moe_top_k=2"])
