"""Preflight times the graph the run compiles: a static one for each micro-batch size.

Without a fresh compiler per trial, dynamo takes the second size for a shape change of the
same code (``make_loss_fn``'s closure), compiles a dynamic-batch graph (matmuls with a
symbolic dimension such as ``64*s77``) and reuses it for every later size: the search would
time a graph the real run never compiles. Inductor names each matmul it compiles with its
shapes (``counters["aten_mm_info"]``), which is what this test reads."""

import re

import pytest
from torch._dynamo.utils import counters

from flopwise.config import build_config
from flopwise.tune.trial import TrialSpec, measure


@pytest.mark.slow
def test_each_trial_compiles_a_static_graph_for_its_own_size(tiny_overrides):
    import torch._functorch.config
    import torch._inductor.config

    cfg = build_config(overrides=tiny_overrides + ["train.compile=model", "train.loss=plain",
                                                   "train.global_batch_size=8"])
    shapes = {}
    # Compile for real each time: a graph found in the on-disk caches is not reported. (The
    # configs' own patch(): monkeypatch would delete these attributes on the way out.)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for micro in (2, 4):
            counters.clear()
            measure(cfg, TrialSpec(micro, "none", warmup=1, steps=1), torch.device("cpu"))
            shapes[micro] = sorted(counters["aten_mm_info"])
    for micro, names in shapes.items():
        assert names, f"micro-batch {micro}: no compiled matmul seen (was the loss compiled?)"
        symbolic = [n for n in names if re.search(r"(_|\*)s\d+", n)]
        assert not symbolic, f"micro-batch {micro} compiled dynamic-shape matmuls: {symbolic}"
