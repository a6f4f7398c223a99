"""The checkpoint directory -- ``RUN/checkpoints/step-NNNNNNN/`` -- and how to find, verify and read one.

Below both sides that use it: ``train/`` writes checkpoints (``train/checkpoint.py``: save,
retention, RNG states; ``train/dist_checkpoint.py``: who writes what under data parallelism),
``model/io.py`` and ``evaluate/`` read them. So this module imports nothing from ``train/``,
``model/`` or ``evaluate/``.

A checkpoint holds ``model.pt`` and ``optimizer.pt`` (or, written by FSDP2 ranks, ``sharded/``:
the ``torch.distributed.checkpoint`` files of both, one per rank), ``rng.pt`` (torch, CUDA, numpy
and Python generator states), ``state.json`` (step, tokens, loader position, ...),
``config.yaml`` and, written last, ``COMPLETE``: the manifest of every file's size and CRC32.

A directory named ``step-*`` with a ``COMPLETE`` inside is whole; anything else (a ``.tmp-*``
left by a kill or a full disk, a directory without the marker) is never picked by
:func:`latest_checkpoint`. Loading verifies every file against the manifest first: a flipped
byte is an error naming the file, and a directory without the marker is refused -- it is
either tampered with or was written by a flopwise too old to write markers; ``flopwise
checkpoint adopt PATH`` vouches for such a one explicitly (:func:`adopt_checkpoint`).

Nothing read from a checkpoint can run code: tensors are read with ``torch.load(...,
weights_only=True)``, the RNG states are stored as tensors and numbers (not numpy or Python
objects, which only a full unpickler reads), ``state.json`` is JSON whose fields are checked.
DCP stores a sharded checkpoint's index (``sharded/.metadata``) as a pickle and non-tensor
values (the optimizer's hyper-parameters) as ``torch.save`` blobs that its default planner
reads with a full unpickler. Both would run whatever a crafted file asks for, so flopwise reads
them itself: the index through an unpickler that knows only DCP's own metadata classes, the
blobs with ``weights_only=True`` (:func:`safe_dcp_reader`).
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from flopwise.fsio import FileFormatError, read_json, write_json
from flopwise.manifest import FORMAT_VERSION, CheckpointError, entry_problem, file_entry, read_manifest

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE"
SHARDED = "sharded"  # a sharded checkpoint's torch.distributed.checkpoint files (model and optimizer)
STEP_RE = re.compile(r"^step-(\d{7,})$")


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:07d}"


# --------------------------------------------------------------------------- sealing

def write_manifest(path: Path, **extra: Any) -> None:
    """Seal a directory of checkpoint files written by other means (an export, an adopted
    checkpoint): the sizes and CRC32s of every file, written atomically as its ``COMPLETE``."""
    files = {str(p.relative_to(path)): file_entry(p) for p in sorted(path.rglob("*"))
             if p.is_file() and p.name != MARKER}
    state = read_state_json(path)
    step = state.get("step") if isinstance(state, dict) else None
    write_json(path / MARKER, {"format": FORMAT_VERSION, "step": step, "files": files, **extra})


def intact_note(checkpoint: Path | str | None) -> str:
    """What a write fault leaves a run: its last checkpoint, which the same command resumes from
    (a WriteError's ``kept``); "" when none was saved yet."""
    return f"the checkpoint {checkpoint} is intact: the same command resumes from it once there is room" \
        if checkpoint else ""


# --------------------------------------------------------------------------- find

def is_complete(path: Path) -> bool:
    """A ``step-*`` directory with its marker: the only kind :func:`list_checkpoints` returns."""
    return bool(STEP_RE.match(path.name)) and (path / MARKER).is_file()


def unmarked_checkpoints(run_dir: str | Path) -> list[Path]:
    """``step-*`` directories without the marker (tampered with, or written before markers existed)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_RE.match(p.name) and p.is_dir() and not (p / MARKER).exists()),
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


# --------------------------------------------------------------------------- verify

def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path}: no {MARKER} marker, so nothing vouches for its files (a checkpoint is "
                              f"published with its manifest; this one was altered or written by a flopwise older "
                              f"than markers). If you trust it: `flopwise checkpoint adopt {path}`")
    manifest = read_manifest(marker)
    files = manifest["files"]
    if "state.json" not in files:
        raise CheckpointError(f"{marker}: the manifest lists no state.json")
    for name, want in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{marker}: the manifest names a file outside the checkpoint: {name!r}")
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint")
        problem = entry_problem(f, want)
        if problem:
            raise CheckpointError(f"{f}: {problem}")
    return manifest


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


def _flat_tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _flat_tensors(v, f"{prefix}.{i}")]
    return []


# --------------------------------------------------------------------------- read

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
    state = read_state_json(path)
    problems = state_problems(state, path)
    if problems:
        raise CheckpointError(f"{f}: " + "; ".join(problems))
    if (path / "rng.pt").is_file():
        state["rng"] = _check_rng(load_tensors(path / "rng.pt"), path / "rng.pt")
    return state


def read_state_json(path: Path) -> Any:
    """The JSON of a checkpoint's ``state.json``, unchecked; :class:`CheckpointError` naming it
    when it is missing or not JSON."""
    f = path / "state.json"
    try:
        return read_json(f)
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing from the checkpoint") from None
    except FileFormatError as e:
        raise CheckpointError(str(e)) from None


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
        elif non_negative and isinstance(v, (int, float)) and v < 0:  # (those fields are ints)
            out.append(f"field {name!r} = {v!r}: must be >= 0")
    m = STEP_RE.match(path.name)
    if m and isinstance(state.get("step"), int) and state["step"] != int(m.group(1)):
        out.append(f"field 'step' = {state['step']} but the directory is {path.name}")
    return out


def _check_rng(state: Any, where: Path) -> dict[str, Any]:
    """``rng.pt``'s content has the shape ``train/checkpoint.py``'s ``set_rng_state`` reads (else a
    named error, not a KeyError)."""
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


# --------------------------------------------------------------------------- sharded (DCP) checkpoints

def load_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 group: Any = None) -> None:
    """A ``sharded/`` directory into ``model`` (plain, DDP's inner module or FSDP2-sharded) and
    ``optimizer``: DCP reads each rank's part of every tensor, whatever the saving world size
    (in one process without a process group -- eval, export -- it reads everything). ``group``:
    the ranks that read it together (a DiLoCo worker group; None: all of them)."""
    # lazy: torch.distributed.checkpoint costs ~0.8 s to import; only a sharded checkpoint needs it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    safe_reader, safe_planner = safe_dcp_reader()
    reader, planner = safe_reader(directory), safe_planner()
    reader.read_metadata()  # a refused index is named here, not inside DCP's collective error report
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            if optimizer is None:
                sd = {"model": model.state_dict()}
                dcp.load(sd, storage_reader=reader, planner=planner)
                model.load_state_dict(sd["model"])
                return
            model_sd, optim_sd = get_state_dict(model, optimizer)
            sd = {"model": model_sd, "optim": optim_sd}
            dcp.load(sd, storage_reader=reader, planner=planner, process_group=group)
        except CheckpointException as e:  # a BaseException: every rank's failures, ours among them
            cause = first_failure(e)
            raise (cause if isinstance(cause, CheckpointError) else CheckpointError(
                f"{directory}: cannot read the sharded checkpoint: {cause}")) from None
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def first_failure(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (``e`` itself otherwise)."""
    failures = getattr(e, "failures", None) or {}
    for _, wrapped in sorted(failures.items()):
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return e


# The classes a DCP index is made of (torch.distributed.checkpoint.metadata / .filesystem), and
# the plain values inside them. Anything else in the pickle -- os.system, builtins.eval, a
# class with a side-effecting __setstate__ -- is refused before it is looked up.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("torch._utils", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
     ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


@functools.cache
def safe_dcp_reader() -> tuple[type, type]:
    """``(SafeReader, SafeLoadPlanner)``: DCP's file reader with its index read through an
    allow-list instead of ``pickle.load``, and DCP's default load planner, but a non-tensor value
    must load with ``weights_only=True`` (numbers, strings, containers -- what an optimizer's
    hyper-parameters are) before it is used. Made on first use: they subclass DCP's classes."""
    # lazy: torch.distributed.checkpoint costs ~0.8 s to import; only a sharded checkpoint needs it
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    assert dcp_metadata.__name__ == _DCP_METADATA

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            try:
                with open(path, "rb") as f:
                    metadata = _IndexUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: not a checkpoint index that flopwise reads (refused, nothing "
                                      f"in it was run): {e}") from None
            if not isinstance(metadata, dcp_metadata.Metadata):
                raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not a checkpoint index")
            storage = getattr(metadata, "storage_meta", None)
            if storage is None:
                storage = metadata.storage_meta = dcp_metadata.StorageMeta()
            storage.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"a value of {read_item.dest_index.fqn} in the sharded checkpoint holds "
                                      f"objects other than tensors, numbers and strings; refused: "
                                      f"{str(e).splitlines()[0][:200]}") from None
            value.seek(0)
            super().load_bytes(read_item, value)  # checked: safe for the full unpickler it uses

    return SafeReader, SafeLoadPlanner
