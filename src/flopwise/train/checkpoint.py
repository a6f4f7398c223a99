"""Checkpoints that survive ``kill -9`` at any moment: ``checkpoints/step-NNNNNNN/``.

A checkpoint holds ``model.pt`` and ``optimizer.pt`` (or, written by FSDP2 ranks, ``sharded/``:
the ``torch.distributed.checkpoint`` files of both, one per rank), ``rng.pt`` (torch, CUDA, numpy and
Python generator states), ``state.json`` (step, tokens, loader position, ...) and
``config.yaml``. The protocol:

1. every file is written into ``checkpoints/.tmp-step-NNNNNNN/``, flushed and fsynced,
   its CRC32 and size computed while it is written;
2. ``COMPLETE`` -- the manifest of those sizes and checksums -- is written last and fsynced;
3. the directory is renamed to ``step-NNNNNNN`` (atomic) and the parent fsynced.

So a directory named ``step-*`` with a ``COMPLETE`` inside is whole; anything else (a
``.tmp-*`` left by a kill, a directory without the marker) is never picked by
:func:`latest_checkpoint` and is swept away by the next save. Loading verifies every
file against the manifest: a flipped byte is an error naming the file.

Retention (:func:`apply_retention`) renames a checkpoint to ``.deleting-step-*`` before
removing its files, so a half-deleted checkpoint never looks complete either.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE"
SHARDED = "sharded"  # a sharded checkpoint's torch.distributed.checkpoint files (model and optimizer)
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{7,})$")
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or trusted; the message names the file."""


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:07d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ChecksummedFile:
    """A write-only file object that keeps the CRC32 and size of what passes through."""

    def __init__(self, f):
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _write(path: Path, writer: Callable[[Any], None]) -> dict[str, int]:
    with open(path, "wb") as raw:
        f = _ChecksummedFile(raw)
        writer(f)
        raw.flush()
        os.fsync(raw.fileno())
    return {"bytes": f.size, "crc32": f.crc & 0xFFFFFFFF}


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc & 0xFFFFFFFF


# --------------------------------------------------------------------------- RNG

def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every generator a training step may draw from: torch (CPU and CUDA), numpy, Python.

    With a CUDA ``device`` only that device's generator is saved: asking every visible GPU
    (``get_rng_state_all``) would create a CUDA context on each of them from every rank."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
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
    manifest; ``model`` is then None. A failure (a full disk, a permission error) removes the partial directory and raises
    :class:`CheckpointError`; earlier checkpoints are never touched by a save.
    """
    final = checkpoint_path(run_dir, step)
    root = final.parent
    tmp = root / f".tmp-{final.name}"
    try:
        if prewritten is None:
            begin_save(run_dir, step)
        files = dict(prewritten or {})
        if model is not None:
            files["model.pt"] = _write(tmp / "model.pt", lambda f: torch.save(model.state_dict(), f))
        if optimizer is not None:
            files["optimizer.pt"] = _write(tmp / "optimizer.pt", lambda f: torch.save(optimizer.state_dict(), f))
        if rng is not None:
            files["rng.pt"] = _write(tmp / "rng.pt", lambda f: torch.save(rng, f))
        blob = json.dumps({"step": step, **state}, indent=2).encode()
        files["state.json"] = _write(tmp / "state.json", lambda f: f.write(blob))
        files["config.yaml"] = _write(tmp / "config.yaml", lambda f: f.write(config_yaml.encode()))
        manifest = json.dumps({"format": FORMAT_VERSION, "step": step, "files": files}, indent=2).encode()
        _write(tmp / MARKER, lambda f: f.write(manifest))
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step: the old copy goes first (older steps stay)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        raise CheckpointError(f"could not save checkpoint step {step} in {root}: {e.strerror or e}{kept}") from e
    return final


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


def file_entry(path: Path) -> dict[str, int]:
    """A manifest entry (size, CRC32) for a file written by someone else (DCP's shards)."""
    return {"bytes": path.stat().st_size, "crc32": _file_crc(path)}


# --------------------------------------------------------------------------- find, verify, load

def is_complete(path: Path) -> bool:
    """A ``step-*`` directory with its marker -- or one written before markers existed (flopwise
    0.1's checkpoints, complete by their own rename, hold model.pt, state.json and config.yaml:
    a partial save of this version never sits under a ``step-*`` name)."""
    if not _STEP_RE.match(path.name):
        return False
    if (path / MARKER).is_file():
        return True
    return all((path / f).is_file() for f in ("model.pt", "state.json", "config.yaml"))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MARKER} marker)")
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker}: unreadable manifest ({e})") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{f}: {size} bytes, the manifest says {want['bytes']} (truncated or replaced)")
        crc = _file_crc(f)
        if crc != want["crc32"]:
            raise CheckpointError(f"{f}: checksum mismatch (crc32 {crc:08x}, expected {want['crc32']:08x}): "
                                  "the file is corrupted")
    return manifest


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: str | torch.device = "cpu",
    verify: bool = True,
) -> dict[str, Any]:
    """Load weights (and optimizer state) in place after verifying checksums; return
    ``state.json`` with the RNG states under ``"rng"`` when the checkpoint has them."""
    path = Path(path)
    sharded = (path / SHARDED).is_dir()
    if not sharded and not (path / "model.pt").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint (no model.pt or {SHARDED}/)")
    if verify and (path / MARKER).is_file():
        verify_checkpoint(path)
    if sharded:  # written by FSDP2 ranks (torch.distributed.checkpoint); read at any world size
        from flopwise.train.dist_checkpoint import load_sharded

        load_sharded(path / SHARDED, model, optimizer)
    else:
        model.load_state_dict(torch.load(path / "model.pt", map_location=map_location, weights_only=True))
    if optimizer is not None and not sharded:
        if not (path / "optimizer.pt").is_file():
            raise FileNotFoundError(f"{path}: no optimizer.pt to resume the optimizer from")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True))
    return read_state(path)


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``, with its RNG states under ``"rng"`` when it has them."""
    state = json.loads((path / "state.json").read_text())
    if (path / "rng.pt").is_file():
        state["rng"] = torch.load(path / "rng.pt", weights_only=False)  # numpy/python states are plain tuples
    return state


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
