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
``.tmp-*`` left by a kill or a full disk, a directory without the marker) is never picked
by :func:`latest_checkpoint`, and ``.tmp-*`` is swept away by the next save. Loading
verifies every file against the manifest first: a flipped byte is an error naming the
file, and a directory without the marker is refused -- it is either tampered with or was
written by a flopwise too old to write markers; ``flopwise checkpoint adopt PATH`` vouches
for such a one explicitly (:func:`adopt_checkpoint`).

Nothing read from a checkpoint can run code: tensors are read with ``torch.load(...,
weights_only=True)``, the RNG states are stored as tensors and numbers (not numpy or
Python objects, which only a full unpickler reads), ``state.json`` is JSON whose fields
are checked, and a sharded checkpoint's DCP metadata goes through an allow-list
(``dist_checkpoint.py``).

Retention (:func:`apply_retention`) renames a checkpoint to ``.deleting-step-*`` before
removing its files, so a half-deleted checkpoint never looks complete either.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from flopwise.fsio import describe_write_error, fsync_dir

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
    """Every generator a training step may draw from: torch (CPU and CUDA), numpy, Python --
    as tensors, numbers and strings only, so ``rng.pt`` loads with ``weights_only=True``.

    With a CUDA ``device`` only that device's generator is saved: asking every visible GPU
    (``get_rng_state_all``) would create a CUDA context on each of them from every rank."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
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


def _check_rng(state: Any, where: Path) -> dict[str, Any]:
    """``rng.pt``'s content has the shape :func:`set_rng_state` reads (else a named error, not a KeyError)."""
    try:
        ok = (isinstance(state["torch"], torch.Tensor) and isinstance(state["numpy"]["keys"], torch.Tensor)
              and state["numpy"]["keys"].numel() == 624 and isinstance(state["python"]["state"], torch.Tensor)
              and state["python"]["state"].numel() == 625)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: not the generator states flopwise writes (torch, numpy, python)")
    for i, rank in enumerate(state.get("ranks") or []):
        _check_rng(rank, Path(f"{where} (rank {i})"))
    return state


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


def file_entry(path: Path) -> dict[str, int]:
    """A manifest entry (size, CRC32) for a file written by someone else (DCP's shards)."""
    return {"bytes": path.stat().st_size, "crc32": _file_crc(path)}


# --------------------------------------------------------------------------- find, verify, load

def is_complete(path: Path) -> bool:
    """A ``step-*`` directory with its marker: the only kind :func:`list_checkpoints` returns."""
    return bool(_STEP_RE.match(path.name)) and (path / MARKER).is_file()


def unmarked_checkpoints(run_dir: str | Path) -> list[Path]:
    """``step-*`` directories without the marker (tampered with, or written before markers existed)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP_RE.match(p.name) and p.is_dir() and not (p / MARKER).exists()),
                  key=lambda p: int(p.name[5:]))


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
        raise CheckpointError(f"{path}: no {MARKER} marker, so nothing vouches for its files (a checkpoint is "
                              f"published with its manifest; this one was altered or written by a flopwise older "
                              f"than markers). If you trust it: `flopwise checkpoint adopt {path}`")
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(w, dict) and isinstance(w.get("bytes"), int)
                                                   and isinstance(w.get("crc32"), int) for w in files.values()):
            raise TypeError("'files' is not a map of name -> {bytes, crc32}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable manifest ({e})") from None
    if "state.json" not in files:
        raise CheckpointError(f"{marker}: the manifest lists no state.json")
    for name, want in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{marker}: the manifest names a file outside the checkpoint: {name!r}")
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
    ``state.json`` with the RNG states under ``"rng"`` when the checkpoint has them.

    ``verify=False`` only when the caller has just verified it (every rank of a data-parallel
    run loads what rank 0 verified once)."""
    path = Path(path)
    sharded = (path / SHARDED).is_dir()
    if not sharded and not (path / "model.pt").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint (no model.pt or {SHARDED}/)")
    if verify:
        verify_checkpoint(path)
    state = read_state(path)  # malformed state is named before any tensor is read
    if sharded:  # written by FSDP2 ranks (torch.distributed.checkpoint); read at any world size
        from flopwise.train.dist_checkpoint import load_sharded

        load_sharded(path / SHARDED, model, optimizer)
    else:
        model.load_state_dict(load_tensors(path / "model.pt", map_location))
    if optimizer is not None and not sharded:
        if not (path / "optimizer.pt").is_file():
            raise FileNotFoundError(f"{path}: no optimizer.pt to resume the optimizer from")
        optimizer.load_state_dict(load_tensors(path / "optimizer.pt", map_location))
    return state


