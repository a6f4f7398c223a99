"""CUDA paths end to end: bf16 autocast, fused AdamW, pinned non-blocking loads, MFU, memory.

Skipped without a GPU; run on a CUDA machine with ``python -m pytest -q tests/gpu``.
"""

import json

import pytest
import torch

from flopwise.config import build_config
from flopwise.train.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_short_cuda_run_reports_mfu_and_cuda_memory(tiny_overrides):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=30", "train.device=cuda"])
    result = train(cfg, log=lambda s: None)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert json.loads((result.run_dir / "run.json").read_text())["precision"] in ("bf16", "float32")
    assert last["mem_alloc_gb"] > 0 and last["mem_peak_gb"] >= last["mem_alloc_gb"]
    assert last["mem_reserved_gb"] >= last["mem_alloc_gb"]
    name = torch.cuda.get_device_name()
    from flopwise.plan import hardware
    if hardware.lookup(name) is not None:
        assert last["mfu"] is not None and 0 < last["mfu"] < 1
    assert result.val_loss_end < result.val_loss_start - 1.0


def test_fused_adamw_is_used_on_cuda():
    from flopwise.config import OptimConfig
    from flopwise.train.optim import build_optimizer

    opt = build_optimizer(torch.nn.Linear(8, 8).cuda(), OptimConfig(), torch.device("cuda"))
    assert opt.defaults.get("fused") is True


def test_the_default_cuda_run_is_compiled_with_the_loss_in_its_graph(tiny_overrides):
    lines = []
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=12", "train.device=cuda", "eval.sample_tokens=16"])
    result = train(cfg, log=lines.append)
    assert any("compile auto -> model" in line for line in lines), lines
    assert any("loss auto -> plain" in line for line in lines), lines
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r.get("event") == "recompile"]  # one static graph after warm-up
    assert result.sample  # generation after a compiled bf16 run works
