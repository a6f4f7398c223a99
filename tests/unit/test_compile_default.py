"""``train.compile=auto`` under a data-parallel wrapper: each block compiled on its own, where the
whole model breaks around the wrapper's hooks (the dry run's trace: tests/integration/
test_default_step_traced.py); one process keeps the whole-model graph. Decided without a GPU."""

import subprocess
import sys

import pytest
import torch

from flopwise.config import build_config
from flopwise.train.defaults import resolve_compile, resolve_speed, step_wrapper

CUDA = torch.device("cuda")
GiB = 2**30


@pytest.mark.parametrize("strategy, world, wrapper", [
    ("ddp", 8, "ddp"), ("zero1", 8, "zero1"), ("fsdp2", 8, "fsdp2"), ("auto", 8, "ddp, zero1 or fsdp2"),
    ("auto", 1, ""), ("single", 1, ""), ("ddp", 1, ""),
    ("diloco", 8, "ddp"),  # groups of 4 with DDP inside
])
def test_the_wrapper_the_step_runs_in(strategy, world, wrapper):
    cfg = build_config(preset="tiny", overrides=[f"parallel.strategy={strategy}", "parallel.group_size=4"])
    assert step_wrapper(cfg, world) == wrapper


def test_diloco_groups_of_one_rank_have_no_wrapper():
    cfg = build_config(preset="tiny", overrides=["parallel.strategy=diloco", "parallel.group_size=1"])
    assert step_wrapper(cfg, 8) == ""


def test_auto_compiles_blocks_under_a_wrapper_and_the_whole_model_alone():
    mode, why = resolve_compile("auto", CUDA, "fsdp2")
    assert mode == "blocks" and why.startswith("CUDA under fsdp2: one graph per block, no graph break"), why
    assert resolve_compile("auto", "cuda", "ddp")[0] == "blocks"  # a device type does as well as a device
    assert resolve_compile("auto", CUDA, "") == ("model", "CUDA: forward, LM head and loss as one graph")
    assert resolve_compile("auto", "cpu", "ddp")[0] == "off"  # CPU ranks: not compiled, wrapper or not
    assert resolve_compile("model", CUDA, "ddp") == ("model", "")  # asked for: kept, nothing to explain


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp2", "auto"])
def test_the_speed_line_says_blocks_and_why_at_8_ranks(strategy):
    cfg = build_config(preset="smollm-135m", overrides=[f"parallel.strategy={strategy}", "train.seq_len=1024",
                                                        "train.micro_batch_size=2", "train.global_batch_size=32"])
    resolved, notes = resolve_speed(cfg, CUDA, "bf16", 8, total_bytes=80 * GiB)
    assert resolved.train.compile == "blocks" and cfg.train.compile == "auto"  # config.yaml keeps auto
    assert notes["compile"].startswith("auto -> blocks (CUDA under "), notes
    # the loss is no longer inside a whole-model graph: the one with no full logits
    assert resolved.train.loss == "chunked"
    assert notes["loss"] == "auto -> chunked (not compiled: fewer passes and no full logits)"
    resolved, notes = resolve_speed(cfg, CUDA, "bf16", 1, total_bytes=80 * GiB)
    assert (resolved.train.compile, resolved.train.loss) == ("model", "plain")  # one process: unchanged


def test_the_rules_import_no_torch():
    """flopwise plan resolves auto with these rules, and plan never imports torch."""
    code = ("import sys; from flopwise.train.defaults import resolve_compile, step_wrapper; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
