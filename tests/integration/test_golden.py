"""Golden losses: the first losses of a seeded tiny run are stored; a change that should not
touch numerics must reproduce them (relative 1e-6: exact on one machine, tolerant of another
CPU's kernels). Regenerate deliberately with FLOPWISE_UPDATE_GOLDEN=1 and say why in the commit."""

import json
import os
from pathlib import Path

import pytest

from flopwise.config import build_config
from flopwise.train.trainer import train

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_losses.json"
# The goldens were taken with the random-window loader, the default then: pinned, so that
# they keep guarding the model, loss and optimizer numerics (the epoch loader, the default
# since, draws other batches; its exactness is tested in tests/unit/test_loader.py).
OVERRIDES = ["train.max_steps=12", "train.log_every=1", "eval.every=6", "eval.sample_tokens=0", "data.loader=random"]


def test_tiny_run_reproduces_the_golden_losses(tiny_overrides):
    result = train(build_config(overrides=tiny_overrides + OVERRIDES), log=lambda s: None)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    got = {"train": [r["loss"] for r in rows if r.get("loss") is not None],
           "val": [r["val_loss"] for r in rows if "val_loss" in r]}
    if os.environ.get("FLOPWISE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"overrides": "tests/conftest.py tiny_overrides + " + " ".join(OVERRIDES),
                                      **got}, indent=2) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert len(got["train"]) == 12 and len(got["val"]) == 3
    assert got["train"] == pytest.approx(want["train"], rel=1e-6)
    assert got["val"] == pytest.approx(want["val"], rel=1e-6)
