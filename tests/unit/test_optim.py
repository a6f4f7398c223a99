"""Learning-rate schedule, optimizer parameter groups, and Muon (split, orthogonalisation, resumption)."""

import dataclasses
import io
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flopwise.config import ModelConfig, OptimConfig
from flopwise.model import build_model
from flopwise.train import optim
from flopwise.train.optim import (
    CombinedOptimizer,
    Muon,
    build_optimizer,
    describe_optimizer,
    make_muon,
    muon_class,
    muon_lr_scale,
    muon_split,
    newton_schulz,
    param_groups,
    set_lr,
    set_lr_factor,
)
from flopwise.train.schedule import lr_at


def test_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    total = 111  # 10 warm-up steps, then 100 decay intervals
    lrs = [lr_at(s, total, cfg) for s in range(total)]
    assert lrs[0] == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert lrs[9] == pytest.approx(1e-3)  # warm-up ends at the peak
    assert lrs[10] == pytest.approx(1e-3)  # cosine starts at the peak
    assert lrs[-1] == pytest.approx(1e-4)  # ... and ends at the floor on the last step
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-2)  # halfway


def test_constant_schedule_and_no_warmup():
    cfg = OptimConfig(lr=2e-3, warmup_steps=0, schedule="constant")
    assert {lr_at(s, 50, cfg) for s in range(50)} == {2e-3}


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and len(decay["params"]) == 2
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 3


def test_tied_weights_counted_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == 1


# ----------------------------------------------------------------------------- Muon

# Fields added to OptimConfig with Muon and WSD; a stand-in so these tests do not depend on them.
NEW_FIELDS = dict(name="adamw", muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.0,
                  decay_fraction=0.2, decay_shape="linear")


def ocfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{**NEW_FIELDS, **dataclasses.asdict(OptimConfig()), **kw})


def tiny_model(**kw):
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32)
    return build_model(ModelConfig(**{**base, **kw}))


GPT2 = dict(arch="gpt2", norm="layernorm", norm_bias=True, mlp="gelu", pos_emb="learned", attn_bias=True,
            mlp_bias=True, n_kv_heads=4, tie_embeddings=False)
MOE = dict(arch="qwen3_moe", qk_norm=True, n_experts=4, moe_top_k=2, moe_ffn_hidden=16)


def split_names(model):
    muon, adamw = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(p)] for p in muon), sorted(n for n, _ in adamw)


def test_muon_split_llama():
    muon, adamw = split_names(tiny_model())
    assert muon == sorted(f"layers.{i}.{w}.weight" for i in range(2)
                          for w in ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down"))
    assert adamw == sorted(["tok_emb.weight", "norm.weight"]
                           + [f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attn", "mlp")])


def test_muon_split_gpt2_biases_positions_untied_head():
    model = tiny_model(**GPT2)
    muon, adamw = split_names(model)
    assert muon == sorted(f"layers.{i}.{w}.weight" for i in range(2)
                          for w in ("attn.wqkv", "attn.wo", "mlp.w_up", "mlp.w_down"))
    assert {"tok_emb.weight", "pos_emb.weight", "lm_head.weight", "layers.0.attn.wqkv.bias",
            "layers.1.mlp.w_down.bias", "layers.0.attn_norm.bias", "norm.bias"} <= set(adamw)
    assert len(muon) + len(adamw) == len(list(model.parameters()))


def test_muon_split_moe_experts_and_router_stay_on_adamw():
    muon, adamw = split_names(tiny_model(**MOE))
    assert muon == sorted(f"layers.{i}.attn.{w}.weight" for i in range(2) for w in ("wqkv", "wo"))
    assert {f"layers.{i}.mlp.{w}" for i in range(2) for w in ("w_gate_up", "w_down", "router.weight")} <= set(adamw)


def test_build_muon_optimizer_groups_and_lr_factor():
    model = tiny_model(**GPT2)
    cfg = ocfg(name="muon", lr=1e-3, muon_lr=0.05, weight_decay=0.1, muon_weight_decay=0.01)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    assert isinstance(opt, CombinedOptimizer) and set(opt.optimizers) == {"muon", "adamw"}
    assert isinstance(opt.optimizers["muon"], muon_class())
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each parameter exactly once
    (mg,) = opt.optimizers["muon"].param_groups
    decay, no_decay = opt.optimizers["adamw"].param_groups
    assert (mg["base_lr"], mg["weight_decay"], mg["momentum"], mg["nesterov"]) == (0.05, 0.01, 0.95, True)
    assert decay["base_lr"] == no_decay["base_lr"] == 1e-3
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])  # embeddings, head
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    set_lr_factor(opt, 0.5)
    assert mg["lr"] == 0.025 and decay["lr"] == no_decay["lr"] == 5e-4
    with pytest.raises(TypeError):
        set_lr(opt, 1e-3)  # one rate for both would be wrong
    assert describe_optimizer(opt).startswith("Muon lr 0.05 (momentum 0.95, Nesterov")


def test_set_lr_factor_on_adamw():
    opt = build_optimizer(torch.nn.Linear(4, 4), ocfg(lr=2e-3), torch.device("cpu"))
    set_lr_factor(opt, 0.25)
    assert {g["lr"] for g in opt.param_groups} == {5e-4}
    set_lr(opt, 1e-4)
    assert {g["lr"] for g in opt.param_groups} == {1e-4}


def ill_conditioned(rows, cols, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen)
            + 30 * torch.randn(rows, 1, generator=gen) @ torch.randn(1, cols, generator=gen))


