"""flopwise plan's arithmetic, against hand-computed examples."""

import json
import math

import pytest

from flopwise.config import build_config
from flopwise.plan import hardware
from flopwise.plan.budget import (
    PlanError,
    PlanInputs,
    allreduce_seconds,
    build_plan,
    chinchilla_verdict,
    memory_settings_for_run,
    plan_for_run,
    plan_inputs_for_run,
)
from flopwise.plan.memory import MemorySettings, estimate

A100 = hardware.find("a100")
H100 = hardware.find("h100 sxm")
SMOLLM_360M = build_config(preset="smollm-360m").model
# By hand: N_matmul = 361,821,120 total - 62,400 norm weights = 361,758,720 (tied head once);
# attention 12 * 32 layers * 960 * 2048 = 754,974,720.
SMOLLM_360M_FPT = 6 * 361_758_720 + 754_974_720  # 2,925,527,040 FLOPs per token at seq 2048


def test_time_and_cost_smollm_360m_6b_tokens_one_a100():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, mfu=0.40, tokens=6_000_000_000,
                                 price_per_gpu_hour=2.0, seq_len=2048))
    assert plan["flops_per_token"] == SMOLLM_360M_FPT == 2_925_527_040
    assert plan["total_flops"] == pytest.approx(6e9 * SMOLLM_360M_FPT)
    assert plan["effective_flops"] == pytest.approx(312e12 * 0.40)
    hours = 6e9 * SMOLLM_360M_FPT / (312e12 * 0.40) / 3600
    assert hours == pytest.approx(39.07, abs=0.01)
    assert plan["hours"] == pytest.approx(hours)
    assert plan["gpu_hours"] == pytest.approx(hours)
    assert plan["cost"] == pytest.approx(2.0 * hours)


def test_hours_give_affordable_tokens_and_a_chinchilla_verdict():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, mfu=0.40, hours=30, seq_len=2048))
    tokens = 30 * 3600 * 312e12 * 0.40 / SMOLLM_360M_FPT
    assert plan["tokens"] == pytest.approx(tokens)  # ~4.61B
    assert plan["chinchilla_tokens"] == 20 * 361_821_120
    assert plan["chinchilla_ratio"] == pytest.approx(tokens / (20 * 361_821_120))  # ~0.64
    assert plan["verdict"].startswith("0.64x the compute-optimal tokens (20 per parameter): under-trained (0.5x to 0.9x)")
    assert plan["hours"] == pytest.approx(30) == plan["compute_hours"]  # one GPU: no communication


def test_the_6n_calculator_is_reproduced_exactly():
    # The simple calculator: 6 x params x tokens / (peak x GPUs x MFU).
    plan = build_plan(PlanInputs(params=8_000_000_000, gpu=H100, gpus=8, mfu=0.40, tokens=10**12,
                                 flops_formula="6n"))
    seconds = 6 * 8e9 * 1e12 / (989.4e12 * 8 * 0.40)
    # the MFU is end-to-end (issue 54, item 4): the wall time is the calculator's, at any GPU count
    assert plan["hours"] == plan["compute_hours"] == pytest.approx(seconds / 3600, rel=1e-12)  # 4,211 hours
    assert plan["gpu_hours"] == pytest.approx(8 * seconds / 3600, rel=1e-12)
    # ... and with a model, 6n uses all parameters (embedding included):
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, tokens=10**9, flops_formula="6n"))
    assert plan["flops_per_token"] == 6 * 361_821_120


def test_chinchilla_option_and_verdicts():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, chinchilla=True))
    assert plan["tokens"] == 20 * 361_821_120 and plan["chinchilla_ratio"] == pytest.approx(1.0)
    assert chinchilla_verdict(1e9, 1e9, 6e18).startswith("0.05x the compute-optimal tokens (20 per parameter): "
                                                         "far under-trained (below 0.5x)")
    # compute-optimal size for C = 6e18: sqrt(6e18 / 120) = 2.24e8
    assert "~224M-parameter" in chinchilla_verdict(1e9, 1e9, 6e18)
    assert "far over-trained (above 2x)" in chinchilla_verdict(1e12, 1e9, 6e21)


def test_ring_allreduce_arithmetic():
    assert allreduce_seconds(1e9, 1, 100) == 0.0
    assert allreduce_seconds(1e9, 2, 100) == pytest.approx(2 * 0.5 * 1e9 / 100e9)
    assert allreduce_seconds(1e9, 8, 100) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)


