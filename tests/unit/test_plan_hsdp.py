"""`flopwise plan --strategy hsdp`: hybrid sharding's memory (fsdp2's at the shard group's GPUs),
its communication in two parts (fsdp2's inside a group, the gradient shards' all-reduce across the
groups), the CLI's output and refusals, and where the fit search offers it -- against hand-computed
numbers."""

import pytest

from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.plan import budget, hardware
from flopwise.plan.budget import STRATEGY_ORDER, PlanInputs, build_plan, memory_settings_for_run
from flopwise.plan.memory import MemorySettings, estimate, numerics_change, residual_bytes, state_bytes

P = 1_000_000  # parameters
H100 = hardware.find("h100")


def states(est) -> tuple[int, ...]:
    return est.params, est.grads, est.optimizer, est.master


@pytest.mark.parametrize("precision, grad_accum", [("bf16", 1), ("bf16", 4), ("float32", 1), ("bf16-pure", 1)])
def test_hsdp_memory_is_fsdp2_at_the_shard_group(precision, grad_accum):
    """4 nodes x 8 GPUs of hsdp hold per GPU what fsdp2 on 8 GPUs holds: the states sharded over
    the group, the same gather buffers, bf16-gathered weights (no autocast copies) -- not fsdp2's
    over all 32 GPUs."""
    m = build_config(preset="smollm-135m").model
    common = dict(precision=precision, grad_accum=grad_accum, loss="chunked", compiled=True)
    hsdp = MemorySettings(strategy="hsdp", n_gpus=32, group_size=8, **common)
    at_group = MemorySettings(strategy="fsdp2", n_gpus=8, **common)
    at_world = MemorySettings(strategy="fsdp2", n_gpus=32, **common)
    assert hsdp.shard_ranks == 8 and at_world.shard_ranks == 32
    assert state_bytes(10**9, hsdp, n_tensors=30) == state_bytes(10**9, at_group, n_tensors=30)
    mine, theirs, wider = (estimate(m, 4, 512, s) for s in (hsdp, at_group, at_world))
    assert states(mine) == states(theirs)
    assert mine.fsdp_buffers == theirs.fsdp_buffers > 0 and mine.weight_copies == theirs.weight_copies == 0
    assert (mine.activations, mine.logits, mine.transient, mine.total) == (
        theirs.activations, theirs.logits, theirs.transient, theirs.total)
    assert mine.params > wider.params and mine.total > wider.total  # sharded over the group, not the world
    assert "hsdp over 32 (a shard group of 8, replicated across 4 groups)" in mine.notes[0]


def test_hsdp_keeps_fsdp2s_numerics_and_the_group_of_a_run():
    # the same MixedPrecisionPolicy: a bf16 residual stream under autocast, as fsdp2
    assert residual_bytes("hsdp", "bf16") == residual_bytes("fsdp2", "bf16") == 2
    assert numerics_change("hsdp", "fsdp2", "bf16") == "" and numerics_change("hsdp", "ddp", "bf16")
    # parallel.group_size 0 is the ranks of a node; a group given is kept as given
    cfg = build_config(preset="smollm-135m", overrides=["parallel.strategy=hsdp"])
    s = memory_settings_for_run(cfg, "bf16", "plain", "hsdp", 32, gpus_per_node=8)
    assert (s.strategy, s.group_size, s.group_ranks, s.shard_ranks) == ("hsdp", 8, 8, 8)
    four = build_config(preset="smollm-135m", overrides=["parallel.strategy=hsdp", "parallel.group_size=4"])
    assert memory_settings_for_run(four, "bf16", "plain", "hsdp", 32, gpus_per_node=8).group_size == 4
    # the plan at 4 nodes x 8 H100: hsdp's states per GPU are fsdp2's on 8 GPUs
    m = cfg.model

    def plan(strategy: str, gpus: int) -> dict:
        return build_plan(PlanInputs(model=m, gpu=H100, gpus=gpus, gpus_per_node=8, micro_batch=4, seq_len=1024,
                                     memory=MemorySettings(strategy=strategy, n_gpus=gpus)))
    hsdp, fsdp2_8, fsdp2_32 = plan("hsdp", 32), plan("fsdp2", 8), plan("fsdp2", 32)
    for key in ("params", "grads", "optimizer", "master", "fsdp_buffers"):
        assert hsdp["memory"][key] == fsdp2_8["memory"][key], key
    assert hsdp["memory"]["params"] == pytest.approx(4 * fsdp2_32["memory"]["params"], rel=1e-6)
    assert hsdp["memory"]["settings"]["group_size"] == 8 and "inner_strategy" not in hsdp["memory"]["settings"]


