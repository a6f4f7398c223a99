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


def test_mxfp8_is_refused_with_why_before_any_work():
    from flopwise.config import ConfigError
    with pytest.raises(ConfigError) as e:
        build_config("tiny", overrides=["train.fp8=true", "train.fp8_recipe=mxfp8"])
    [problem] = e.value.problems
    assert "train.fp8_recipe 'mxfp8': MXFP8 (sm100) is not offered" in problem and "choose tensorwise, rowwise" in problem


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