def test_scaling_gradient_bytes_links_and_efficiency():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, gpus=8, mfu=0.4, tokens=6e9, seq_len=2048,
                                 micro_batch=8, grad_accum=4, memory=MemorySettings(strategy="ddp", n_gpus=8)))
    at = plan["scaling"]["at_gpus"]
    grad_bytes = 361_821_120 * 4  # fp32 gradients under bf16 autocast
    assert at["grad_bytes"] == grad_bytes and at["link"] == "nvlink3"  # A100 SXM default
    assert at["comm_s"] == pytest.approx(2 * 7 / 8 * grad_bytes / 300e9)
    tokens_per_step = 8 * 4 * 8 * 2048
    compute = tokens_per_step * SMOLLM_360M_FPT / (8 * 312e12 * 0.4)
    # the step at the MFU holds its communication: the estimate is a share of it, not added to it
    assert at["step_s"] == pytest.approx(compute) and at["efficiency"] is None
    assert at["comm_share"] == pytest.approx(at["comm_s"] / compute) and at["comm_exceeds_mfu"] is False
    assert plan["hours"] == pytest.approx(6e9 * SMOLLM_360M_FPT / (8 * 312e12 * 0.4) / 3600)
    assert plan["comm_hours"] == pytest.approx(plan["batch"]["steps"] * at["comm_s"] / 3600)
    # Over PCIe the same run's communication takes more of its step; across nodes the slower network sets the pace.
    pcie = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, gpus=8, tokens=6e9, micro_batch=8, grad_accum=4,
                                 interconnect="pcie4", memory=MemorySettings(strategy="ddp", n_gpus=8)))
    assert pcie["scaling"]["at_gpus"]["comm_share"] > at["comm_share"]
    two_nodes = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, gpus=16, tokens=6e9, micro_batch=8,
                                      grad_accum=2, network="ib-hdr", memory=MemorySettings(strategy="ddp", n_gpus=16)))
    assert two_nodes["scaling"]["at_gpus"]["link"] == "ib-hdr"
    # More accumulation amortises the same all-reduce over more compute.
    more_accum = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, gpus=8, tokens=6e9, micro_batch=8,
                                       grad_accum=16, memory=MemorySettings(strategy="ddp", n_gpus=8)))
    assert more_accum["scaling"]["at_gpus"]["comm_share"] < at["comm_share"]


def test_batch_recommendation_is_consistent_with_memory():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, seq_len=2048, target_batch_tokens=524_288))
    b = plan["batch"]
    assert b["micro_batch"] <= plan["max_micro_batch"]
    assert b["micro_batch"] & (b["micro_batch"] - 1) == 0  # a power of two
    assert b["global_batch"] == b["micro_batch"] * b["grad_accum"]
    assert 250_000 <= b["tokens_per_step"] <= 1_000_000
    assert plan["fits"] is True


def test_memory_question_fits_or_not():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, seq_len=512, micro_batch=64))
    assert plan["fits"] == (plan["memory_gb"] <= 0.9 * 80)
    assert set(plan["memory_variants"]) == {"sdpa", "eager", "sdpa+checkpointing"}
    v = plan["memory_variants"]
    assert v["eager"]["total_gb"] > v["sdpa"]["total_gb"] > v["sdpa+checkpointing"]["total_gb"]
    huge = build_plan(PlanInputs(model=SMOLLM_360M, memory_gb=8, seq_len=4096 * 0 + 2048, micro_batch=512,
                                 target_batch_tokens=2048 * 512))
    assert huge["fits"] is False


def test_json_has_the_documented_keys_and_serialises():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, tokens=6e9, price_per_gpu_hour=1.5))
    for key in ("params", "flops_per_token", "total_flops", "tokens", "chinchilla_tokens", "hours", "gpu_hours",
                "cost", "memory_gb", "memory", "fits", "batch", "scaling", "params_breakdown"):
        assert key in plan, key
    for key in ("params", "grads", "optimizer", "activations", "total"):
        assert key in plan["memory"], key
    assert json.loads(json.dumps(plan))["params"] == 361_821_120
    assert all(not isinstance(v, float) or math.isfinite(v) for v in plan.values())