def small(strategy: str = "hsdp", **kw) -> PlanInputs:
    """1M parameters on 32 GPUs, 8 to a node (NVLink 4, 450 GB/s, inside; InfiniBand NDR, 50 GB/s
    per GPU, between nodes), micro-batch 2 x 1 step x seq 1000, bf16 autocast."""
    base = dict(params=P, flops_formula="6n", peak_tflops=100, mfu=0.5, gpus=32, gpus_per_node=8,
                interconnect="nvlink4", network="ib-ndr", seq_len=1000, micro_batch=2, grad_accum=1,
                memory=MemorySettings(strategy=strategy, n_gpus=kw.get("gpus", 32)))
    return PlanInputs(**{**base, **kw})


def test_hsdp_communication_by_hand():
    at = build_plan(small())["scaling"]["at_gpus"]
    assert (at["group_size"], at["groups"]) == (8, 4)
    # inside a group, fsdp2's over 8 GPUs on NVLink: two bf16 all-gathers and one fp32 reduce-scatter
    inner = at["in_group"]
    assert (inner["link"], inner["between_nodes"]) == ("nvlink4", False)
    assert inner["bytes"] == pytest.approx(7 / 8 * P * (2 * 2 * 1 + 4))
    assert inner["s"] == pytest.approx(7 / 8 * P * 8 / 450e9)
    # across the 4 groups, each GPU's fp32 shard (4 B x P / 8) all-reduced in a ring over the network
    across = at["across_groups"]
    assert (across["link"], across["between_nodes"], across["groups"]) == ("ib-ndr", True, 4)
    assert across["shard_bytes"] == 4 * P / 8
    assert across["bytes"] == pytest.approx(2 * 3 / 4 * 4 * P / 8)
    assert across["s"] == pytest.approx(2 * 3 / 4 * 4 * P / 8 / 50e9)
    assert at["comm_s"] == pytest.approx(inner["s"] + across["s"]) and at["link"] == "ib-ndr"
    # the same fsdp2 row as fsdp2's own plan on one node of 8 (same micro-batches per GPU)
    fsdp2 = build_plan(small("fsdp2", gpus=8))["scaling"]["at_gpus"]
    assert inner["s"] == pytest.approx(fsdp2["comm_s"]) and inner["bytes"] == pytest.approx(fsdp2["comm_bytes_per_gpu"])


def test_hsdp_sends_about_a_group_size_less_across_nodes_than_ddp():
    hsdp = build_plan(small())["scaling"]["at_gpus"]["across_groups"]
    ddp = build_plan(small("ddp"))["scaling"]["at_gpus"]
    assert ddp["link"] == "ib-ndr" and ddp["comm_bytes_per_gpu"] == pytest.approx(2 * 31 / 32 * 4 * P)
    # 2(G-1)/G against 2(n-1)/n: 1/8 x (3/4) / (31/32) = 0.097
    assert hsdp["bytes"] / ddp["comm_bytes_per_gpu"] == pytest.approx(1 / 8, rel=0.25)
    assert hsdp["s"] < ddp["comm_s"] / 8
    # exactly: ddp's all-reduce among the 4 GPUs that share a shard, divided by the group size
    ddp_over_groups = build_plan(small("ddp", gpus=4, gpus_per_node=1))["scaling"]["at_gpus"]
    assert hsdp["bytes"] == pytest.approx(ddp_over_groups["comm_bytes_per_gpu"] / 8)


def test_one_group_is_fsdp2_and_the_scaling_rows_are_whole_groups():
    one = build_plan(small(gpus=8))["scaling"]
    fsdp2 = build_plan(small("fsdp2", gpus=8))["scaling"]
    assert one["at_gpus"]["groups"] == 1 and one["at_gpus"]["across_groups"]["s"] == 0
    assert [r["comm_s"] for r in one["table"]] == pytest.approx([r["comm_s"] for r in fsdp2["table"]])
    rows = build_plan(small(gpus=32, memory=MemorySettings(strategy="hsdp", n_gpus=32, group_size=4)))["scaling"]
    assert [r["gpus"] for r in rows["table"]] == [1, 2, 4, 8, 16, 32]
    assert [r["groups"] for r in rows["table"]] == [1, 1, 1, 2, 4, 8]
    assert rows["table"][3]["across_groups"]["link"] == "nvlink4"  # 2 groups of 4 inside one node


