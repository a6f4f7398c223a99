"""Model components chosen by name: norms, MLPs, positions, biases, document masking, config checks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from flopwise.config import ConfigError, ModelConfig, build_config
from flopwise.data.loader import document_ids
from flopwise.model import build_model
from flopwise.model.attention import available_backends
from flopwise.model.layers import MLP, RMSNorm, make_norm


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32,
                arch="custom")
    base.update(kw)
    return ModelConfig(**base)


def test_norm_kinds():
    assert isinstance(make_norm(tiny()), RMSNorm)
    ln = make_norm(tiny(norm="layernorm", norm_bias=True))
    assert isinstance(ln, torch.nn.LayerNorm) and ln.bias is not None
    assert make_norm(tiny(norm="layernorm")).bias is None  # LayerNorm without bias
    x = torch.randn(3, 32)
    torch.testing.assert_close(make_norm(tiny(norm="layernorm"))(x), F.layer_norm(x, (32,), eps=1e-5))


@pytest.mark.parametrize("act", ["gelu", "relu2"])
def test_two_matrix_mlps(act):
    cfg = tiny(mlp=act, mlp_bias=True)
    mlp = MLP(cfg)
    torch.nn.init.normal_(mlp.w_up.bias)
    x = torch.randn(2, 5, 32)
    h = x @ mlp.w_up.weight.T + mlp.w_up.bias
    if act == "gelu":  # GPT-2's gelu_new, written out
        h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    else:
        h = torch.clamp(h, min=0) ** 2
    torch.testing.assert_close(mlp(x), h @ mlp.w_down.weight.T + mlp.w_down.bias, rtol=1e-5, atol=1e-5)


def test_biases_exist_only_where_asked_and_start_at_zero():
    names = dict(build_model(tiny(attn_bias=True)).named_parameters())
    assert {"layers.0.attn.wqkv.bias", "layers.0.attn.wo.bias"} <= names.keys()
    assert not any(n.startswith("layers.0.mlp") and n.endswith("bias") for n in names)
    assert all(float(p.detach().abs().max()) == 0 for n, p in names.items() if n.endswith(".bias"))
    assert not any(n.endswith(".bias") for n in dict(build_model(tiny()).named_parameters()))


@pytest.mark.parametrize("pos,order_matters", [("none", False), ("rope", True), ("learned", True)])
def test_position_encodings(pos, order_matters):
    """Without positions, one causal attention layer sees the tokens before t as a set:
    shuffling them leaves position t unchanged. RoPE and learned positions make order visible."""
    model = build_model(tiny(pos_emb=pos, n_layers=1), seed=1).eval()
    idx = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    shuffled = idx.clone()
    shuffled[0, :11] = idx[0, :11][torch.randperm(11, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        a, b = model(idx)[0, -1], model(shuffled)[0, -1]
    assert (not torch.allclose(a, b, atol=1e-5)) == order_matters
    assert (model.pos_emb is not None) == (pos == "learned") and (model.rope_cos.numel() > 0) == (pos == "rope")


BACKENDS_HERE = [b for b, why in available_backends(torch.device("cpu"), torch.float32).items() if why is None]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_document_mask_isolates_documents_through_the_model(backend):
    cfg = tiny(doc_mask=True)
    model = build_model(cfg, seed=2).eval()
    model.set_attention_backend(backend)
    eos = 0
    g = torch.Generator().manual_seed(3)
    doc_a, doc_b = torch.randint(1, 128, (7,), generator=g), torch.randint(1, 128, (9,), generator=g)
    x = torch.cat([doc_a, torch.tensor([eos]), doc_b])[None]  # (1, 17): doc A + EOS, then doc B
    ids = document_ids(x, eos)
    changed = x.clone()
    changed[0, :7] = torch.randint(1, 128, (7,), generator=g)
    with torch.no_grad():
        full, other = model(x, ids), model(changed, ids)
        alone = model(doc_b[None])
        unmasked = model(changed)
    torch.testing.assert_close(full[:, 8:], other[:, 8:], rtol=1e-5, atol=1e-5)  # B never sees A
    # With RoPE only relative positions matter, so B inside the window equals B on its own.
    torch.testing.assert_close(full[:, 8:], alone, rtol=1e-4, atol=1e-4)
    assert (unmasked[:, 8:] - full[:, 8:]).abs().max() > 1e-3  # without the mask it would


def test_moe_model_reports_weighted_aux_loss():
    cfg = tiny(n_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1)
    model = build_model(cfg, seed=4)
    model(torch.randint(0, 128, (2, 8)))
    aux = [blk.mlp.aux for blk in model.layers]
    expected = (0.5 * sum(a["load_balance"] for a in aux) + 0.1 * sum(a["z"] for a in aux)) / cfg.n_layers
    torch.testing.assert_close(model.aux_loss, expected)
    model.aux_loss.backward()
    assert model.layers[0].mlp.router.weight.grad.abs().max() > 0


def test_component_config_errors_are_named_together():
    with pytest.raises(ConfigError) as e:
        build_config(overrides=["model.norm=layrnorm", "model.mlp=geglu", "model.pos_emb=alibi",
                                "model.attention=flash3", "model.arch=gpt3"])
    text = str(e.value)
    assert "5 problem(s)" in text and "did you mean 'layernorm'" in text and "choose swiglu, gelu, relu2" in text
    assert "model.attention 'flash3'" in text and "model.arch 'gpt3'" in text
    with pytest.raises(ConfigError, match="norm_bias=true needs model.norm=layernorm"):
        build_config(overrides=["model.norm_bias=true"])
    with pytest.raises(ConfigError, match="experts are SwiGLU"):
        build_config(overrides=["model.n_experts=4", "model.moe_top_k=1", "model.mlp=gelu"])


@pytest.mark.parametrize("preset", ["gpt2-124m", "llama2-1.3b", "gpt2-1.3b", "smollm-1.7b", "qwen3-moe-500m-a330m"])
def test_new_presets_build_on_meta_and_export_config(preset):
    cfg = build_config(preset=preset).model
    model = build_model(cfg, device="meta")
    assert model.cfg.arch == cfg.arch
    pytest.importorskip("transformers")
    from flopwise.model.hf import hf_config

    assert hf_config(dataclasses.replace(cfg)).model_type == cfg.arch
