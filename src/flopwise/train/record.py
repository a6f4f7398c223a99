"""The run's record: what produced it (``run.json``: versions, device, command line, git
commit) and what it gave (:class:`TrainResult`), including for a run that was already finished."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import numpy
import tokenizers
import torch

from flopwise import __version__
from flopwise.checkpoints import CheckpointError
from flopwise.manifest import read_run_json
from flopwise.train.defaults import device_label


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    final_loss: float
    val_loss_start: float
    val_loss_end: float  # the latest validation after step 0; NaN (run.json: null) when none was measured
    uniform_loss: float
    tok_per_s: float | None
    mfu: float | None
    wall_time_s: float
    checkpoint: Path | None
    sample: str
    stopped: str | None = None  # why the run stopped before its last step (signal, max_hours)
    val_loss_end_step: int | None = None  # the step val_loss_end was measured at


def run_record(cfg, device: torch.device, precision: str) -> dict[str, Any]:
    """What produced this run: versions, device, command line."""
    return {
        "flopwise": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "tokenizers": tokenizers.__version__,
        "platform": platform.platform(),
        "device": device_label(device),
        "precision": precision,
        "argv": sys.argv,
        "cwd": os.getcwd(),  # where the command line's relative paths were relative to
        "code": code_version(),
        "started": datetime.now().isoformat(timespec="seconds"),
    }


def ended_start(starts: Any, step: int, averages: dict[str, float | None], wall_s: float) -> Any:
    """run.json's ``starts`` with this process's own (the last) entry closed: the step it ended at,
    its tokens/s and MFU after its warm-up and the seconds they were measured over (so a report
    can pool every start's figures into the whole run's), and its wall time. The run's
    ``result`` is rewritten by each start, and holds the last one's alone."""
    if not isinstance(starts, list) or not starts or not isinstance(starts[-1], dict):
        return starts
    return starts[:-1] + [{**starts[-1], "ended_step": step, "tok_per_s": averages.get("tok_per_s"),
                           "mfu": averages.get("mfu"), "steady_time_s": averages.get("steady_time_s"),
                           "wall_time_s": wall_s}]


def code_version() -> dict[str, Any]:
    """The git commit of flopwise's own source and whether it had uncommitted changes
    (None outside a git checkout, e.g. an installed wheel)."""
    src = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty}


def read_run_record(run_dir: Path) -> dict:
    """The object in ``run_dir/run.json``; {} when there is none. One changed or torn since the
    run wrote it (the run's manifest says) is refused: :class:`CheckpointError` naming it."""
    if not (run_dir / "run.json").is_file():
        return {}
    try:
        record = read_run_json(run_dir, "run.json")
    except CheckpointError as e:
        raise CheckpointError(f"{e}; restore it, or pass --fresh to start over") from None
    return record if isinstance(record, dict) else {}


def finished_run(run_dir: Path, checkpoint: Path, total_steps: int, uniform: float, wall_s: float,
                 log: Callable[[str], None]) -> TrainResult:
    """A run directory whose latest checkpoint already holds ``total_steps`` steps (or more):
    say so and change nothing -- no run.json, metrics, config or checkpoint is rewritten.
    The result is the one the run recorded when it finished (run.json), where there is one."""
    done = int(checkpoint.name[5:])
    prev = read_run_record(run_dir).get("result") or {}
    if not isinstance(prev, dict) or prev.get("steps") != done:
        prev = {}
    if done == total_steps:
        log(f"finished: {run_dir} already holds all {total_steps:,} steps ({checkpoint}); nothing to train, "
            "nothing changed. To train longer, raise train.max_steps (or train.max_tokens); --fresh starts over")
    else:
        log(f"nothing to train: {run_dir} already holds {done:,} steps ({checkpoint}), more than the "
            f"{total_steps:,} asked; nothing changed. Raise train.max_steps (or train.max_tokens) to train "
            "longer; --fresh starts a new run")
    if not prev:
        nan = float("nan")
        return TrainResult(run_dir, done, 0, nan, nan, nan, uniform, None, None, wall_s, checkpoint, "", None)
    return TrainResult(run_dir, done, int(prev.get("tokens") or 0), _num(prev.get("final_loss")),
                       _num(prev.get("val_loss_start")), _num(prev.get("val_loss_end")), uniform,
                       prev.get("tok_per_s"), prev.get("mfu"), wall_s, checkpoint, prev.get("sample") or "", None,
                       prev.get("val_loss_end_step") if isinstance(prev.get("val_loss_end_step"), int) else None)


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else float("nan")
