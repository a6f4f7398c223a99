"""Issue 52, item 3: the set-ups this tool's users train on, traced on fake tensors and predicted
in CI -- each figure exists, is finite, and every line that shows it says "predicted" (accuracy
lives in the benchmark, not here). Qwen3-1.8B is traced at 4 of its layers, as the dry-run matrix
traces deep models compiled (tests/integration/test_dryrun.py): the blocks repeat.

The fp8 set-up (4 x RTX PRO 6000 Blackwell Max-Q, FSDP2 + fp8 tensorwise) is traced at 4 of
smollm-360m's layers; the issue names no model for it."""

from __future__ import annotations

import json
import math

import pytest

from flopwise.tune.predict import render

pytestmark = pytest.mark.slow  # a dry run each, 30-50 s on 2 cores

SETUPS = {
    "8 x B200, Qwen3-1.8B, DDP, compiled": ["--preset", "qwen3-1.8b", "--gpu", "b200", "--nproc-per-node", "8",
                                             "parallel.strategy=ddp", "train.compile=model", "model.n_layers=4"],
    "8 x B200, Qwen3-1.8B, ZeRO-1, compiled": ["--preset", "qwen3-1.8b", "--gpu", "b200", "--nproc-per-node", "8",
                                                "parallel.strategy=zero1", "train.compile=model", "model.n_layers=4"],
    "1 x 12 GB RTX 4070, GPT-2 124M, micro-batch 8 x 64, compiled": [
        "--preset", "gpt2-124m", "--gpu", "rtx 4070", "train.seq_len=1024", "train.micro_batch_size=8",
        "train.global_batch_size=512", "train.compile=model"],
    "1 x RTX 4090, smollm-360m": ["--preset", "smollm-360m", "--gpu", "rtx 4090", "train.micro_batch_size=4",
                                  "train.global_batch_size=64"],
    # fp8 needs torchao (./install.sh test installs it); the test skips where it is missing
    "4 x RTX PRO 6000 Blackwell Max-Q, smollm-360m, FSDP2 + fp8 tensorwise": [
        "--preset", "smollm-360m", "--gpu", "rtx pro 6000 max-q", "--nproc-per-node", "4", "parallel.strategy=fsdp2",
        "train.fp8=true", "train.compile=model", "model.n_layers=4", "train.micro_batch_size=4"],
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_a_users_setup_is_traced_and_predicted(cli, name):
    if "train.fp8=true" in SETUPS[name]:
        pytest.importorskip("torchao")
    proc = cli("preflight", "--dry-run", *SETUPS[name], "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    p = result["prediction"]
    assert p["predicted"], p
    for key in ("step_s", "tokens_per_s_per_gpu", "tokens_per_s", "mfu"):
        assert isinstance(p[key], float) and math.isfinite(p[key]) and p[key] > 0, (key, p[key])
    assert p["mfu"] < 1.2, p["mfu"]  # GeForce parts may pass their rated peak by boosting; not by more
    assert all(math.isfinite(v) and v >= 0 for v in p["breakdown"].values()), p["breakdown"]
    peak = result["trace"]["memory"]["peak_gib"]
    assert math.isfinite(peak) and peak > 0
    lines = render(p)
    assert lines and all("predicted" in line or "derived" in line or "likely" in line for line in lines), lines
    assert "predicted" in lines[0] and "not measured" in lines[0], lines[0]
    if result.get("fp8"):  # its scaled matmuls priced at the (derived) fp8 rate, and said
        assert p["fp8"]["matmuls"] > 0 and any("fp8" in d for d in p["derived"]), p
