"""Checkpoints during training: where a run starts, saves, retention, and the generator states they carry.

**Where a run starts** (:func:`start_run`): ``flopwise train`` on a run directory that already
holds a run resumes it from its latest complete checkpoint, unless the configuration changed in
a way that would make the continuation a different training (architecture, vocabulary,
sequence length, global batch, loader, data): then it refuses, naming the field, and
``--fresh`` starts over (the old run is kept, renamed aside). Everything is decided before
data is read or a model is built. One writer per run: :func:`start_run` takes the run
directory's lock (``fsio.DirLock``) before it looks inside, and the caller holds it until the
run ends. A second ``flopwise train`` on the same directory is refused with the holder's pid
and command; the lock of a killed run dies with its process, so resuming after ``kill -9``
just works. What a resume is checked against is the configuration its latest checkpoint was
trained with -- the copy saved with the weights -- whatever became of the run's ``config.yaml``
(written atomically and listed with its checksum in the run's ``manifest.json``, yet perhaps
edited by hand or cut): a refusal names the field, the checkpoint's value and this
configuration's, and the resume note lists every setting that trains differently from the
checkpoint's (:func:`config_changes`). Only a run with no checkpoint yet is checked against its
``config.yaml``, if that is still the file the run wrote.

**Saves.**

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

import contextlib
import dataclasses
import os
import random
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flopwise.checkpoints import (
    CHECKPOINT_DIR,
    MARKER,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    unmarked_checkpoints,
)
from flopwise.config import SECTIONS, ConfigError, RunConfig, checksum_problem, load_run_config, recorded_paths
from flopwise.errors import shown
from flopwise.fsio import (
    DirLock,
    LockedError,
    describe_write_error,
    fsync_dir,
    loads_json,
    write_file,
    write_json,
    write_reason,
)
from flopwise.manifest import FORMAT_VERSION, file_entry, run_file_problem, write_checksummed

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
        write_json(tmp / "state.json", {"step": step, **state})
        files["state.json"] = file_entry(tmp / "state.json")
        files["config.yaml"] = write_checksummed(tmp / "config.yaml", lambda f: f.write(config_yaml.encode()))
        write_json(tmp / MARKER, {"format": FORMAT_VERSION, "step": step, "files": files})  # last: the seal
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


# Model fields that may change between a run and its resumption: the kernel choice and
# training-only knobs. Every other model field shapes the weights or their meaning.
# --------------------------------------------------------------------------- where a run starts

RESUMABLE_MODEL_FIELDS = {"attention", "attention_strict", "doc_mask", "hf_config", "init_std",
                          "moe_aux_loss_coef", "moe_z_loss_coef"}
BREAKING_FIELDS = (("train", "seq_len"), ("train", "global_batch_size"), ("data", "loader"), ("optim", "name"),
                   ("train", "batch_ramp_tokens"), ("train", "batch_ramp_start"))


@dataclass
class RunStart:
    run_dir: Path
    checkpoint: Path | None  # resume from here; None = step 0
    resumed_run: bool  # the directory held this run before (resumed, or restarted without a checkpoint)
    note: str
    changes: str = ""  # a resume: the settings this configuration changes from the checkpoint's


def resume_conflicts(old: RunConfig, new: RunConfig) -> list[tuple[str, Any, Any]]:
    """Fields whose change breaks an exact continuation: ``(field, old value, new value)``."""
    out = []
    for f in dataclasses.fields(old.model):
        if f.name in RESUMABLE_MODEL_FIELDS:
            continue
        a, b = getattr(old.model, f.name), getattr(new.model, f.name)
        if a != b:
            out.append((f"model.{f.name}", a, b))
    for section, name in BREAKING_FIELDS:
        a, b = getattr(getattr(old, section), name), getattr(getattr(new, section), name)
        if a != b:
            out.append((f"{section}.{name}", a, b))
    return out


def _conflict_message(run_dir: Path, conflict: tuple[str, Any, Any], source: str) -> str:
    name, old, new = conflict
    hint = (" (the default became epoch: add data.loader=random to continue this run)"
            if name == "data.loader" and old == "random" else "")
    return (f"train.run_dir {str(run_dir)!r}: {name} is {shown(new)} in this configuration but {shown(old)} in "
            f"{source}{hint}: this configuration cannot continue that run; pass --fresh to start over (the old "
            "run is kept, renamed aside)")


def config_changes(old: RunConfig, new: RunConfig) -> list[str]:
    """Every setting in which ``new`` differs from ``old``, as 'field: old -> new' (``new``'s
    relative paths resolved, as its config.yaml will record them; where the run is, aside)."""
    recorded, _ = recorded_paths(new)
    out = []
    for section in SECTIONS:
        a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(recorded, section))
        out += [f"{section}.{k}: {shown(a[k])} -> {shown(b[k])}" for k in a
                if a[k] != b.get(k) and f"{section}.{k}" != "train.run_dir"]
    return out


def _check_writable(run_dir: Path) -> None:
    """Prove the run directory (made by its lock, which removes it again if the run leaves
    nothing else) has room for a file, leaving no trace even when the disk is full."""
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"ok" * 2048)  # a few KiB: a disk with no room for a file fails here, not at step 1000
    except OSError as e:
        raise ConfigError([f"train.run_dir {str(run_dir)!r} is not writable: {write_reason(e)}"]) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()  # also when the write failed half-way


def start_run(cfg: RunConfig, fresh: bool = False, locks: contextlib.ExitStack | None = None) -> RunStart:
    """Decide where the run starts; ``cfg.train.run_dir`` is filled in when empty.

    The run directory's lock is taken first and handed to ``locks`` (released when the caller
    closes it); without ``locks`` it is released on return (a dry decision, e.g. ``--explain``)."""
    if not cfg.train.run_dir:
        cfg.train.run_dir = str(Path("runs") / f"{cfg.preset or 'run'}-{datetime.now():%Y%m%d-%H%M%S}")
    run_dir = Path(cfg.train.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"train.run_dir {str(run_dir)!r} exists and is not a directory"])
    with contextlib.ExitStack() as held:
        held.enter_context(_lock(run_dir))
        start = _decide(cfg, run_dir, fresh, held)
        if locks is not None:
            locks.push(held.pop_all())
        return start


def _lock(run_dir: Path) -> DirLock:
    lock = DirLock(run_dir, "flopwise train")
    try:
        return lock.acquire()
    except LockedError as e:
        raise ConfigError([f"train.run_dir: {e}"]) from None
    except OSError as e:
        raise ConfigError([f"train.run_dir {str(run_dir)!r} is not writable: {write_reason(e)}"]) from None


def _decide(cfg: RunConfig, run_dir: Path, fresh: bool, held: contextlib.ExitStack) -> RunStart:
    holds_run = (run_dir / "config.yaml").is_file() or (run_dir / CHECKPOINT_DIR).is_dir()
    if holds_run and fresh:
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{datetime.now():%Y%m%d-%H%M%S}")
        os.replace(run_dir, aside)  # the lock moves with it: nobody else can have started writing there
        held.enter_context(_lock(run_dir))
        _check_writable(run_dir)
        return RunStart(run_dir, None, False, f"--fresh: the previous run was moved to {aside}")
    if not holds_run:
        _check_writable(run_dir)
        return RunStart(run_dir, None, False, "new run")
    record = run_dir / "run.json"  # the run's starts go on in it: a changed or torn one is refused, not extended
    problem = run_file_problem(run_dir, record.name) if record.is_file() else None
    if problem:
        raise CheckpointError(f"{record}: {problem}; restore it, or pass --fresh to start over (the old run is kept, "
                              "renamed aside)")
    ckpt = latest_checkpoint(run_dir)
    old, source, note = _previous_config(run_dir, ckpt)
    conflicts = resume_conflicts(old, cfg)
    if conflicts:
        raise ConfigError([_conflict_message(run_dir, c, source) for c in conflicts])
    _check_writable(run_dir)
    unmarked = [p for p in unmarked_checkpoints(run_dir) if ckpt is None or int(p.name[5:]) > int(ckpt.name[5:])]
    if unmarked:  # resuming from an older step (or step 0) would silently train over them
        raise ConfigError([f"train.run_dir {str(run_dir)!r}: {unmarked[-1]} has no COMPLETE marker, so it is "
                           "not loaded unverified (tampered with, or written by a flopwise older than markers); "
                           f"if you trust it, `flopwise checkpoint adopt {unmarked[-1]}`, else remove it "
                           "or pass --fresh"])
    if ckpt is None:
        return RunStart(run_dir, None, True, note + "the run directory has no complete checkpoint: starting at step 0")
    changes = config_changes(old, cfg)
    shown_changes = ", ".join(changes[:MAX_CHANGES_SHOWN]) + (
        f" and {len(changes) - MAX_CHANGES_SHOWN} more" if len(changes) > MAX_CHANGES_SHOWN else "")
    trains = (f"training this configuration, which differs from the checkpoint's ({ckpt / 'config.yaml'}) in "
              f"{shown_changes}" if changes else "")
    return RunStart(run_dir, ckpt, True, f"{note}resuming from {ckpt}", trains)


MAX_CHANGES_SHOWN = 8  # settings the resume note lists; the rest are counted


def _previous_config(run_dir: Path, ckpt: Path | None) -> tuple[RunConfig, str, str]:
    """What a resume must agree with: the configuration the latest checkpoint ``ckpt`` was trained
    with (its own copy, written with its weights), whatever became of the run's ``config.yaml``
    -- edited by hand or cut. Without a checkpoint (or one whose copy
    cannot be read) the run's ``config.yaml``, if it is the one the run wrote. Returns it, where
    it came from (for an error), and a note on the run's config.yaml ("" when it is as written)."""
    own = run_dir / "config.yaml"
    try:
        edited = run_file_problem(run_dir, "config.yaml")  # an edited file is not read: nothing it says is trusted
        if edited is None:  # recorded before the run's manifest: its checksum is a comment line in it
            edited = checksum_problem(own)
        own_cfg, problem = (None, f"was {edited}") if edited else (load_run_config(own), "")
    except (ConfigError, OSError) as e:
        own_cfg = None
        problem = "is unreadable (" + ("; ".join(e.problems) if isinstance(e, ConfigError)
                                       else describe_write_error(e)) + ")"
    if ckpt is not None:
        try:
            recorded = load_run_config(ckpt / "config.yaml")
        except (ConfigError, OSError):
            recorded = None
        if recorded is not None:
            note = f"{own} {problem}: checked against {ckpt / 'config.yaml'} instead; " if problem else ""
            return recorded, f"the checkpoint {ckpt} (what its weights were trained with)", note
    if own_cfg is not None:
        return own_cfg, str(own), ""
    raise ConfigError([f"train.run_dir {str(run_dir)!r} holds a run whose config.yaml {problem} and no checkpoint "
                       "with a readable copy of it; pass --fresh to start over"])


def truncate_metrics(path: Path, step: int, kept: str = "") -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step``: a crashed run may have logged steps
    its last checkpoint does not hold, and they are about to be trained again."""
    if not path.is_file():
        return
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = loads_json(line, str(path))
        except ValueError:  # a line cut by a kill
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            rows.append(line)
    # a full disk leaves the old file, no .tmp; its error says so, then ``kept`` (the run's checkpoint)
    write_file(path, "".join(f"{line}\n" for line in rows), "the metrics", kept)
