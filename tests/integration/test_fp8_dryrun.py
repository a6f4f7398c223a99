"""Issue 52, item 2: the fp8 step (``train.fp8``, torchao's float8 linears) traced on fake tensors
and predicted: its scaled matmuls recorded as matmuls and priced at the GPU's fp8 rate, the
casts and scalings around them as the memory-bound kernels they are."""

from __future__ import annotations

import json

import pytest
from helpers import matmul_result

from flopwise.config import build_config
from flopwise.plan import steptime
from flopwise.tune.predict import predicted, render


def test_a_scaled_matmul_is_priced_at_the_fp8_rate():
    cfg = build_config("tiny")
    bf16 = predicted(matmul_result("H100 SXM", "bfloat16", 8192), cfg)
    fp8 = predicted(matmul_result("H100 SXM", "float8_e4m3fn", 8192), cfg)
    g = steptime.gpu("H100 SXM")
    expected = (g.peak["float8_e4m3fn"] * g.fp8_fraction) / (g.peak["bfloat16"] * g.gemm_fraction)
    ratio = bf16["breakdown"]["matmul"] / fp8["breakdown"]["matmul"]
    assert ratio == pytest.approx(expected, rel=1e-6), (ratio, expected)  # 1979 x 0.624 / (989.4 x 0.753)
    assert fp8["fp8"] == {"matmuls": 4, "of": 4} and "derived" not in fp8  # measured on the H100 itself
    assert any("predicted with 4 of 4 matmuls in fp8" in line for line in render(fp8))


def test_fp8_on_a_part_measured_only_in_bf16_says_derived_and_one_without_an_fp8_rate_is_not_predicted():
    cfg = build_config("tiny")
    ada = predicted(matmul_result("RTX 4090", "float8_e4m3fn"), cfg)
    assert ada["predicted"] and any("fp8 matmul rate: its bf16 share" in d for d in ada["derived"]), ada
    assert not any("fp8" in d for d in predicted(matmul_result("RTX 4090", "bfloat16"), cfg).get("derived", []))
    a100 = predicted(matmul_result("A100 SXM 80GB", "float8_e4m3fn"), cfg)
    assert a100 == {"predicted": False, "why": "A100 SXM 80GB has no fp8 matmul rate: its fp8 matmuls are not "
                                               "predicted"}, a100


