"""DDP, ZeRO-1 and FSDP2 on CUDA with NCCL under torchrun: one process on any GPU machine (the
code paths, a one-rank NCCL group), two processes where there are two GPUs (bf16, so the
comparison with one process is loose: the reductions run in another order).

Skipped without a GPU; run on a CUDA machine with ``python -m pytest -q tests/gpu``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _torchrun(nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "flopwise", "train", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp2"])
def test_one_rank_nccl_runs_every_strategy(strategy, tiny_overrides):
    run = Path(next(o for o in tiny_overrides if o.startswith("train.run_dir=")).split("=", 1)[1])
    proc = _torchrun(1, tiny_overrides + ["train.max_steps=20", f"parallel.strategy={strategy}",
                                          "train.checkpoint_every=10"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"parallel   {strategy} · 1 rank(s)" in proc.stdout and "nccl" in proc.stdout
    record = json.loads((run / "run.json").read_text())
    assert record["parallel"]["backend"] == "nccl" and record["precision"] in ("bf16", "float32")
    assert record["result"]["val_loss_end"] < record["result"]["val_loss_start"] - 1.0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("mem_peak_gb") for r in rows)
    # and the checkpoint resumes (a sharded one under fsdp2) in a plain process
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-0000020")
    from flopwise.config import build_config
    from flopwise.train.trainer import train

    result = train(build_config(overrides=tiny_overrides + ["train.max_steps=20", f"parallel.strategy={strategy}"]),
                   log=lambda s: None)
    assert result.steps == 20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp2"])
def test_two_gpus_follow_one_gpu(strategy, tiny_overrides, tmp_path):
    base = [o for o in tiny_overrides if not o.startswith("train.run_dir=")] + [
        "train.max_steps=20", "data.loader=epoch", "eval.every=0", "train.log_every=1"]
    single = tmp_path / "single"
    proc = _torchrun(1, base + ["parallel.strategy=single", "train.micro_batch_size=8", f"train.run_dir={single}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = tmp_path / "two"
    proc = _torchrun(2, base + [f"parallel.strategy={strategy}", "train.micro_batch_size=4", f"train.run_dir={two}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = _losses(single), _losses(two)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-2), step
