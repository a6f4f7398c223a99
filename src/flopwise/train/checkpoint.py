"""Checkpoints: ``checkpoints/step-NNNNNNN/`` holding the model, optimizer and counters.

A checkpoint is written into a temporary sibling directory and renamed into place once
every file is flushed, so a directory named ``step-*`` is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_DIR = "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:07d}"


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    config_yaml: str,
) -> Path:
    """Write model, optimizer, ``state.json`` (step, tokens, ...) and the config; return the path."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _save_file(model.state_dict(), tmp / "model.pt")
    if optimizer is not None:
        _save_file(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
    (tmp / "config.yaml").write_text(config_yaml)
    if final.exists():  # re-saving the same step replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Load weights (and optimizer state) in place; return ``state.json``."""
    path = Path(path)
    if not (path / "model.pt").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint (no model.pt)")
    model.load_state_dict(torch.load(path / "model.pt", map_location=map_location, weights_only=True))
    if optimizer is not None:
        if not (path / "optimizer.pt").is_file():
            raise FileNotFoundError(f"{path}: no optimizer.pt to resume the optimizer from")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True))
    return json.loads((path / "state.json").read_text())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    steps = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())
    return steps[-1] if steps else None