@pytest.mark.parametrize("shape", [(48, 32), (32, 96)])
def test_muon_update_is_orthogonalised(shape):
    g = ill_conditioned(*shape)
    s = torch.linalg.svdvals(g)
    assert s[0] / s[-1] > 100  # one direction dominates the raw gradient
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = make_muon([p], ocfg(muon_lr=0.02, muon_weight_decay=0.0))
    p.grad = g
    opt.step()
    update = -p.detach() / (0.02 * muon_lr_scale(shape))
    sv = torch.linalg.svdvals(update)
    assert sv.min() > 0.5 and sv.max() < 1.5  # all directions move by about the same amount
    assert muon_lr_scale(shape) == math.sqrt(max(1, shape[0] / shape[1]))
    sv_ns = torch.linalg.svdvals(newton_schulz(g).float())
    assert sv_ns.min() > 0.5 and sv_ns.max() < 1.5


def test_flopwise_muon_matches_torch_muon():
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    deltas = []
    for cls in (torch.optim.Muon, Muon):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(48, 32, generator=gen))
        p0 = p.detach().clone()
        opt = make_muon([p], ocfg(muon_lr=0.02, muon_weight_decay=0.1), cls)
        for _ in range(3):
            p.grad = torch.randn(48, 32, generator=gen)
            opt.step()
        deltas.append(p.detach() - p0)
        assert set(opt.state[p]) == {"momentum_buffer"}
    # The same algorithm; bf16 Newton-Schulz rounds differently (addmm vs separate ops).
    assert (deltas[0] - deltas[1]).norm() / deltas[0].norm() < 0.05


def lm_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, model.cfg.vocab_size), y.reshape(-1))


def fixed_batch(vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (4, 17), generator=gen)
    return seq[:, :-1], seq[:, 1:]


@pytest.fixture(params=["torch", "flopwise"])
def muon_impl(request, monkeypatch):
    """Run a test with torch.optim.Muon and with flopwise's (the one runs use: it skips on the device)."""
    if request.param == "torch":
        if not hasattr(torch.optim, "Muon"):
            pytest.skip("this torch has no torch.optim.Muon")
        monkeypatch.setattr(optim, "muon_class", lambda: torch.optim.Muon)
    return request.param


def train_losses(model, cfg, steps=12):
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    batch = fixed_batch()
    losses = []
    for _ in range(steps):
        loss = lm_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(p.grad is None for p in model.parameters())
    return opt, losses


def test_muon_decreases_loss_on_a_fixed_batch(muon_impl):
    torch.manual_seed(0)
    # Muon alone: AdamW's parameters (embedding, norms) frozen at lr 0.
    opt, losses = train_losses(tiny_model(), ocfg(name="muon", lr=0.0, muon_lr=0.02))
    assert type(opt.optimizers["muon"]) is (torch.optim.Muon if muon_impl == "torch" else Muon)
    assert all(a > b for a, b in zip(losses, losses[1:])) and losses[-1] < 0.93 * losses[0], losses
    # Muon and AdamW together.
    _, losses = train_losses(tiny_model(), ocfg(name="muon", lr=3e-3, muon_lr=0.02))
    assert losses[-1] < 0.85 * losses[0], losses


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_state_dict_round_trip_resumes_bitwise(name, muon_impl):
    cfg = ocfg(name=name, lr=3e-3, muon_lr=0.02, muon_weight_decay=0.01)
    batch = fixed_batch()

    def train_step(model, opt, factor):
        set_lr_factor(opt, factor)
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model = tiny_model(**MOE)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    for factor in (0.5, 1.0):
        train_step(model, opt, factor)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    train_step(model, opt, 0.9)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # as checkpoints are loaded
    fresh = tiny_model(**MOE)
    fresh.load_state_dict(saved["model"])
    fresh_opt = build_optimizer(fresh, cfg, torch.device("cpu"))
    fresh_opt.load_state_dict(saved["optim"])
    assert {g["base_lr"] for g in fresh_opt.param_groups} == {g["base_lr"] for g in opt.param_groups}
    train_step(fresh, fresh_opt, 0.9)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n


