"""Where a run starts: a fresh run directory, or the latest complete checkpoint of an existing one.

``flopwise train`` on a run directory that already holds a run resumes it, unless the
configuration changed in a way that would make the continuation a different training
(architecture, vocabulary, sequence length, global batch, loader, data): then it refuses,
naming the field, and ``--fresh`` starts over (the old run is kept, renamed aside).
Everything is decided before data is read or a model is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from flopwise.config import ConfigError, RunConfig, load_run_config
from flopwise.train.checkpoint import latest_checkpoint

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
            out.append(f"{section}.{name}: {a!r} -> {b!r}")
    return out


def _check_writable(run_dir: Path) -> None:
    """Prove the run directory can be written, leaving no trace: directories this check
    creates are removed again (a run that fails on its data must not leave an empty run)."""
    created = [p for p in [run_dir, *run_dir.parents] if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError([f"train.run_dir {str(run_dir)!r} is not writable: {e.strerror or e}"]) from None
    finally:
        for p in created:  # deepest first
            try:
                p.rmdir()
            except OSError:
                break


def start_run(cfg: RunConfig, fresh: bool = False) -> RunStart:
    """Decide where the run starts; ``cfg.train.run_dir`` is filled in when empty."""
    if not cfg.train.run_dir:
        cfg.train.run_dir = str(Path("runs") / f"{cfg.preset or 'run'}-{datetime.now():%Y%m%d-%H%M%S}")
    run_dir = Path(cfg.train.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"train.run_dir {str(run_dir)!r} exists and is not a directory"])
    holds_run = (run_dir / "config.yaml").is_file()
    if holds_run and fresh:
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{datetime.now():%Y%m%d-%H%M%S}")
        os.replace(run_dir, aside)
        _check_writable(run_dir)
        return RunStart(run_dir, None, False, f"--fresh: the previous run was moved to {aside}")
    if not holds_run:
        _check_writable(run_dir)
        return RunStart(run_dir, None, False, "new run")
    try:
        old = load_run_config(run_dir / "config.yaml")
    except ConfigError as e:
        raise ConfigError([f"train.run_dir {str(run_dir)!r} holds a run whose config.yaml cannot be read "
                           f"({'; '.join(e.problems)}); pass --fresh to start over"]) from None
    conflicts = resume_conflicts(old, cfg)
    if conflicts:
        raise ConfigError([f"train.run_dir {str(run_dir)!r} holds a run that this configuration cannot "
                           f"continue ({c}); pass --fresh to start over (the old run is kept, renamed aside)"
                           for c in conflicts])
    _check_writable(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return RunStart(run_dir, None, True, "the run directory has no complete checkpoint: starting at step 0")
    return RunStart(run_dir, ckpt, True, f"resuming from {ckpt}")


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
