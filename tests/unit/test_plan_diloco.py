"""`flopwise plan --strategy diloco`: DiLoCo's communication, the smallest H under a share of the
step, its memory, and that no strategy search ever picks it -- against hand-computed numbers."""

import math

import pytest

from flopwise.config import build_config
from flopwise.plan import hardware
from flopwise.plan.budget import (
    GIB,
    STRATEGY_ORDER,
    PlanInputs,
    build_plan,
    diloco_comm,
    memory_settings_for_run,
    plan_for_run,
    smallest_inner_steps,
)
from flopwise.plan.memory import MemorySettings, outer_state_bytes

P = 1_000_000  # parameters


def small(**kw) -> PlanInputs:
    """1M parameters (6N: 6e6 FLOPs/token) on 8 GPUs of 100 TFLOP/s at 50% MFU, 4 to a node
    (NVLink 4, 450 GB/s, inside), 25 Gbit/s between nodes; micro-batch 2 x 3 accumulation x
    seq 1000: 48,000 tokens a step, H = 10."""
    base = dict(params=P, flops_formula="6n", peak_tflops=100, mfu=0.5, gpus=8, gpus_per_node=4, interconnect="nvlink4",
                network="25gbit", seq_len=1000, micro_batch=2, grad_accum=3, inner_steps=10,
                memory=MemorySettings(strategy="diloco", n_gpus=8))
    return PlanInputs(**{**base, **kw})


# By hand, for small():
COMPUTE = 48_000 * 6e6 / (8 * 100e12 * 0.5)  # 7.2e-4 s per step on every GPU
INNER = 2 * 3 / 4 * (P * 4) / 450e9  # ddp over the 4 GPUs of a group: fp32 gradients, ring: 1.33e-5 s
CROSS = 2 * 1 / 2 * (P * 4) / 3.125e9  # the fp32 pseudo-gradient, ring over G = 2 groups at 25/8 GB/s: 1.28e-3 s
GATHER = 3 / 4 * (P * 4) / 450e9  # the group all-gathers the pieces: 6.67e-6 s
OUTER = CROSS + GATHER


def share(comm: float) -> float:
    return comm / (COMPUTE + comm)


def test_outer_allreduce_bytes_and_seconds_by_hand():
    plan = build_plan(small())
    d = plan["diloco"]
    assert (d["group_size"], d["groups"], d["inner_steps"], d["inner_strategy"]) == (4, 2, 10, "ddp")
    assert d["pseudo_gradient_bytes"] == 4_000_000
    ar = d["outer_allreduce"]
    assert ar["link"] == "eth-25g" and ar["link_gb_per_s"] == 3.125  # 25gbit is eth-25g
    assert ar["bytes"] == 4_000_000  # 2 (G-1)/G x 4 MB with G = 2
    assert ar["s"] == pytest.approx(1.28e-3) == pytest.approx(CROSS)
    ag = d["outer_allgather"]
    assert ag["link"] == "nvlink4" and ag["bytes"] == 3_000_000 and ag["s"] == pytest.approx(GATHER)
    assert d["inner"]["comm_s"] == pytest.approx(INNER) and d["inner"]["link"] == "nvlink4"
    assert d["compute_s"] == pytest.approx(7.2e-4)
    # per inner step: the group's own communication and a tenth of the outer sync
    assert d["comm_s"] == pytest.approx(INNER + OUTER / 10)
    assert d["comm_share"] == pytest.approx(share(INNER + OUTER / 10))
    # the plan's scaling at its GPUs is DiLoCo's, and so is the time with communication
    assert plan["scaling"]["at_gpus"]["comm_s"] == pytest.approx(d["comm_s"])
    # ddp and fsdp2 at the same 8 GPUs cross the 25 Gbit/s network every step
    ddp, fsdp2 = d["compare"]["ddp"], d["compare"]["fsdp2"]
    assert ddp["link"] == fsdp2["link"] == "eth-25g"
    assert ddp["comm_s"] == pytest.approx(2 * 7 / 8 * P * 4 / 3.125e9)
    # fsdp2: two bf16 all-gathers per micro-batch (3 of them) and one fp32 reduce-scatter
    assert fsdp2["comm_s"] == pytest.approx(7 / 8 * P * (2 * 2 * 3 + 4) / 3.125e9)
    assert ddp["comm_share"] == pytest.approx(share(ddp["comm_s"]))
    # bf16 pseudo-gradients halve the outer sync
    half = build_plan(small(memory=MemorySettings(strategy="diloco", n_gpus=8, outer_dtype="bf16")))["diloco"]
    assert half["outer_s"] == pytest.approx(OUTER / 2)