@pytest.mark.parametrize("kwargs, flag", [
    ({"hours": -3}, "--hours"),
    ({"mfu": 1.5}, "--mfu"),
    ({"mfu": 0}, "--mfu"),
    ({"tokens": 10**9, "hours": 5}, "--tokens and --hours were both given"),
    ({"gpus": 0}, "--gpus"),
    ({"interconnect": "nvlink9"}, "--interconnect 'nvlink9'"),
    ({"seq_len": 100_000}, "--seq-len 100000 exceeds"),
])
def test_bad_input_names_the_flag(kwargs, flag):
    with pytest.raises(PlanError, match=flag):
        build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, **kwargs))


def test_network_rates_in_gbit_are_links():
    """``--network 25gbit`` is the table's eth-25g (one link, two names); any ``<N>gbit`` is
    N/8 GB/s; anything else is refused in one line that names the choices."""
    eth25 = hardware.LINKS["eth-25g"]
    for name in ("25gbit", "25Gbit", "25 gbit/s", "25.0gbit", "eth-25g"):
        assert hardware.find_link(name) is eth25, name
    assert hardware.find_link("400gbit") is hardware.LINKS["ib-ndr"]
    assert hardware.find_link("100gbit") is hardware.LINKS["eth-100g"]
    ten = hardware.find_link("10gbit")
    assert ten is not None and ten.gb_per_s == 10 / 8 and ten.name == "10gbit"
    assert hardware.find_link("800gbit").gb_per_s == 100.0
    for bad in ("25gb", "gbit", "0gbit", "-5gbit", "eth-25", ""):
        assert hardware.find_link(bad) is None, bad
    # planned alike under either name
    inp = dict(model=SMOLLM_360M, gpu=A100, gpus=16, tokens=6e9, micro_batch=8, grad_accum=2,
               memory=MemorySettings(strategy="ddp", n_gpus=16))
    alias, name = build_plan(PlanInputs(network="25gbit", **inp)), build_plan(PlanInputs(network="eth-25g", **inp))
    assert alias["scaling"] == name["scaling"] and alias["scaling"]["at_gpus"]["link"] == "eth-25g"
    assert alias["scaling"]["at_gpus"]["comm_s"] == pytest.approx(2 * 15 / 16 * 361_821_120 * 4 / 3.125e9)
    with pytest.raises(PlanError) as e:
        build_plan(PlanInputs(network="25gbps", **inp))
    message = str(e.value)
    assert "--network '25gbps' is not known; choose one of" in message and "\n" not in message
    assert "eth-25g" in message and "ib-ndr" in message and "<N>gbit" in message


def test_raw_params_need_6n_and_one_model_description():
    with pytest.raises(PlanError, match="--flops-formula palm needs the model's shape"):
        build_plan(PlanInputs(params=10**9, flops_formula="palm"))
    with pytest.raises(PlanError, match="give one"):
        build_plan(PlanInputs(model=SMOLLM_360M, params=10**9))


# --- issue 19: a set-up that does not fit is not priced as if it ran --------------------------------------------

def _eight_b(strategy="ddp", auto=False):
    return PlanInputs(params=8_000_000_000, gpu=H100, gpus=8, tokens=160 * 10**9, flops_formula="6n",
                      price_per_gpu_hour=2.0, memory=MemorySettings(strategy=strategy, n_gpus=8),
                      auto_strategy=auto)


def test_ddp_that_does_not_fit_is_marked_not_runnable_and_fsdp_proposed():
    plan = build_plan(_eight_b("ddp"))
    # 16 bytes per parameter replicated: 8e9 * 16 B = 119.2 GiB > 0.9 * 80 GiB
    assert plan["memory_gb"] == pytest.approx(8e9 * 16 / 2**30) and plan["fits"] is False
    assert plan["runnable"] is False
    fit = plan["fit"]
    assert fit["asked"] == "ddp" and fit["asked_fits"] is False and fit["proposed"] == "fsdp2"
    assert not fit["switched"] and fit["states_only"]
    assert fit["per_strategy"]["fsdp2"]["memory_gb"] == pytest.approx(8e9 * 16 / 8 / 2**30)
    assert fit["per_strategy"]["fsdp2"]["fits"] and fit["per_strategy"]["zero1"]["fits"]
    assert plan["scaling"]["strategy"] == "ddp"  # as asked, but marked


