"""The mixture-of-experts MLP: parity with transformers' Qwen3-MoE block, routing, auxiliary
losses, gradients, both dispatch paths, and the Hugging Face weight mapping.

Everything is tiny, float32 and CPU unless a test says otherwise. Constructed routers read
only the first E input dimensions (router.weight = scale * [I_E | 0]), so a token's router
logits are exactly the "controls" written there and its top-k experts are known by hand.
"""

import math

import pytest
import torch

from flopwise.model.moe import MoE, grouped_mm_supported, moe_from_hf, moe_to_hf

DISPATCHES = ["loop"] + (["grouped_mm"] if grouped_mm_supported("cpu", torch.float32) else [])


def _hf_block(n_experts: int, norm_topk_prob: bool, seed: int = 0):
    """transformers' Qwen3MoeSparseMoeBlock (D=32, F=16, top-2), random weights, eager experts loop."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=n_experts,
                                      num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                                      experts_implementation="eager")
    block = Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # the router is zero-initialised: randomise everything
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def _split_per_expert(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The 4.x/hub per-expert layout of a fused 5.x block state dict, written out by hand."""
    gate_up, down = fused["experts.gate_up_proj"], fused["experts.down_proj"]  # (E, 2F, D), (E, D, F)
    F = gate_up.shape[1] // 2
    out = {"gate.weight": fused["gate.weight"].clone()}
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[e, :F].clone()
        out[f"experts.{e}.up_proj.weight"] = gate_up[e, F:].clone()
        out[f"experts.{e}.down_proj.weight"] = down[e].clone()
    return out


def _constructed(controls: torch.Tensor, d_model: int, ffn: int, top_k: int, norm: bool = True,
                 seed: int = 0) -> tuple[MoE, torch.Tensor]:
    """A MoE whose router logits for token t are exactly controls[t] (N, E), and x (1, N, D):
    x[..., :E] = controls, the other dimensions random."""
    N, E = controls.shape
    torch.manual_seed(seed)
    m = MoE(d_model, E, top_k, ffn, norm)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, :E] = torch.eye(E)
    x = torch.randn(1, N, d_model)
    x[0, :, :E] = controls
    return m, x


# --------------------------------------------------------------------------- parity with transformers