def test_the_threshold_is_the_smallest_h_under_the_share():
    d = build_plan(small())["diloco"]
    # 5% of the step leaves 0.05/0.95 x compute for communication; the group's takes INNER of it,
    # the outer sync may take the rest: H >= OUTER / (0.05/0.95 x COMPUTE - INNER) = 52.4
    assert OUTER / (0.05 / 0.95 * COMPUTE - INNER) == pytest.approx(52.39, abs=0.01)
    h = d["min_inner_steps"]
    assert h == 53
    assert share(INNER + OUTER / h) <= 0.05 < share(INNER + OUTER / (h - 1))
    assert d["at_min_inner_steps"]["comm_share"] == pytest.approx(share(INNER + OUTER / 53))
    assert d["below_min_inner_steps"]["inner_steps"] == 52
    # a looser target needs fewer inner steps
    assert build_plan(small(comm_share=0.10))["diloco"]["min_inner_steps"] < h


def test_smallest_inner_steps_meets_the_share_and_one_less_does_not():
    # inner 1, outer 100, compute 100, 5%: 100 / (5.263 - 1) = 23.5 -> 24
    assert smallest_inner_steps(1.0, 100.0, 100.0, 0.05) == 24
    for inner, outer, compute, target in ((1.0, 100.0, 100.0, 0.05), (0.0, 3.0, 10.0, 0.2), (0.5, 7.0, 3.0, 0.3),
                                          (2e-3, 0.9, 0.25, 0.05), (0.0, 1e-9, 1.0, 0.01)):
        h = smallest_inner_steps(inner, outer, compute, target)
        assert h is not None and h >= 1

        def s(k: int, inner=inner, outer=outer, compute=compute) -> float:
            return (inner + outer / k) / (compute + inner + outer / k)
        assert s(h) <= target, (inner, outer, compute, target)
        assert h == 1 or s(h - 1) > target, (inner, outer, compute, target)
    # the in-group communication alone over the share: no H is enough
    assert smallest_inner_steps(10.0, 100.0, 100.0, 0.05) is None
    # one group (nothing to reduce across): H = 1 when the in-group share fits, else none
    assert smallest_inner_steps(1.0, 0.0, 100.0, 0.05) == 1
    assert smallest_inner_steps(10.0, 0.0, 100.0, 0.05) is None
    assert smallest_inner_steps(1.0, 100.0, None, 0.05) is None  # no peak, no compute time


def test_in_group_communication_over_the_share_means_no_h():
    # PCIe 3 inside the node: ddp over 4 GPUs takes 6e6 B / 16 GB/s = 0.375 ms of a 0.72 ms step
    d = build_plan(small(interconnect="pcie3"))["diloco"]
    assert d["inner"]["comm_s"] == pytest.approx(2 * 3 / 4 * P * 4 / 16e9)
    assert d["min_inner_steps"] is None and d["at_min_inner_steps"] is None
    assert "in-group communication alone" in d["none_reason"] and "exceeds 5%" in d["none_reason"]
    # no peak: no compute time to take a share of
    none = build_plan(small(peak_tflops=0))["diloco"]
    assert none["min_inner_steps"] is None and "no compute time" in none["none_reason"]


def test_one_group_and_fsdp2_inside():
    # 4 GPUs, one node: one group, no outer communication at all
    d = build_plan(small(gpus=4, memory=MemorySettings(strategy="diloco", n_gpus=4)))["diloco"]
    assert (d["groups"], d["outer_s"], d["min_inner_steps"]) == (1, 0.0, 1)
    assert d["comm_s"] == pytest.approx(2 * 3 / 4 * P * 4 / 450e9)
    # fsdp2 inside the group: its gathers and reduce-scatter over the group's 4 GPUs
    f = build_plan(small(memory=MemorySettings(strategy="diloco", n_gpus=8, inner_strategy="fsdp2")))["diloco"]
    assert f["inner"]["comm_s"] == pytest.approx(3 / 4 * P * (2 * 2 * 3 + 4) / 450e9)
    assert f["outer_s"] == pytest.approx(OUTER)
    # --group-size 2: 4 groups of 2, the outer ring has 4 hops
    g = build_plan(small(memory=MemorySettings(strategy="diloco", n_gpus=8, group_size=2)))["diloco"]
    assert (g["group_size"], g["groups"]) == (2, 4)
    assert g["outer_allreduce"]["s"] == pytest.approx(2 * 3 / 4 * P * 4 / 3.125e9)
    # diloco_comm on its own, at a GPU count of the scaling table
    row = diloco_comm(small(), 6e6, 48_000, P, 3, 8)
    assert row["comm_s"] == pytest.approx(INNER + OUTER / 10)


