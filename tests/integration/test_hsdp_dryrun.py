"""HSDP in the dry run (issue 53): traced at 16 nodes of 8 GPUs on fake tensors -- FSDP2's
all-gathers and reduce-scatters within a node's group, the gradient shards' all-reduce across
the 16 groups, one rank per node -- and predicted, with that all-reduce priced over the network
between nodes."""

from __future__ import annotations

import pytest

from flopwise.config import build_config

pytestmark = pytest.mark.slow  # a trace at 128 fake ranks (about half a minute)


def test_hsdp_at_16_nodes_of_8_is_traced_with_its_collectives_on_the_right_groups_and_predicted():
    from flopwise.tune.dryrun import dry_run

    cfg = build_config("tiny", overrides=["parallel.strategy=hsdp", "train.global_batch_size=2048"])
    result = dry_run(cfg, gpu="h100", nproc_per_node=8, nnodes=16, log=lambda s: None)
    assert result["strategy"] == "hsdp" and result["world"] == 128
    colls = [r for r in result["trace"]["kernels"]["records"] if r["kind"] == "coll"]
    within = {tuple(r["ranks"]) for r in colls if r["op"] in ("_allgather_base_", "_reduce_scatter_base_")}
    across = {tuple(r["ranks"]) for r in colls if r["op"] == "allreduce_" and r["group"] == 16}
    assert within == {tuple(range(8))}, within  # rank 0's node: its group's 8 GPUs
    assert across == {tuple(range(0, 128, 8))}, across  # one rank a node: the replicas of rank 0's shard
    p = result["prediction"]
    assert p["predicted"] and p["tokens_per_s_per_gpu"] > 0 and p["network"], p
    shard_bytes = max(r["bytes"] for r in colls if r["op"] == "allreduce_" and r["group"] == 16)
    gathered = max(r["bytes"] for r in colls if r["op"] == "_allgather_base_")
    assert shard_bytes < gathered  # a shard of a block's gradients, not the block