def test_mxfp8_converts_the_blocks_linears_and_computes_what_bf16_does(monkeypatch):
    """MXFP8 (``train.fp8_recipe=mxfp8``): every block linear's weight is wrapped so its matmuls
    cast to float8 with a scale per 32 values; the LM head is not. The wrapper's numbers are
    checked on this CPU by torchao's emulated GEMM (a bf16 matmul of the dequantized values) after
    the casts the dry run traces (``fake.mxfp8_linear_torch_casts``): the logits stay within
    MXFP8's rounding of bf16's."""
    pytest.importorskip("torchao")
    import torch
    import torchao.prototype.moe_training.tensor as wrapper

    from flopwise.tune.fake import mxfp8_linear_torch_casts
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    from flopwise.model.transformer import build_model
    from flopwise.train.precision import _apply_mxfp8

    cfg = build_config("tiny", overrides=["model.d_model=64", "model.n_heads=2", "model.n_kv_heads=2",
                                          "model.ffn_hidden=128"])
    # bf16 weights on both sides: the emulated GEMM dequantizes each side to its own dtype, where
    # cuBLAS's block-scaled GEMM takes fp8 either way (autocast's fp32 weights included)
    reference, model = (build_model(cfg.model, seed=3).to(torch.bfloat16) for _ in range(2))
    note = _apply_mxfp8(model)
    wrapped = [n for n, p in model.named_parameters() if type(p).__name__ == "MXFP8TrainingWeightWrapperTensor"]
    linears = [n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert wrapped == [n for n in linears if n.startswith("layers.")] and wrapped, (wrapped, linears)
    assert f"fp8: {len(wrapped)} linear layers in MXFP8" in note, note
    monkeypatch.setattr(wrapper, "_to_mxfp8_then_scaled_mm", mxfp8_linear_torch_casts)  # no Triton here
    emulated = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    for name, p in model.named_parameters():
        if name in wrapped:
            p.config = emulated  # torchao's reference kernels: this CPU has no block-scaled GEMM
    x = torch.randint(0, cfg.model.vocab_size, (2, 32))
    want, got = reference(x).float(), model(x).float()
    got.sum().backward()
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < 0.1, err  # changed (the casts ran) but by rounding only
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_mxfp8_is_refused_before_any_work_on_a_gpu_without_sm100(cli):
    pytest.importorskip("torchao")
    for gpu, cap in (("h100", "9.0"), ("rtx-5090", "12.0")):
        proc = cli("preflight", "--dry-run", "--preset", "tiny", "--gpu", gpu, "train.fp8=true",
                   "train.fp8_recipe=mxfp8")
        assert proc.returncode != 0, gpu
        assert (f"train.fp8_recipe=mxfp8 needs a Blackwell data-centre GPU (compute capability 10.x: B200, GB200, "
                f"B300), this GPU has {cap}: choose tensorwise or rowwise") in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_the_mxfp8_step_is_traced_on_a_b200_and_predicted(cli):
    """MXFP8 on a B200: the block-scaled matmuls priced at the fp8 rate, the casts (torchao's
    to_mx, traced for its Triton and CUDA cast kernels) fused by compile, one graph, no syncs the
    bf16 step does not have."""
    pytest.importorskip("torchao")
    base = ["preflight", "--dry-run", "--preset", "smollm-135m", "--gpu", "b200", "model.n_layers=2",
            "train.micro_batch_size=2", "train.compile=model", "--json"]
    runs = {}
    for name, extra in (("bf16", []), ("mxfp8", ["train.fp8=true", "train.fp8_recipe=mxfp8"])):
        proc = cli(*base, *extra)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        runs[name] = json.loads(proc.stdout)
    p, bf16 = runs["mxfp8"]["prediction"], runs["bf16"]["prediction"]
    assert runs["mxfp8"]["fp8"] == "mxfp8" and p["predicted"], p
    assert p["fp8"]["matmuls"] >= 2 * 4 * 3, p["fp8"]  # 2 blocks x (qkv, o, gate-up or gate and up, down) x 3
    assert p["breakdown"]["matmul"] < bf16["breakdown"]["matmul"], (p["breakdown"], bf16["breakdown"])
    assert p["breakdown"]["memory"] > bf16["breakdown"]["memory"], "the casts are memory-bound work"
    steps = runs["mxfp8"]["trace"]["compiled"]["per_step"]
    assert all(s == {"graphs": 1, "graph_breaks": 0} for s in steps), steps
    assert runs["mxfp8"]["trace"]["syncs"] == runs["bf16"]["trace"]["syncs"]
    assert any("in MXFP8" in n for n in runs["mxfp8"]["trace"]["notes"]["speed"]), runs["mxfp8"]["trace"]["notes"]


@pytest.mark.slow
def test_the_fp8_step_is_traced_with_torchao_and_predicted(cli):
    pytest.importorskip("torchao")
    base = ["preflight", "--dry-run", "--preset", "smollm-135m", "--gpu", "h100", "model.n_layers=4",
            "train.micro_batch_size=4", "train.compile=model", "--json"]
    runs = {}
    for name, extra in (("bf16", []), ("tensorwise", ["train.fp8=true"]),
                        ("rowwise", ["train.fp8=true", "train.fp8_recipe=rowwise"])):
        proc = cli(*base, *extra)
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        runs[name] = json.loads(proc.stdout)
    assert runs["bf16"]["fp8"] is None and runs["tensorwise"]["fp8"] == "tensorwise"
    for name in ("tensorwise", "rowwise"):
        p = runs[name]["prediction"]
        assert p["predicted"] and p["fp8"]["matmuls"] > 0, (name, p)
        # 4 blocks x (q, k, v merged or not, o, gate/up, down): forward and both backward GEMMs in fp8
        assert p["fp8"]["matmuls"] >= 4 * 4 * 3, p["fp8"]
        assert p["breakdown"]["matmul"] < runs["bf16"]["prediction"]["breakdown"]["matmul"], name
    for name in ("tensorwise", "rowwise"):  # compile takes torchao's float8 step whole: one graph, no break
        steps = runs[name]["trace"]["compiled"]["per_step"]
        assert all(s == {"graphs": 1, "graph_breaks": 0} for s in steps), (name, steps)
        assert runs[name]["trace"]["syncs"] == runs["bf16"]["trace"]["syncs"], (name, runs[name]["trace"]["syncs"])


@pytest.mark.slow
def test_fp8_on_a_gpu_without_fp8_is_refused_in_one_line(cli):
    pytest.importorskip("torchao")
    proc = cli("preflight", "--dry-run", "--preset", "tiny", "--gpu", "a100", "train.fp8=true")
    assert proc.returncode != 0
    assert "train.fp8=true needs compute capability 8.9+ (Ada/Hopper), this GPU has 8.0" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_fsdp2_fp8_all_gathers_use_the_scales_precomputed_after_the_update(cli):
    """Tensorwise fp8 under FSDP2 all-gathers fp8 weights, cast with scales from each weight's amax
    over the ranks. Without torchao's precompute after the update every weight reduced its own
    amax before each all-gather: 64 tiny all-reduces in this traced step (4 blocks x 4 linears x 2
    micro-batches x forward and backward gathers). With it the gathers use the precomputed scales:
    none. (The precompute's own single all-reduce, on DTensors, is not seen by the trace.)"""
    pytest.importorskip("torchao")
    proc = cli("preflight", "--dry-run", "--preset", "smollm-135m", "--gpu", "h100", "--nproc-per-node", "4",
               "parallel.strategy=fsdp2", "train.fp8=true", "train.compile=off", "model.n_layers=4",
               "train.micro_batch_size=2", "train.global_batch_size=16", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    calls = json.loads(proc.stdout)["trace"]["collectives"]
    per_weight = sum(v["calls"] for k, v in calls.items() if k.startswith("all_reduce"))
    assert per_weight == 0, calls  # was 64 before the precompute
    assert calls["_allgather_base_"]["calls"] > 0, calls