def test_diloco_memory_in_the_plan_and_for_a_run():
    plan = build_plan(small())
    # --params: the states only, the inner ddp's 16 B/param plus the outer state's 8 (anchor and
    # momentum; what a sync allocates for its moment is not a state)
    assert plan["memory"]["outer"] == pytest.approx(8 * P / GIB)
    assert plan["memory_gb"] == pytest.approx(24 * P / GIB)
    assert plan["memory"]["settings"]["group_size"] == 4 and plan["memory"]["settings"]["outer_dtype"] == "fp32"

    cfg = build_config(preset="smollm-135m", overrides=[
        "parallel.strategy=diloco", "parallel.inner_strategy=fsdp2", "parallel.outer_dtype=bf16",
        "parallel.inner_steps=30"])
    # group_size 0 is the ranks of a node: the plan's gpus_per_node, else the whole world
    s = memory_settings_for_run(cfg, "bf16", "plain", "diloco", 16, gpus_per_node=8)
    assert (s.strategy, s.inner_strategy, s.group_size, s.outer_dtype, s.n_gpus) == ("diloco", "fsdp2", 8, "bf16", 16)
    assert memory_settings_for_run(cfg, "bf16", "plain", "diloco", 16).group_size == 16
    four = build_config(preset="smollm-135m", overrides=["parallel.strategy=diloco", "parallel.group_size=4"])
    assert memory_settings_for_run(four, "bf16", "plain", "diloco", 16, gpus_per_node=8).group_size == 4
    # other strategies keep the settings they had
    assert memory_settings_for_run(cfg, "bf16", "plain", "ddp", 16, gpus_per_node=8) == memory_settings_for_run(
        cfg, "bf16", "plain", "ddp", 16)
    plan = plan_for_run(cfg, "NVIDIA H100 80GB HBM3", "bf16", gpus=16, strategy="diloco", gpus_per_node=8)
    d = plan["diloco"]
    assert (d["inner_steps"], d["group_size"], d["groups"], d["outer_dtype"]) == (30, 8, 2, "bf16")
    n = plan["params"]
    assert plan["memory"]["outer"] == pytest.approx(outer_state_bytes(n, s) / GIB)
    # the anchor and momentum, sharded; a sync's buffers fit in the step's freed activations
    assert plan["memory"]["outer"] == pytest.approx(math.ceil(8 * n / 8) / GIB)
    # the trainer on a CPU: no peak, no gpus_per_node
    cpu = plan_for_run(cfg, None, "float32", gpus=2, strategy="diloco")
    assert cpu["memory"]["settings"]["group_size"] == 2 and cpu["diloco"]["min_inner_steps"] is None


def test_no_strategy_search_picks_diloco():
    assert "diloco" not in STRATEGY_ORDER
    l4 = hardware.find("l4")
    m = build_config(preset="smollm-1.7b").model
    # the planner's own choice (auto), when ddp does not fit: zero1 or fsdp2, never diloco
    auto = build_plan(PlanInputs(model=m, gpu=l4, gpus=16, tokens=10**9,
                                 memory=MemorySettings(strategy="ddp", n_gpus=16), auto_strategy=True))
    assert auto["fit"]["proposed"] in ("zero1", "fsdp2") and auto["fit"]["switched"]
    assert "diloco" not in auto["fit"]["per_strategy"] and "diloco" not in auto and "diloco" not in str(
        auto["fit"].get("suggestions"))
    asked = build_plan(PlanInputs(model=m, gpu=l4, gpus=16, tokens=10**9,
                                  memory=MemorySettings(strategy="fsdp2", n_gpus=16)))
    assert "diloco" not in str(asked["fit"])
    # diloco asked and not fitting: planned as asked, only its fsdp2 inner strategy is offered
    dil = build_plan(PlanInputs(model=m, gpu=l4, gpus=16, tokens=10**9,
                                memory=MemorySettings(strategy="diloco", n_gpus=16)))
    assert dil["fit"]["asked"] == dil["fit"]["strategy"] == "diloco" and dil["fit"]["proposed"] is None
    assert dil["runnable"] is False
    assert dil["fit"]["inner_alternative"]["inner_strategy"] == "fsdp2" and dil["fit"]["inner_alternative"]["fits"]
    assert all(way["strategy"] == "diloco" for way in dil["fit"]["suggestions"])