def test_plan_cli_names_both_parts_of_the_communication(capsys):
    rc = cli_main(["plan", "--preset", "llama3.2-1b", "--strategy", "hsdp", "--gpus", "32", "--gpu", "h100",
                   "--tokens", "20B"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "hsdp (sharded in groups of 8, 4 replicas) on 32 GPU(s)" in out
    lines = {line.split("  ")[1].strip(): line for line in out.splitlines()
             if line.startswith("  ") and "  " in line[2:]}
    assert "nvlink4, within a node" in lines["in-group, 32 GPUs"] and "fsdp2" in lines["in-group, 32 GPUs"]
    assert "ib-ndr, between nodes" in lines["across groups, 32 GPUs"]
    assert "G = 4 groups" in lines["across groups, 32 GPUs"]
    # --group-size is hsdp's too
    rc = cli_main(["plan", "--preset", "llama3.2-1b", "--strategy", "hsdp", "--gpus", "32", "--group-size", "16",
                   "--gpu", "h100", "--tokens", "20B"])
    out = capsys.readouterr().out
    assert rc == 0 and "sharded in groups of 16, 2 replicas" in out and "ib-ndr, between nodes" in out


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "12"], "--gpus-per-node 8 does not divide --gpus 12 into whole shard groups"),
    (["--gpus", "16", "--gpus-per-node", "6"], "--gpus-per-node 6 does not divide --gpus 16"),
    (["--gpus", "16", "--group-size", "3"], "shard groups of 3 GPUs (--group-size, parallel.group_size) do not divide "
                                            "--gpus 16"),
    (["--gpus", "16", "--group-size", "32"], "shard groups of 32 GPUs"),
])
def test_a_group_that_does_not_divide_the_gpus_is_refused_in_one_line(flags, message, capsys, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("planned before refusing")
    monkeypatch.setattr(budget, "_build_plan", no_work)
    rc = cli_main(["plan", "--preset", "llama3.2-1b", "--strategy", "hsdp", "--gpu", "h100", *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    errors = [line for line in captured.err.splitlines() if not line.startswith("flopwise plan: note:")]
    assert len(errors) == 1 and errors[0].startswith("flopwise plan: --strategy hsdp") and message in errors[0]


def test_group_size_without_diloco_or_hsdp_names_both(capsys):
    rc = cli_main(["plan", "--preset", "llama3.2-1b", "--strategy", "ddp", "--gpus", "16", "--group-size", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and "give --strategy diloco or hsdp" in err


def test_fit_search_offers_hsdp_beside_fsdp2_across_nodes_and_never_switches_to_it():
    assert "hsdp" not in STRATEGY_ORDER
    l4 = hardware.find("l4")
    m = build_config(preset="smollm-1.7b").model

    def plan(gpus: int, strategy: str = "ddp", auto: bool = True) -> dict:
        return build_plan(PlanInputs(model=m, gpu=l4, gpus=gpus, gpus_per_node=8, tokens=10**9, auto_strategy=auto,
                                     memory=MemorySettings(strategy=strategy, n_gpus=gpus)))
    two_nodes = plan(16)
    fit = two_nodes["fit"]
    assert fit["proposed"] == fit["strategy"] == "fsdp2" and fit["switched"]
    assert fit["per_strategy"]["hsdp"]["fits"]
    offered = fit["offered"]
    assert (offered["strategy"], offered["group_size"], offered["beside"]) == ("hsdp", 8, "fsdp2")
    assert offered["comm_s"] < offered["beside_comm_s"]
    assert two_nodes["scaling"]["strategy"] == "fsdp2"  # auto's plan is fsdp2's, as train's auto picks
    # one node: the search as before, no hsdp
    one_node = plan(8)["fit"]
    assert "hsdp" not in one_node["per_strategy"] and "offered" not in one_node
    assert list(one_node["per_strategy"]) == ["ddp", "zero1", "fsdp2"]
    # hsdp asked and not fitting: checked against fsdp2 alone
    asked = build_plan(PlanInputs(model=build_config(preset="llama3.2-1b").model, gpu=l4, gpus=16, micro_batch=8,
                                  tokens=10**9, memory=MemorySettings(strategy="hsdp", n_gpus=16)))["fit"]
    assert list(asked["per_strategy"]) == ["hsdp", "fsdp2"] and asked["asked"] == asked["strategy"] == "hsdp"


def test_on_a_nic_the_node_shares_the_groups_shards_queue_for_it():
    """Each GPU all-reduces its own shard across the groups, all 8 of a node at once: on a NIC per
    GPU (ib-ndr) side by side, on 25 Gbit/s Ethernet shared by the node one after another -- 8
    shards' time, what one whole gradient through the NIC takes."""
    per_gpu = build_plan(small(network="100gbit"))["scaling"]["at_gpus"]["across_groups"]
    shared = build_plan(small(network="25gbit"))["scaling"]["at_gpus"]["across_groups"]
    assert (per_gpu["sharing_the_nic"], shared["sharing_the_nic"]) == (1, 8)
    assert per_gpu["s"] == pytest.approx(2 * 3 / 4 * 4 * P / 8 / 12.5e9)
    assert shared["s"] == pytest.approx(2 * 3 / 4 * 4 * P / 3.125e9)  # 8 shards = the whole gradient
    assert shared["bytes"] == per_gpu["bytes"]  # what each GPU sends is the same; the NIC is not
