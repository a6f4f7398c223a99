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
from pathlib import Path

import yaml
from helpers import run_flopwise, tiny_model_overrides


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    return run_flopwise(args, cwd=cwd, env=env, timeout=900)


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


# Issue 45, item 11: no minutes of silence. Before a phase of long steps preflight says how long
# one will take here (the step's FLOPs at a rate: an estimate, labelled so), and within each step
# it says which micro-batch it is at and what is left, at most every PROGRESS_EVERY_S of its
# clock. The clock is the test's (every reading 3 s later), the steps the real trainer's.


class Ticks:
    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_a_long_step_is_announced_with_an_estimate_and_followed_micro_batch_by_micro_batch(tiny_overrides,
                                                                                          tmp_path):
    from flopwise.config import build_config
    from flopwise.tune.preflight import preflight
    from flopwise.tune.request import TuneHooks, TuneRequest

    # a datasheet peak of 1 MFLOP/s makes a step of the tiny model (~1 GFLOP) minutes long
    cfg = build_config(overrides=tiny_overrides + [
        "train.max_steps=100", "train.compile=off", "train.threads=1", "train.micro_batch_size=2",
        "train.peak_tflops=0.000001"])

    def scripted(c, spec, device):  # the search's trials: only the end-to-end check trains here
        return {"tok_per_s": 1000.0, "tok_per_s_windows": [995.0, 1000.0, 1005.0], "peak_gb": None,
                "data_share": 0.01, "first_loss": 9.0}

    lines: list[str] = []
    preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append, remeasure_rounds=0),
              TuneHooks(measure_fn=scripted, clock=Ticks(3.0)))
    done = next(i for i, x in enumerate(lines) if x.startswith("preflight: end to end OK"))
    said = [x for x in lines[:done] if x.startswith("preflight: end-to-end check: 4 steps")]
    assert said and "an estimate" in said[0] and "a step here" in said[0], lines[:done]
    assert "40% of" in said[0], said  # the rate it assumed, named
    within = [x for x in lines[:done] if x.startswith("preflight: end-to-end check step ")]
    assert within, lines[:done]
    assert any(" micro-batch " in x and "/8" in x and "left in this step" in x for x in within), within
    assert {x.split(":")[1].split()[-1] for x in within} >= {"1/4", "4/4"}, within  # every step, not only the first
    search = next(x for x in lines if x.startswith("preflight: each trial: 2 warm-up + 3 timed steps"))
    assert "a step here" in search and "an estimate" in search, search