def test_loading_adamw_state_into_a_muon_run_is_refused():
    model = tiny_model()
    adamw = build_optimizer(model, ocfg(), torch.device("cpu"))
    muon = build_optimizer(model, ocfg(name="muon"), torch.device("cpu"))
    with pytest.raises(ValueError, match="optim.name"):
        muon.load_state_dict(adamw.state_dict())


def test_base_lr_follows_the_config_after_loading():
    """The configured peak rate wins over the checkpoint's (as the schedule always recomputed it)."""
    model = tiny_model()
    old = build_optimizer(model, ocfg(name="muon", lr=1e-3, muon_lr=0.02), torch.device("cpu"))
    new = build_optimizer(model, ocfg(name="muon", lr=2e-3, muon_lr=0.03), torch.device("cpu"))
    new.load_state_dict(old.state_dict())
    assert [g["base_lr"] for g in new.param_groups] == [0.03, 2e-3, 2e-3]


def test_combined_optimizer_works_with_grad_scaler():
    """fp16 training drives the optimizer through GradScaler, which only needs param_groups and step."""
    model = tiny_model()
    opt = build_optimizer(model, ocfg(name="muon"), torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(lm_loss(model, fixed_batch())).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


# ----------------------------------------------------------------------------- the skip on the device


def _stepped(opt_factory, grads, found):
    """Parameters and optimizer state after one step per gradient, ``found[i]`` the bad flag."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(24, 16, generator=gen))
    opt = opt_factory([p])
    for g, bad in zip(grads, found):
        p.grad = g.clone()
        if bad is None:
            opt.step()
        else:
            with optim.skipped_if(opt, torch.tensor(float(bad))):
                opt.step()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
    return p.detach().clone(), state


OPTIMIZERS = {
    "fused adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "muon": lambda ps: Muon(ps, lr=0.02, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_bad_step_is_skipped_on_the_device_and_a_good_one_is_the_plain_step(name):
    """A NaN gradient under found_inf=1 leaves weights and state exactly as a run that never saw
    it; found_inf=0 is bitwise the plain step (the skip costs no numerics)."""
    gen = torch.Generator().manual_seed(1)
    g1, g2 = torch.randn(24, 16, generator=gen), torch.randn(24, 16, generator=gen)
    nan = torch.full((24, 16), float("nan"))
    make = OPTIMIZERS[name]
    plain_p, plain_s = _stepped(make, [g1, g2], [None, None])
    flagged_p, flagged_s = _stepped(make, [g1, g2], [0, 0])
    assert torch.equal(plain_p, flagged_p), (plain_p - flagged_p).abs().max()
    skipped_p, skipped_s = _stepped(make, [g1, nan, g2], [0, 1, 0])
    assert torch.isfinite(skipped_p).all()
    assert torch.equal(plain_p, skipped_p), (plain_p - skipped_p).abs().max()
    for k, v in plain_s.items():  # moments, momentum, AdamW's step count: as if the NaN step never came
        assert torch.equal(v, skipped_s[k]), (k, v, skipped_s[k])


def test_which_optimizers_skip_on_the_device():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    assert optim.skips_on_device(torch.optim.AdamW(p, fused=True))
    assert optim.skips_on_device(Muon(p))
    assert not optim.skips_on_device(torch.optim.AdamW(p, foreach=False))
    combined = CombinedOptimizer({"muon": Muon(p), "adamw": torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))],
                                                                                fused=True)})
    assert optim.skips_on_device(combined)
    assert not optim.skips_on_device(CombinedOptimizer({"muon": Muon(p), "adamw": torch.optim.AdamW(
        [torch.nn.Parameter(torch.ones(3))], foreach=False)}))


def test_adamw_is_fused_on_cpu_by_default():
    opt = build_optimizer(tiny_model(), ocfg(), torch.device("cpu"))
    assert opt.defaults.get("fused") is True and optim.skips_on_device(opt)
    assert not optim.skips_on_device(build_optimizer(tiny_model(), ocfg(fused="false"), torch.device("cpu")))