def load_tensors(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` restricted to tensors and plain containers (``weights_only=True``): a file
    that asks for anything else -- a pickled callable -- is refused, never run."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: holds objects other than tensors, numbers and strings; refused "
                              f"(loading them could run code): {str(e).splitlines()[0][:200]}") from None
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable torch file ({str(e).splitlines()[0][:200]})") from None


# state.json: field -> (allowed types, must be >= 0)
_STATE_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "step": ((int,), True), "tokens": ((int,), True), "val_loss_start": ((float, int, type(None)), False),
    "loader": ((dict,), False), "loader_ranks": ((list,), False), "guard": ((dict,), False),
    "data_fingerprint": ((str, type(None)), False), "grad_scaler": ((dict,), False),
    "val_windows": ((int,), True),
}


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``, checked field by field, with its RNG states under ``"rng"``."""
    f = path / "state.json"
    try:
        state = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing from the checkpoint") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    problems = state_problems(state, path)
    if problems:
        raise CheckpointError(f"{f}: " + "; ".join(problems))
    if (path / "rng.pt").is_file():
        state["rng"] = _check_rng(load_tensors(path / "rng.pt"), path / "rng.pt")
    return state


def state_problems(state: Any, path: Path) -> list[str]:
    """What is wrong with a ``state.json`` (empty when nothing is): types, signs, the step of its name."""
    if not isinstance(state, dict):
        return [f"expected a JSON object, found {type(state).__name__}"]
    out = []
    for name, (types, non_negative) in _STATE_FIELDS.items():
        if name not in state:
            if name in ("step", "tokens"):
                out.append(f"field {name!r} is missing")
            continue
        v = state[name]
        if isinstance(v, bool) or not isinstance(v, types):
            out.append(f"field {name!r} = {v!r}: expected {' or '.join(t.__name__ for t in types)}")
        elif non_negative and v < 0:
            out.append(f"field {name!r} = {v!r}: must be >= 0")
    m = _STEP_RE.match(path.name)
    if m and isinstance(state.get("step"), int) and state["step"] != int(m.group(1)):
        out.append(f"field 'step' = {state['step']} but the directory is {path.name}")
    return out


def adopt_checkpoint(path: str | Path) -> dict[str, Any]:
    """Vouch for a checkpoint without a marker (written before markers existed): check that
    ``state.json`` is sound and every tensor file loads as plain tensors, then write its
    manifest, after which it is verified like any other. Returns the manifest."""
    path = Path(path)
    if (path / MARKER).is_file():
        return verify_checkpoint(path)
    if not (path / "model.pt").is_file() and not (path / SHARDED).is_dir():
        raise CheckpointError(f"{path}: not a checkpoint (no model.pt or {SHARDED}/)")
    read_state(path)  # sound state.json, safe rng.pt
    for name in ("model.pt", "optimizer.pt"):
        if (path / name).is_file():
            tensors = load_tensors(path / name)
            bad = [k for k, v in _flat_tensors(tensors) if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad and name == "model.pt":
                raise CheckpointError(f"{path / name}: non-finite weights in {', '.join(bad[:5])}: not adopted")
    write_manifest(path, adopted=True)
    return verify_checkpoint(path)


def write_manifest(path: Path, **extra: Any) -> None:
    """Seal a directory of checkpoint files written by other means (an export, an adopted
    checkpoint): the sizes and CRC32s of every file, written atomically as its ``COMPLETE``."""
    files = {str(p.relative_to(path)): file_entry(p) for p in sorted(path.rglob("*"))
             if p.is_file() and p.name != MARKER}
    step = json.loads((path / "state.json").read_text()).get("step")
    manifest = json.dumps({"format": FORMAT_VERSION, "step": step, "files": files, **extra}, indent=2).encode()
    _write(path / f".{MARKER}.tmp", lambda f: f.write(manifest))
    os.replace(path / f".{MARKER}.tmp", path / MARKER)
    fsync_dir(path)


def _flat_tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _flat_tensors(v, f"{prefix}.{i}")]
    return []


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
