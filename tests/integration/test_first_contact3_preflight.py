"""Issue 45, item 9: what preflight writes for a later command works from any directory.

A real ``flopwise preflight`` run in one directory with a relative ``data.path`` and
``data.cache_dir`` (as a user types them) writes ``preflight.yaml`` and prints the command that
trains it; that command, run as printed from another directory, trains -- as a run's own
``config.yaml`` already does (config.py's ``recorded_paths``: one rule for both)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from helpers import tiny_model_overrides


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "flopwise", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=900)


def test_the_command_preflight_prints_trains_from_another_directory(small_builtin, tmp_path):
    _, prepared = small_builtin
    here, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    shutil.copytree(prepared, here / "data")  # the user's data, beside their project, named relatively
    overrides = [o for o in tiny_model_overrides(here / "cache") if not o.startswith("data.cache_dir=")]
    overrides += ["data.path=data", "data.cache_dir=cache", "train.max_steps=2", "train.compile=off",
                  "train.threads=1", "eval.every=0", "eval.sample_tokens=0"]
    done = run(["preflight", "--warmup", "0", "--steps", "1", "--budget-minutes", "1", *overrides], here)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = re.search(r"\((flopwise train --config [^)]+)\)\s*$", done.stdout.strip())
    assert printed, done.stdout[-2000:]
    tuned = yaml.safe_load(Path(here, shlex.split(printed.group(1))[-1]).read_text())
    assert tuned["data"]["path"] == str((here / "data").resolve()), tuned["data"]
    assert tuned["data"]["cache_dir"] == str((here / "cache").resolve()), tuned["data"]

    command = shlex.split(printed.group(1))[1:]  # `flopwise` is this interpreter's `-m flopwise`
    trained = run(command, elsewhere)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    runs = list((elsewhere / "runs").glob("*/metrics.jsonl"))
    assert len(runs) == 1 and runs[0].read_text().strip(), runs
