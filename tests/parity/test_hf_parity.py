"""Parity with Hugging Face transformers (Llama, Qwen3, Qwen3-MoE, GPT-2) on the same weights, CPU float32.

Both directions: our model exported to HF, and a random HF model imported into ours.
Every weight (norms included) is randomised first, so a swapped or misnamed tensor
cannot hide behind an all-ones initialisation.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from flopwise.config import ModelConfig  # noqa: E402
from flopwise.model import build_model  # noqa: E402
from flopwise.model.hf import (  # noqa: E402
    config_from_hf,
    from_hf_state_dict,
    hf_config,
    to_hf_model,
    to_hf_state_dict,
)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                max_seq_len=64, rope_theta=50000.0, norm_eps=1e-6)
    base.update(kw)
    return ModelConfig(**base)


GPT2 = dict(arch="gpt2", norm="layernorm", norm_bias=True, mlp="gelu", pos_emb="learned", attn_bias=True,
            mlp_bias=True, n_kv_heads=4, rope_theta=10000.0, norm_eps=1e-5)
MOE = dict(arch="qwen3_moe", qk_norm=True, n_experts=4, moe_top_k=2, moe_ffn_hidden=48, tie_embeddings=False)

CONFIGS = {
    "llama-tied": tiny(),
    "llama-untied": tiny(tie_embeddings=False),
    "llama-biases-mqa": tiny(attn_bias=True, mlp_bias=True, n_kv_heads=1),
    "qwen3-hd24-untied": tiny(arch="qwen3", qk_norm=True, head_dim=24, tie_embeddings=False),
    "qwen3-hd24-tied": tiny(arch="qwen3", qk_norm=True, head_dim=24),
    "qwen3-attn-bias": tiny(arch="qwen3", qk_norm=True, attn_bias=True),
    "gpt2-tied": tiny(**GPT2),
    "gpt2-untied": tiny(**{**GPT2, "tie_embeddings": False}),
    "qwen3-moe": tiny(**MOE),
    "qwen3-moe-no-renorm-tied": tiny(**{**MOE, "moe_norm_topk_prob": False, "tie_embeddings": True, "n_experts": 6}),
}


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.08 * torch.randn(p.shape, generator=g))


def tokens(cfg: ModelConfig, T: int = 40) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))


def make_hf(cfg: ModelConfig, attn: str):
    hf = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation=attn).eval()
    assert hf.config._attn_implementation == attn
    return hf


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_export_to_hf(name, attn):
    cfg = CONFIGS[name]
    ours = build_model(cfg, seed=3).eval()
    randomize(ours, seed=4)
    hf = make_hf(cfg, attn)
    sd = to_hf_state_dict(ours)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_embeddings)
    if cfg.tie_embeddings:  # HF's tie survived the load: one tensor for both
        assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    idx = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_import_from_hf(name):
    cfg = CONFIGS[name]
    hf = make_hf(cfg, "eager")
    randomize(hf, seed=5)
    ours = build_model(cfg, seed=6).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    if cfg.tie_embeddings:
        assert ours.head_weight.data_ptr() == ours.tok_emb.weight.data_ptr()
    idx = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_state_dict_and_config(name):
    cfg = CONFIGS[name]
    ours = build_model(cfg, seed=7)
    back = from_hf_state_dict(to_hf_state_dict(ours), cfg)
    sd = ours.state_dict()
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    assert config_from_hf(hf_config(cfg)) == cfg


def test_to_hf_model_matches():
    cfg = CONFIGS["qwen3-hd24-untied"]
    ours = build_model(cfg, seed=8).eval()
    randomize(ours, seed=9)
    hf = to_hf_model(ours)
    idx = tokens(cfg, T=cfg.max_seq_len)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=1e-5, atol=1e-5)


def test_hf_config_fields():
    cfg = CONFIGS["qwen3-hd24-untied"]
    hc = hf_config(cfg)
    assert type(hc).__name__ == "Qwen3Config"
    assert (hc.hidden_size, hc.intermediate_size, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim) == (
        64, 96, 4, 2, 24)
    assert hc.tie_word_embeddings is False and hc.attention_bias is False
    assert type(hf_config(CONFIGS["llama-tied"])).__name__ == "LlamaConfig"
    assert hf_config(CONFIGS["llama-tied"]).mlp_bias is False


def test_gpt2_and_moe_config_fields():
    hc = hf_config(CONFIGS["gpt2-tied"])
    assert type(hc).__name__ == "GPT2Config" and (hc.n_embd, hc.n_inner, hc.n_head, hc.n_positions) == (64, 96, 4, 64)
    assert hc.activation_function == "gelu_new"
    mc = hf_config(CONFIGS["qwen3-moe"])
    assert type(mc).__name__ == "Qwen3MoeConfig"
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.decoder_sparse_step) == (4, 2, 48, 1)


@pytest.mark.parametrize("cfg,why", [
    (tiny(arch="llama", qk_norm=True), "model.arch=llama needs model.qk_norm=false"),
    (tiny(arch="custom"), "custom has no Hugging Face equivalent"),
    (tiny(arch="llama", mlp="relu2"), "needs model.mlp=swiglu, got relu2"),
    (tiny(**{**GPT2, "n_kv_heads": 2}), "no grouped-query attention"),
    (tiny(arch="llama", n_experts=4, moe_top_k=2), "is dense but model.n_experts=4"),
])
def test_models_without_an_hf_equivalent_are_refused(cfg, why):
    from flopwise.model.hf import HFMappingError

    with pytest.raises(HFMappingError, match=why):
        hf_config(cfg)
    with pytest.raises(HFMappingError, match=why):
        to_hf_state_dict(build_model(cfg))
