"""Where a run starts: a fresh run directory, or the latest complete checkpoint of an existing one.

``flopwise train`` on a run directory that already holds a run resumes it, unless the
configuration changed in a way that would make the continuation a different training
(architecture, vocabulary, sequence length, global batch, loader, data): then it refuses,
naming the field, and ``--fresh`` starts over (the old run is kept, renamed aside).
Everything is decided before data is read or a model is built.

One writer per run: :func:`start_run` takes the run directory's lock (``fsio.DirLock``)
before it looks inside, and the caller holds it until the run ends. A second ``flopwise
train`` on the same directory is refused with the holder's pid and command; the lock of a
killed run dies with its process, so resuming after ``kill -9`` just works. The run's
``config.yaml`` is written atomically with its checksum in a last comment line; if it is
unreadable anyway or no longer matches its checksum (a copy edited by hand, a file from an
older version written in place), the latest checkpoint's own copy decides, with a note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from flopwise.checkpoints import CHECKPOINT_DIR, latest_checkpoint, unmarked_checkpoints
from flopwise.config import ConfigError, RunConfig, checksum_problem, load_run_config
from flopwise.fsio import DirLock, LockedError, describe_write_error, write_file, write_reason

# Model fields that may change between a run and its resumption: the kernel choice and
# training-only knobs. Every other model field shapes the weights or their meaning.
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


def resume_conflicts(old: RunConfig, new: RunConfig) -> list[str]:
    """Fields whose change breaks an exact continuation, as 'field: old -> new'."""
    out = []
    for f in dataclasses.fields(old.model):
        if f.name in RESUMABLE_MODEL_FIELDS:
            continue
        a, b = getattr(old.model, f.name), getattr(new.model, f.name)
        if a != b:
            out.append(f"model.{f.name}: {a!r} -> {b!r}")
    for section, name in BREAKING_FIELDS:
        a, b = getattr(getattr(old, section), name), getattr(getattr(new, section), name)
        if a != b:
            hint = (" (the default became epoch: add data.loader=random to continue this run)"
                    if (section, name) == ("data", "loader") and a == "random" else "")
            out.append(f"{section}.{name}: {a!r} -> {b!r}{hint}")
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
    old, note = _previous_config(run_dir)
    conflicts = resume_conflicts(old, cfg)
    if conflicts:
        raise ConfigError([f"train.run_dir {str(run_dir)!r} holds a run that this configuration cannot "
                           f"continue ({c}); pass --fresh to start over (the old run is kept, renamed aside)"
                           for c in conflicts])
    _check_writable(run_dir)
    ckpt = latest_checkpoint(run_dir)
    unmarked = [p for p in unmarked_checkpoints(run_dir) if ckpt is None or int(p.name[5:]) > int(ckpt.name[5:])]
    if unmarked:  # resuming from an older step (or step 0) would silently train over them
        raise ConfigError([f"train.run_dir {str(run_dir)!r}: {unmarked[-1]} has no COMPLETE marker, so it is "
                           "not loaded unverified (tampered with, or written by a flopwise older than markers); "
                           f"if you trust it, `flopwise checkpoint adopt {unmarked[-1]}`, else remove it "
                           "or pass --fresh"])
    if ckpt is None:
        return RunStart(run_dir, None, True, note + "the run directory has no complete checkpoint: starting at step 0")
    return RunStart(run_dir, ckpt, True, f"{note}resuming from {ckpt}")


def _previous_config(run_dir: Path) -> tuple[RunConfig, str]:
    """The configuration the run was trained with: its ``config.yaml``, or when that cannot be
    read, the copy inside its latest checkpoint (written with the checkpoint, so it is what the
    weights were trained with). Returns it and a note for the log ("" when the run's own copy served)."""
    try:
        changed = checksum_problem(run_dir / "config.yaml")
        if changed:
            raise ConfigError([changed])
        return load_run_config(run_dir / "config.yaml"), ""
    except (ConfigError, OSError) as e:
        problem = "; ".join(e.problems) if isinstance(e, ConfigError) else describe_write_error(e)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        try:
            return load_run_config(ckpt / "config.yaml"), (f"{run_dir / 'config.yaml'} is unreadable ({problem}): "
                                                           f"using {ckpt / 'config.yaml'}; ")
        except ConfigError:
            pass
    raise ConfigError([f"train.run_dir {str(run_dir)!r} holds a run whose config.yaml cannot be read "
                       f"({problem}) and no checkpoint with a readable one; pass --fresh to start over"])


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step``: a crashed run may have logged steps
    its last checkpoint does not hold, and they are about to be trained again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    write_file(path, "".join(f"{line}\n" for line in kept), "the metrics")  # a full disk leaves the old file, no .tmp