def test_other_strategies_are_planned_as_before():
    plan = build_plan(PlanInputs(params=P, flops_formula="6n", peak_tflops=100, gpus=8, gpus_per_node=4,
                                 network="25gbit", memory=MemorySettings(strategy="ddp", n_gpus=8)))
    assert "diloco" not in plan
    assert set(plan["memory"]["settings"]).isdisjoint({"inner_strategy", "group_size", "outer_dtype"})
    assert "outer" not in plan["memory"]


@pytest.mark.parametrize("kw, message", [
    ({"inner_steps": 0}, "--inner-steps must be >= 1"),
    ({"comm_share": 1.0}, "--comm-share must be in (0, 1)"),
    ({"memory": MemorySettings(strategy="diloco", n_gpus=8, group_size=3)}, "--group-size 3 must divide --gpus 8"),
    ({"memory": MemorySettings(strategy="diloco", n_gpus=8, group_size=16)}, "--group-size 16 exceeds --gpus 8"),
    ({"memory": MemorySettings(strategy="diloco", n_gpus=8, inner_strategy="zero1")}, "--inner-strategy 'zero1'"),
    ({"memory": MemorySettings(strategy="diloco", n_gpus=8, outer_dtype="fp16")}, "--outer-dtype 'fp16'"),
])
def test_bad_diloco_input_names_the_flag(kw, message):
    from flopwise.plan.budget import PlanError

    with pytest.raises(PlanError) as e:
        build_plan(small(**kw))
    assert message in str(e.value)


def test_the_plan_names_the_loss_cost_the_literature_measured_at_its_number_of_groups():
    """Issue 53, item 3: beside DiLoCo's bytes, the evaluation-loss cost against tuned data
    parallelism from Charles et al. 2025 (Table 4, H = 30) at the plan's M groups; beyond the
    table's M, "over" its largest."""
    from flopwise.plan.render import format_plan

    two = format_plan(build_plan(small()))  # 2 groups of 4
    line = next(x for x in two.splitlines() if x.strip().startswith("loss cost (literature)"))
    assert "+0.5% to +0.7%" in line and "M = 2 groups: +0.7% at 35M parameters, +0.5% at 90M" in line, line
    assert "Charles et al. 2025" in line and "not measured by flopwise" in line
    many = format_plan(build_plan(small(gpus=64, memory=MemorySettings(strategy="diloco", n_gpus=64))))
    line = next(x for x in many.splitlines() if x.strip().startswith("loss cost (literature)"))
    assert "over +1.5% to +3.9%" in line and "(M = 8)" in line and "more groups than the table's cost more" in line


def test_each_gpu_sends_its_slice_on_its_own_nic_or_in_turn_on_a_shared_one():
    """The outer all-reduce is sharded: GPU i of each group reduces slice i (P / S) with its peers.
    With a NIC per GPU the S slices cross side by side (S times faster than the whole
    pseudo-gradient through one link); through the NIC a node shares they queue (small()'s 25gbit:
    CROSS above, the whole pseudo-gradient's time)."""
    per_gpu = build_plan(small(network="100gbit"))["diloco"]["outer_allreduce"]
    shared = build_plan(small())["diloco"]["outer_allreduce"]
    assert (per_gpu["sharing_the_nic"], shared["sharing_the_nic"]) == (1, 4)
    assert per_gpu["slice_bytes"] == shared["slice_bytes"] == P * 4 / 4
    assert per_gpu["s"] == pytest.approx(2 * 1 / 2 * (P * 4 / 4) / 12.5e9)
    assert shared["s"] == pytest.approx(CROSS)