def test_default_strategy_switches_to_the_one_that_fits():
    plan = build_plan(_eight_b("ddp", auto=True))
    assert plan["fits"] is True and plan["runnable"] is True
    assert plan["fit"]["switched"] and plan["fit"]["asked"] == "ddp" and plan["fit"]["strategy"] == "fsdp2"
    assert plan["memory"]["settings"]["strategy"] == "fsdp2" and plan["scaling"]["strategy"] == "fsdp2"
    assert plan["memory_gb"] == pytest.approx(8e9 * 16 / 8 / 2**30)  # 14.9 GiB per GPU
    # the wall time at an assumed MFU does not depend on the strategy (the MFU holds the
    # communication); the communication estimate inside it does
    asked = build_plan(_eight_b("ddp"))
    assert plan["hours"] == pytest.approx(asked["hours"]) and plan["cost"] == pytest.approx(asked["cost"])
    assert plan["comm_hours"] != pytest.approx(asked["comm_hours"])
    # --params counts states only, and says so
    assert plan["memory"]["activations"] is None and "NOT counted" in plan["memory"]["counted"]


def test_a_plan_that_fits_is_left_alone():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=A100, gpus=8, tokens=6e9, auto_strategy=True,
                                 memory=MemorySettings(strategy="ddp", n_gpus=8)))
    assert plan["fits"] and plan["runnable"] and not plan["fit"]["switched"]
    assert plan["fit"]["proposed"] is None and plan["scaling"]["strategy"] == "ddp"


def test_with_a_model_the_first_strategy_that_fits_is_taken():
    # llama3.2-1b on 4 x 24 GiB: ddp needs ~28 GiB even at micro-batch 1, zero1 fits.
    model = build_config(preset="llama3.2-1b").model
    rtx = hardware.find("rtx 4090")
    inp = dict(model=model, gpu=rtx, gpus=4, chinchilla=True, seq_len=2048)
    plan = build_plan(PlanInputs(**inp, memory=MemorySettings(strategy="ddp", n_gpus=4), auto_strategy=True))
    assert plan["fit"]["asked_fits"] is False and plan["fit"]["strategy"] == "zero1" and plan["fits"]
    one = build_plan(PlanInputs(**{**inp, "gpus": 1}))  # one GPU: nothing to switch to
    assert one["fits"] is False and one["runnable"] is False and one["fit"]["proposed"] is None


def test_memory_gb_overrides_the_table():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=H100, memory_gb=16, seq_len=2048))
    assert plan["gpu"]["memory_gb"] == 16 and plan["gpu"]["memory_source"] == "--memory-gb"
    assert plan["gpu"]["peak_tflops"] == 989.4  # the peak stays the card's
    full = build_plan(PlanInputs(model=SMOLLM_360M, gpu=H100, seq_len=2048))
    assert plan["max_micro_batch"] < full["max_micro_batch"]


def test_a100_40gb_plans_against_40_gib():
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=hardware.find("a100-40gb"), seq_len=2048))
    assert plan["gpu"]["name"] == "A100 SXM 40GB" and plan["gpu"]["memory_gb"] == 40
    assert plan["gpu"]["peak_tflops"] == 312.0


# --- one vocabulary: a run's configuration is planned as it runs ------------------------------------------------

def test_memory_settings_for_run_keep_fp16_and_selective():
    """fp16 is fp16 autocast (fp32 weights, 2-byte activations), not float32; selective
    checkpointing is selective with its every-k, not none."""
    cfg = build_config(preset="smollm-135m", overrides=[
        "train.precision=fp16", "train.activation_checkpointing=selective",
        "train.activation_checkpointing_every=3", "model.attention=eager"])
    s = memory_settings_for_run(cfg, "fp16", "fused", "fsdp2", 4)
    assert (s.precision, s.activation_checkpointing, s.activation_checkpointing_every) == ("fp16", "selective", 3)
    assert (s.strategy, s.n_gpus, s.loss, s.attention) == ("fsdp2", 4, "chunked", "eager")
    m, B, T = cfg.model, 4, 512
    fp16 = estimate(m, B, T, replace_settings(s, strategy="single", n_gpus=1))
    fp32 = estimate(m, B, T, replace_settings(s, strategy="single", n_gpus=1, precision="float32"))
    bf16 = estimate(m, B, T, replace_settings(s, strategy="single", n_gpus=1, precision="bf16"))
    none = estimate(m, B, T, replace_settings(s, strategy="single", n_gpus=1, activation_checkpointing="none"))
    assert fp16.total == bf16.total < fp32.total  # fp16 autocast is bf16 autocast's size
    assert fp16.params == fp32.params  # fp32 master weights
    assert fp16.activations < none.activations


