"""The dry run's prediction describes the step that will run (issue 51): the layout of the ranks
as torchrun gives it, traced through the dry run's own worker on fake tensors. Nothing here ran
on a GPU; every time below is predicted."""

from __future__ import annotations

import pytest

from flopwise.config import build_config
from flopwise.tune.dryrun import dry_run_batch

# two layers of smollm-135m at a short sequence: the layout, not the model, is under test
SHAPE = ["model.n_layers=2", "train.seq_len=512", "train.micro_batch_size=2", "train.global_batch_size=64",
         "train.compile=off"]
NODES, PER_NODE = 2, 8


@pytest.fixture(scope="module")
def two_nodes(fake_cuda_shim) -> dict[str, dict]:
    """DiLoCo with its default groups (a node each) and DDP, both at 2 nodes of 8 H100s, in one
    tracing process."""
    rows = {"diloco": ["parallel.strategy=diloco"], "ddp": ["parallel.strategy=ddp"]}
    cfgs = [build_config("smollm-135m", overrides=[*SHAPE, *extra]) for extra in rows.values()]
    results = dry_run_batch(cfgs, gpu="h100", nproc_per_node=PER_NODE, nnodes=NODES)
    for name, r in zip(rows, results):
        assert "error" not in r, f"{name}: {r.get('error')} at {r.get('where')}"
    return dict(zip(rows, results))


def collectives(r: dict) -> dict[tuple[str, str], list[int]]:
    return {(x["phase"], x["op"]): x.get("ranks") for x in r["trace"]["kernels"]["records"] if x["kind"] == "coll"}


@pytest.mark.slow
def test_diloco_on_two_nodes_is_traced_as_a_group_per_node(two_nodes):
    """The tracing process is told the node's ranks (torchrun's LOCAL_WORLD_SIZE), so DiLoCo's
    default groups are the nodes: the gradients are all-reduced among a node's 8 ranks, the outer
    sync between rank 0 and its peer on the other node. It was traced as one group of 16, and so
    predicted slower than DDP."""
    r = two_nodes["diloco"]
    assert "2 group(s) of 8 rank(s)" in r["strategy_why"], r["strategy_why"]
    calls = collectives(r)
    inner = [ranks for (phase, _), ranks in calls.items() if phase == "backward"]
    assert inner and all(ranks == list(range(PER_NODE)) for ranks in inner), calls
    assert calls.get(("outer", "allreduce_")) == [0, PER_NODE], calls
    diloco, ddp = r["prediction"], two_nodes["ddp"]["prediction"]
    assert diloco["comm_s"] < ddp["comm_s"] / 2, (diloco["comm_s"], ddp["comm_s"])
    assert diloco["step_s"] < ddp["step_s"], (diloco["step_s"], ddp["step_s"])
