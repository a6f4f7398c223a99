"""parallel.strategy=hsdp (issue 53): its layout from parallel.group_size and the node's ranks,
what it refuses before any work and in whose words, and where it is FSDP2's."""

from __future__ import annotations

import pytest
import torch

from flopwise.config import ConfigError, build_config
from flopwise.parallel.distributed import DistEnv
from flopwise.parallel.strategy import resolve_strategy, shards_parameters
from flopwise.train.defaults import step_wrapper

CPU = torch.device("cpu")


def test_hsdp_groups_are_the_nodes_unless_a_group_size_is_given(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    s = resolve_strategy(build_config("tiny", overrides=["parallel.strategy=hsdp"]), DistEnv(0, 0, 8, "gloo"), CPU,
                         "float32", "plain")
    assert s.name == "hsdp" and s.step == "hsdp"
    assert s.why == "parallel.strategy=hsdp over 8 rank(s): sharded within 2 group(s) of 4, replicated across them"
    s = resolve_strategy(build_config("tiny", overrides=["parallel.strategy=hsdp", "parallel.group_size=2"]),
                         DistEnv(0, 0, 8, "gloo"), CPU, "float32", "plain")
    assert "sharded within 4 group(s) of 2" in s.why


def test_a_group_size_that_does_not_divide_the_ranks_is_refused_with_both_numbers():
    cfg = build_config("tiny", overrides=["parallel.strategy=hsdp", "parallel.group_size=3"])
    with pytest.raises(ConfigError) as e:
        resolve_strategy(cfg, DistEnv(0, 0, 8, "gloo"), CPU, "float32", "plain")
    assert e.value.problems == ["parallel.strategy=hsdp: parallel.group_size=3 does not divide the 8 ranks into "
                                "whole shard groups; set parallel.group_size to a divisor of 8"]


@pytest.mark.parametrize("overrides,precision,said", [
    (["optim.name=muon"], "float32", "parallel.strategy=hsdp with optim.name=muon"),
    ([], "bf16-pure", "parallel.strategy=hsdp with train.precision=bf16-pure"),
    ([], "fp16", "parallel.strategy=hsdp with train.precision=fp16"),
])
def test_hsdp_refuses_what_fsdp2_refuses_in_its_own_name(overrides, precision, said):
    cfg = build_config("tiny", overrides=["parallel.strategy=hsdp", "parallel.group_size=2", *overrides])
    with pytest.raises(ConfigError) as e:
        resolve_strategy(cfg, DistEnv(0, 0, 4, "gloo"), CPU, precision, "plain")
    assert any(p.startswith(said) for p in e.value.problems), e.value.problems


def test_hsdp_is_fsdp2s_wrapping_checkpoint_and_compile_rules():
    assert shards_parameters("hsdp") and shards_parameters("fsdp2") and not shards_parameters("ddp")
    assert shards_parameters("hsdp") and not shards_parameters("zero1")  # and so their checkpoints are sharded
    assert step_wrapper(build_config("tiny", overrides=["parallel.strategy=hsdp"]), 8) == "hsdp"