def replace_settings(s, **kw):
    import dataclasses

    return dataclasses.replace(s, **kw)


def test_plan_inputs_for_run_take_everything_from_the_config():
    cfg = build_config(preset="smollm-360m", overrides=[
        "train.seq_len=2048", "train.micro_batch_size=4", "train.global_batch_size=64", "train.max_tokens=1e9",
        "train.precision=fp16", "train.activation_checkpointing=selective", "train.loss=chunked",
        "parallel.strategy=zero1", "train.peak_tflops=100"])
    fields, notes = plan_inputs_for_run(cfg, gpus=2)
    assert notes == []
    assert (fields["seq_len"], fields["micro_batch"], fields["grad_accum"]) == (2048, 4, 8)
    assert fields["tokens"] == cfg.total_steps() * 64 * 2048 and fields["peak_tflops"] == 100
    assert fields["dtype"] == "fp16" and not fields["auto_strategy"]
    mem = fields["memory"]
    assert (mem.precision, mem.activation_checkpointing, mem.loss, mem.strategy, mem.n_gpus) == (
        "fp16", "selective", "chunked", "zero1", 2)
    plan = build_plan(PlanInputs(gpu=A100, gpus=2, **fields))
    assert plan["batch"]["global_batch"] == 64 and plan["memory"]["settings"]["precision"] == "fp16"
    assert plan["flops_per_token_hardware"] > plan["flops_per_token"]  # the recomputed blocks
    # auto is resolved as the trainer would, and says so
    auto = build_config(preset="smollm-360m", overrides=["train.seq_len=2048"])
    fields, notes = plan_inputs_for_run(auto, gpus=1, gpu=hardware.find("v100"))
    assert fields["memory"].precision == "fp16" and fields["memory"].loss == "plain" and fields["auto_strategy"]
    assert any("train.precision=auto is fp16 on the V100" in n for n in notes)
    assert any("train.loss=auto is plain under train.compile=auto" in n for n in notes)  # compiled on a GPU
    with pytest.raises(PlanError, match="global_batch_size"):
        plan_inputs_for_run(auto, gpus=3)


def test_the_planners_old_names_still_work_with_a_warning():
    with pytest.warns(FutureWarning) as caught:
        s = MemorySettings(precision="bf16-amp", strategy="fsdp", n_gpus=2)
    assert [str(w.message) for w in caught] == ["MemorySettings precision 'bf16-amp' is now called bf16",
                                                "MemorySettings strategy 'fsdp' is now called fsdp2"]
    assert (s.precision, s.strategy) == ("bf16", "fsdp2")
    with pytest.warns(FutureWarning, match="fp32"):
        assert MemorySettings(precision="fp32").precision == "float32"


def test_plan_for_run_uses_the_precisions_peak():
    cfg = build_config(overrides=["train.precision=fp16"])
    plan = plan_for_run(cfg, "Tesla V100-SXM2-32GB", "fp16")
    assert plan["gpu"]["dtype"] == "fp16" and plan["memory"]["settings"]["precision"] == "fp16"


def test_hours_are_the_wall_time_the_user_gave():
    """Issue 45, item 7, as issue 54, item 4 defines the MFU: --hours 6 over 8 GPUs is the wall
    time; the tokens are what 6 h at the end-to-end MFU affords, and what is priced is those 6 h.
    The communication estimate is a part of them, not taken out of them again."""
    plan = build_plan(PlanInputs(model=SMOLLM_360M, gpu=H100, gpus=8, hours=6, price_per_gpu_hour=2.0,
                                 memory=MemorySettings(strategy="ddp", n_gpus=8)))
    at = plan["scaling"]["at_gpus"]
    assert plan["tokens"] == pytest.approx(6 * 3600 * 989.4e12 * 8 * 0.40 / SMOLLM_360M_FPT)
    assert plan["hours"] == 6 and plan["compute_hours"] == pytest.approx(6)
    assert plan["comm_hours"] == pytest.approx(plan["batch"]["steps"] * at["comm_s"] / 3600)
    assert 0 < plan["comm_hours"] < 6
    assert plan["gpu_hours"] == 48 and plan["cost"] == 96
