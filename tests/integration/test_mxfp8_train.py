"""MXFP8 (``train.fp8_recipe=mxfp8``) through the whole trainer on this CPU: the block linears'
weights are torchao's MXFP8 wrapper tensors, and everything that touches the weights -- the
optimizer, gradient clipping, the checkpoint, exact resume, the export -- must take them.

A CPU has no block-scaled GEMM, so two things are swapped for the test, and only these
(tests/distributed/fp8_emulated.py): the GPU check (``fp8_problem``) and the GEMM, torchao's
emulated one (the same fp8 casts, then a matmul of the dequantized values) in place of
cuBLAS's. The casts are the dry run's (``fake.mxfp8_linear_torch_casts``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from flopwise.checkpoints import latest_checkpoint, list_checkpoints
from flopwise.config import build_config
from flopwise.train.trainer import train

pytest.importorskip("torchao")

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1"]


@pytest.fixture
def emulated_mxfp8(monkeypatch):
    spec = importlib.util.spec_from_file_location("fp8_emulated", Path(__file__).parents[1] / "distributed"
                                                  / "fp8_emulated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for target, name, value in module.patches():
        monkeypatch.setattr(target, name, value)


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None and "event" not in r}


def test_an_mxfp8_run_learns_checkpoints_and_resumes_exactly(emulated_mxfp8, tiny_overrides, tmp_path):
    common = tiny_overrides + QUIET + ["train.fp8=true", "train.fp8_recipe=mxfp8", "train.max_steps=8",
                                       "train.checkpoint_every=4", "train.keep_checkpoints=0", "optim.lr=1e-2"]
    ref = tmp_path / "ref"
    lines: list[str] = []
    result = train(build_config(overrides=common + [f"train.run_dir={ref}"]), log=lines.append)
    assert any("linear layers in MXFP8" in line for line in lines), "\n".join(lines)
    a = losses(ref)
    assert all(map(lambda v: v == v, a.values())) and a[8] < a[1], a  # finite, and it learns
    saved = torch.load(latest_checkpoint(ref) / "model.pt", weights_only=True)  # plain tensors: no pickle
    assert all(type(v) is torch.Tensor for v in saved.values()), {k: type(v) for k, v in saved.items()}

    resumed = tmp_path / "resumed"
    shutil.copytree(ref, resumed)
    for p in list_checkpoints(resumed):
        if int(p.name[5:]) > 4:
            shutil.rmtree(p)
    train(build_config(overrides=common + [f"train.run_dir={resumed}"]), log=lambda s: None)
    b = losses(resumed)
    assert [a[s] for s in range(1, 9)] == [b[s] for s in range(1, 9)], (a, b)
    again = torch.load(latest_checkpoint(resumed) / "model.pt", weights_only=True)
    assert all(torch.equal(saved[k], again[k]) for k in saved)
    assert result.steps == 8
