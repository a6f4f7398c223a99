"""Writing checkpoints during training: save, retention, and the generator states they carry.

The format -- ``checkpoints/step-NNNNNNN/`` with ``COMPLETE``, its manifest, written last -- and
how it is found, verified and read live one layer down, in :mod:`flopwise.checkpoints`, which
``model/io.py`` and ``evaluate/`` use too. A save (:func:`save_checkpoint`):

1. every file is written into ``checkpoints/.tmp-step-NNNNNNN/``, flushed and fsynced,
   its CRC32 and size computed while it is written;
2. ``COMPLETE`` -- the manifest of those sizes and checksums -- is written last and fsynced;
3. the directory is renamed to ``step-NNNNNNN`` (atomic) and the parent fsynced.

So a kill at any moment leaves the previous checkpoints whole and at most a ``.tmp-*``, which
is never picked by ``latest_checkpoint`` and is swept away by the next save.

Retention (:func:`apply_retention`) renames a checkpoint to ``.deleting-step-*`` before
removing its files, so a half-deleted checkpoint never looks complete either.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flopwise.checkpoints import (
    CHECKPOINT_DIR,
    FORMAT_VERSION,
    MARKER,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    write_checksummed,
)
from flopwise.fsio import describe_write_error, fsync_dir

# --------------------------------------------------------------------------- RNG

def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every generator a training step may draw from: torch (CPU and CUDA), numpy, Python --
    as tensors, numbers and strings only, so ``rng.pt`` loads with ``weights_only=True``.

    With a CUDA ``device`` only that device's generator is saved: asking every visible GPU
    (``get_rng_state_all``) would create a CUDA context on each of them from every rank."""
    np_state = np.random.get_state(legacy=True)  # numpy's stubs type the no-argument call as a dict
    assert isinstance(np_state, tuple)  # legacy: the tuple of the global MT19937
    kind, keys, pos, has_gauss, cached = np_state
    version, mt, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, torch.Tensor):  # one device's generator (this rank's)
        if device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda, device)
    else:
        torch.cuda.set_rng_state_all(cuda)


# --------------------------------------------------------------------------- save

def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    config_yaml: str,
    rng: dict[str, Any] | None = None,
    prewritten: dict[str, dict[str, int]] | None = None,
) -> Path:
    """Write a complete checkpoint for ``step`` (see the module docstring); return its path.

    ``prewritten``: files already written into the directory :func:`begin_save` made (a
    sharded checkpoint's ``sharded/*``, each rank's own), with their sizes and CRC32s for the
    manifest; ``model`` is then None. A failure (a full disk, a permission error) removes the partial directory and
    raises :class:`CheckpointError`; earlier checkpoints are never touched by a save.
    """
    final = checkpoint_path(run_dir, step)
    root = final.parent
    tmp = root / f".tmp-{final.name}"
    try:
        if prewritten is None:
            begin_save(run_dir, step)
        files = dict(prewritten or {})
        if model is not None:
            files["model.pt"] = write_checksummed(tmp / "model.pt", lambda f: torch.save(model.state_dict(), f))
        if optimizer is not None:
            files["optimizer.pt"] = write_checksummed(tmp / "optimizer.pt",
                                                      lambda f: torch.save(optimizer.state_dict(), f))
        if rng is not None:
            files["rng.pt"] = write_checksummed(tmp / "rng.pt", lambda f: torch.save(rng, f))
        blob = json.dumps({"step": step, **state}, indent=2).encode()
        files["state.json"] = write_checksummed(tmp / "state.json", lambda f: f.write(blob))
        files["config.yaml"] = write_checksummed(tmp / "config.yaml", lambda f: f.write(config_yaml.encode()))
        manifest = json.dumps({"format": FORMAT_VERSION, "step": step, "files": files}, indent=2).encode()
        write_checksummed(tmp / MARKER, lambda f: f.write(manifest))
        fsync_dir(tmp)
        if final.exists():  # re-saving the same step: the old copy goes first (older steps stay)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as e:
        # A full disk surfaces as OSError from our writes but as RuntimeError from torch.save's zip
        # writer; either way nothing of this save may stay behind, and the message is the same.
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: cleaned up, not re-worded
            raise
        raise save_failed(run_dir, step, e) from e
    return final


def save_failed(run_dir: str | Path, step: int, error: BaseException) -> CheckpointError:
    """The error a failed save raises: what failed, why, and which checkpoint is still there."""
    previous = latest_checkpoint(run_dir)
    kept = f"; the previous checkpoint {previous} is intact" if previous else "; no earlier checkpoint exists"
    root = Path(run_dir) / CHECKPOINT_DIR
    return CheckpointError(f"could not save checkpoint step {step} in {root}: {describe_write_error(error)}{kept}")


def discard_save(run_dir: str | Path, step: int) -> None:
    """Remove the hidden directory of a save that failed part-way (a sharded save's ranks)."""
    final = checkpoint_path(run_dir, step)
    shutil.rmtree(final.parent / f".tmp-{final.name}", ignore_errors=True)


def begin_save(run_dir: str | Path, step: int) -> Path:
    """Sweep what killed saves left and create the hidden directory ``step``'s files go into."""
    final = checkpoint_path(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(".tmp-step-*"):  # a save killed before its rename
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    return tmp


# --------------------------------------------------------------------------- retention

def apply_retention(run_dir: str | Path, keep_last: int, milestone_every: int = 0) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (0 = keep all), sparing
    milestones (steps that are multiples of ``milestone_every``). Returns what was deleted."""
    if keep_last <= 0:
        return []
    found = list_checkpoints(run_dir)
    doomed = [p for p in found[:-keep_last] if not (milestone_every > 0 and int(p.name[5:]) % milestone_every == 0)]
    for p in doomed:
        gone = p.with_name(f".deleting-{p.name}")
        os.replace(p, gone)  # from here on it is not a checkpoint, whatever is left of it
        shutil.rmtree(gone, ignore_errors=True)
    for leftover in (Path(run_dir) / CHECKPOINT_DIR).glob(".deleting-step-*"):  # a deletion killed midway
        shutil.rmtree(leftover, ignore_errors=True)
    return doomed