@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("n_experts", [4, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_parity_with_transformers_qwen3_moe_block(norm, n_experts, dispatch):
    hf = _hf_block(n_experts, norm)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    ref = hf(x)  # (2, 7, 32)

    # HF -> ours from the HF state dict (fused 5.x keys)
    ours = MoE(32, n_experts, 2, 16, norm)
    ours.dispatch = dispatch
    ours.load_state_dict(moe_from_hf(hf.state_dict(), n_experts))
    torch.testing.assert_close(ours(x), ref, rtol=1e-6, atol=1e-6)

    # ours -> HF -> ours round trip is the identity, and a fresh layer loaded from it agrees
    back = moe_from_hf(moe_to_hf(ours.state_dict()), n_experts)
    assert back.keys() == ours.state_dict().keys()
    for k, v in ours.state_dict().items():
        assert torch.equal(back[k], v), k
    fresh = MoE(32, n_experts, 2, 16, norm)
    fresh.dispatch = dispatch
    fresh.load_state_dict(back)
    torch.testing.assert_close(fresh(x), ref, rtol=1e-6, atol=1e-6)

    # and the other direction: random ours, loaded into the HF block
    torch.manual_seed(3)
    mine = MoE(32, n_experts, 2, 16, norm)
    mine.dispatch = dispatch
    hf.load_state_dict(moe_to_hf(mine.state_dict()))
    torch.testing.assert_close(mine(x), hf(x), rtol=1e-6, atol=1e-6)


def test_per_expert_keys_equal_fused_keys():
    hf = _hf_block(4, True)
    fused = moe_from_hf(hf.state_dict(), 4)
    per_expert = moe_from_hf(_split_per_expert(hf.state_dict()), 4)
    for k in fused:
        assert torch.equal(per_expert[k], fused[k]), k
    # moe_to_hf's per-expert layout is the same set of tensors
    written = moe_to_hf(fused, layout="per_expert")
    manual = _split_per_expert(hf.state_dict())
    assert written.keys() == manual.keys()
    for k in manual:
        assert torch.equal(written[k], manual[k]), k


def test_loads_what_save_pretrained_writes(tmp_path):
    """Whatever layout ``save_pretrained`` writes (5.23: per-expert keys), moe_from_hf reads it."""
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    sd = safetensors.load_file(tmp_path / "model.safetensors")
    got = moe_from_hf(sd, 4, prefix="model.layers.0.mlp.")
    mlp = model.model.layers[0].mlp
    assert torch.equal(got["router.weight"], mlp.gate.weight)
    assert torch.equal(got["w_gate_up"], mlp.experts.gate_up_proj)
    assert torch.equal(got["w_down"], mlp.experts.down_proj)


def test_missing_or_mismatched_keys():
    hf_sd = _hf_block(4, True).state_dict()
    fused = dict(hf_sd)
    del fused["experts.down_proj"]
    with pytest.raises(KeyError, match="experts.down_proj"):
        moe_from_hf(fused, 4)
    per = _split_per_expert(hf_sd)
    del per["experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.5.mlp.experts.2.up_proj.weight"):
        moe_from_hf({"model.layers.5.mlp." + k: v for k, v in per.items()}, 4, prefix="model.layers.5.mlp.")
    no_router = dict(hf_sd)
    del no_router["gate.weight"]
    with pytest.raises(KeyError, match="gate.weight"):
        moe_from_hf(no_router, 4)
    with pytest.raises(ValueError, match="more than n_experts=3"):
        moe_from_hf(_split_per_expert(hf_sd), 3)
    with pytest.raises(ValueError, match="expected n_experts=8"):
        moe_from_hf(hf_sd, 8)


# --------------------------------------------------------------------------- routing

# Controls (= router logits) for 5 tokens over 4 experts, and each token's top-2 by hand.
_CONTROLS = torch.tensor([[3.0, 2.0, 1.0, 0.0],
                          [0.0, 1.0, 2.0, 3.0],
                          [1.0, 3.0, 0.0, 2.0],
                          [2.0, 0.0, 3.0, 1.0],
                          [0.0, 3.0, 2.0, 1.0]])
_TOP2 = [{0, 1}, {2, 3}, {1, 3}, {0, 2}, {1, 2}]


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("norm", [True, False])
def test_tokens_reach_exactly_their_top_k_experts(norm, dispatch):
    """Expert e writes only output dimension e, with a value independent of the token
    (F * silu(2)), so out[t, e] = w[t, e] * F * silu(2) if e is among t's top-2, else 0."""
    D, E, F = 8, 4, 4
    m, x = _constructed(_CONTROLS, D, F, top_k=2, norm=norm)
    m.dispatch = dispatch
    x[0, :, E:] = 0.0
    x[0, :, D - 1] = 1.0  # a constant input the experts read
    with torch.no_grad():
        m.w_gate_up.zero_()
        m.w_gate_up[:, :F, D - 1] = 2.0  # gate = 2
        m.w_gate_up[:, F:, D - 1] = 1.0  # up = 1
        m.w_down.zero_()
        for e in range(E):
            m.w_down[e, e, :] = 1.0  # expert e -> output dimension e
    out = m(x)[0]  # (N, D)
    unit = F * (2.0 / (1.0 + math.exp(-2.0)))  # F * silu(2)
    for t, chosen in enumerate(_TOP2):
        assert {e for e in range(D) if out[t, e] != 0} == chosen, t
        p = torch.softmax(_CONTROLS[t], dim=0)
        w = {e: p[e] / sum(p[c] for c in chosen) if norm else p[e] for e in chosen}
        for e in chosen:
            assert out[t, e].item() == pytest.approx(w[e].item() * unit, rel=1e-5)
    assert m.aux["tokens_per_expert"].tolist() == [2, 3, 3, 2]


def test_tokens_per_expert_is_a_detached_count():
    m, x = _constructed(_CONTROLS, 8, 4, top_k=2)
    m(x)
    c = m.aux["tokens_per_expert"]
    assert c.dtype == torch.int64 and not c.requires_grad
    assert c.shape == (4,) and c.sum().item() == 5 * 2


# --------------------------------------------------------------------------- auxiliary losses

@pytest.mark.parametrize("E,k", [(4, 1), (4, 2), (8, 3)])
def test_load_balance_is_one_when_balanced_and_e_over_k_at_worst(E, k):
    # Balanced: the E cyclic shifts of one logit vector. Each expert is in the top-k of
    # exactly k tokens (f_e = 1/E) and sees every probability once (P_e = 1/E).
    base = torch.arange(E, 0, -1, dtype=torch.float32)  # distinct, no ties
    balanced = torch.stack([base.roll(s) for s in range(E)])  # (E, E)
    m, x = _constructed(balanced, 16, 8, top_k=k)
    m(x)
    assert m.aux["load_balance"].item() == pytest.approx(1.0, abs=1e-6)
    assert m.aux["tokens_per_expert"].tolist() == [k] * E

    # Worst case: every token puts (almost) all its probability on expert 0 -> E / k.
    collapsed = torch.zeros(6, E)
    collapsed[:, 0] = 40.0
    m, x = _constructed(collapsed, 16, 8, top_k=k)
    m(x)
    assert m.aux["load_balance"].item() == pytest.approx(E / k, rel=1e-5)


def test_load_balance_is_transformers_value_over_top_k():
    """transformers normalises f by tokens (sum k), we by token-slots (sum 1)."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    m = MoE(32, 8, 2, 16)
    x = torch.randn(3, 5, 32)
    m(x)
    logits = m.router(x.reshape(-1, 32)).detach()
    theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert theirs.item() == pytest.approx(2 * m.aux["load_balance"].item(), rel=1e-5)


def test_z_loss_on_known_logits():
    m, x = _constructed(_CONTROLS, 8, 4, top_k=2)
    m(x)
    expect = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in _CONTROLS.tolist()) / len(_CONTROLS)
    assert m.aux["z"].item() == pytest.approx(expect, rel=1e-6)
    with torch.no_grad():
        m.router.weight.zero_()  # all logits 0: logsumexp = log E
    m(x)
    assert m.aux["z"].item() == pytest.approx(math.log(4) ** 2, rel=1e-6)


# --------------------------------------------------------------------------- gradients

def _route_to_first_four(n_tokens: int = 12, E: int = 6, seed: int = 0) -> torch.Tensor:
    """Controls (n_tokens, E) under which experts 4 and 5 never make anyone's top-2."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n_tokens, E, generator=g) * 2.0
    c[:, 4:] = -10.0
    return c


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_gradients_reach_only_selected_experts(dispatch):
    m, x = _constructed(_route_to_first_four(), 16, 8, top_k=2)
    m.dispatch = dispatch
    x.requires_grad_(True)
    out = m(x)
    assert m.aux["tokens_per_expert"][4:].tolist() == [0, 0]
    assert (m.aux["tokens_per_expert"][:4] > 0).all()
    (out * torch.randn_like(out)).sum().backward()  # main loss only, no aux
    for name in ("w_gate_up", "w_down"):
        grad = getattr(m, name).grad
        assert grad is not None
        for e in range(4):
            assert grad[e].abs().sum() > 0, (name, e)
        assert not grad[4:].any(), name  # experts without tokens get exactly zero
    # the router learns through the routing weights alone
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("loss", ["load_balance", "z"])
def test_router_gets_gradient_from_aux_losses(loss):
    m, x = _constructed(_route_to_first_four(), 16, 8, top_k=2)
    m(x)
    m.aux[loss].backward()
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
    assert m.w_gate_up.grad is None and m.w_down.grad is None  # aux losses touch only the router


# --------------------------------------------------------------------------- dispatch paths

@pytest.mark.skipif("grouped_mm" not in DISPATCHES, reason="torch._grouped_mm unavailable for CPU float32")
def test_grouped_mm_equals_expert_loop():
    torch.manual_seed(0)
    m = MoE(32, 8, 2, 16)
    x = torch.randn(3, 9, 32)
    results = {}
    for dispatch in ("loop", "grouped_mm"):
        m.zero_grad(set_to_none=True)
        m.dispatch = dispatch
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        (out.sum() + m.aux["load_balance"]).backward()  # .sum(): a broadcast upstream gradient
        results[dispatch] = (out, xi.grad, *(p.grad.clone() for p in m.parameters()))
    for a, b in zip(results["loop"], results["grouped_mm"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_dispatch_choice():
    x = torch.randn(1, 4, 32)
    m = MoE(32, 4, 2, 16)
    assert m._use_grouped_mm(x, torch.float32) == grouped_mm_supported("cpu", torch.float32)
    odd = MoE(30, 4, 2, 15)  # rows of 30 and 15 floats are not 16-byte multiples
    assert not odd._use_grouped_mm(torch.randn(1, 4, 30), torch.float32)
    odd(torch.randn(1, 4, 30))  # and it still runs, on the loop
    m.dispatch = "loop"
    assert not m._use_grouped_mm(x, torch.float32)
    m.dispatch = "bogus"
    with pytest.raises(ValueError, match="dispatch"):
        m(x)


def test_bf16_forward_runs_on_cpu():
    torch.manual_seed(0)
    m = MoE(32, 8, 2, 16)
    x = torch.randn(2, 6, 32)
    ref = m(x)
    # bf16 weights and activations, both paths
    mb = MoE(32, 8, 2, 16).to(torch.bfloat16)
    mb.load_state_dict(m.state_dict())
    for dispatch in DISPATCHES:
        mb.dispatch = dispatch
        out = mb(x.to(torch.bfloat16))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    # float32 weights under bf16 autocast
    for dispatch in DISPATCHES:
        m.dispatch = dispatch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
