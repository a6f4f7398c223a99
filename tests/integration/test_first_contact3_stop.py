"""Issue 45, items 1 and 12: what a run that stops reports, and samples during training.

A stop -- ``train.max_hours`` or a signal -- logs its last step, validates (a time budget keeps
room for that validation; a signal validates when it is cheap) and writes a sample, or says
"not measured": never the start's loss again as the end's. ``eval.sample_every`` samples
during training into ``samples.txt`` (each entry with its step) and the report shows them.

Through the real trainer with its clock injected (``tick_clock``: a run's deadline sees time
pass at a fixed pace however loaded this machine is), a real SIGTERM to a real process --
``python -m flopwise train``, or this one -- and the real ``flopwise report`` / ``eval``."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flopwise.cli import main
from flopwise.config import ConfigError, build_config
from flopwise.train import hooks
from flopwise.train.trainer import train

# Nothing logs, validates or samples between step 0 and the stop unless the stop does.
SILENT = ["train.log_every=1000", "eval.every=0", "train.max_steps=2000"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def closing_line(lines: list[str]) -> str:
    return next(line for line in lines if "uniform ln V" in line and "val loss" in line)


def slow_validation(monkeypatch, clock, seconds: float) -> list[float]:
    """Every validation takes ``seconds`` on the run's (injected) clock; returns the list of the
    clock's readings when each validation ended."""
    real, ended = hooks.evaluate_loss, []

    def evaluate_loss(*args, **kwargs):
        clock.now += seconds
        loss = real(*args, **kwargs)
        ended.append(clock.now)
        return loss

    monkeypatch.setattr(hooks, "evaluate_loss", evaluate_loss)
    return ended


def assert_the_stop_reported_progress(run_dir: Path, lines_or_out: str) -> None:
    """The stop's step has a training row, a validation row and a sample; run.json and the
    closing line give that validation, not the start's."""
    record = json.loads((run_dir / "run.json").read_text())["result"]
    step = record["steps"]
    got = rows(run_dir)
    assert any(r["step"] == step and r.get("loss") is not None for r in got), got[-3:]
    val = [r for r in got if r.get("val_loss") is not None]
    assert val[-1]["step"] == step > 0, val
    assert record["val_loss_end"] == pytest.approx(val[-1]["val_loss"])
    assert record["val_loss_end"] != record["val_loss_start"]
    assert f"val loss {record['val_loss_start']:.4f} -> {record['val_loss_end']:.4f}" in lines_or_out
    assert re.search(rf"^--- prompt .* · step {step} ·", (run_dir / "samples.txt").read_text(), re.M)


# --------------------------------------------------------------------------- item 1: a time budget

def test_a_time_budget_stop_validates_logs_its_last_step_and_samples_within_the_budget(
        tiny_overrides, tick_clock, monkeypatch):
    ended = slow_validation(monkeypatch, tick_clock, 2.0)  # a validation is a real share of the 7.2 s budget
    start = tick_clock.now + tick_clock.tick  # the run's first reading of its clock
    cfg = build_config(overrides=tiny_overrides + SILENT + ["train.max_hours=0.002"])
    lines: list[str] = []
    result = train(cfg, log=lines.append, clock=tick_clock)
    assert result.stopped == "train.max_hours=0.002 reached" and 0 < result.steps < 2000
    assert_the_stop_reported_progress(result.run_dir, "\n".join(lines))
    # The validation at the stop was kept room for: it ended within the budget.
    assert len(ended) == 2 and ended[-1] - start <= 0.002 * 3600, [t - start for t in ended]


# --------------------------------------------------------------------------- item 1: a signal

def _wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    """Poll ``condition`` until it holds; fail at once if the process ended first."""
    for _ in range(12000):  # 10 minutes at most: a generous bound, not a timing
        if condition():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def test_a_sigterm_stop_validates_logs_its_last_step_and_samples(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flopwise", "train", *tiny_overrides, *SILENT,
                             "train.checkpoint_every=3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    _wait_for(lambda: (run / "checkpoints" / "step-0000003").is_dir(), proc, "the step-3 checkpoint")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "SIGTERM received: checkpoint at step" in out, out
    assert_the_stop_reported_progress(run, out)


def test_a_sigterm_stop_whose_validation_is_not_cheap_says_not_measured(tiny_overrides, tick_clock, monkeypatch,
                                                                        tmp_path):
    """Validation takes a minute here: a signal's stop saves and says the end was not
    measured; run.json holds null, not the start's loss. The report says so, and once
    ``flopwise eval`` has measured the checkpoint, it gives that."""
    slow_validation(monkeypatch, tick_clock, 60.0)
    real_count = hooks.count_step

    def count_step(run, *args):
        real_count(run, *args)
        if run.progress.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal to this process: the loop's handler takes it

    monkeypatch.setattr(hooks, "count_step", count_step)
    cfg = build_config(overrides=tiny_overrides + SILENT)
    lines: list[str] = []
    result = train(cfg, log=lines.append, clock=tick_clock)
    assert result.stopped == "SIGTERM received" and result.steps >= 3
    closing = closing_line(lines)
    assert f"-> not measured at step {result.steps}" in closing and f"-> {result.val_loss_start:.4f}" not in closing, \
        closing
    assert math.isnan(result.val_loss_end)
    text = (result.run_dir / "run.json").read_text()
    assert "NaN" not in text and json.loads(text)["result"]["val_loss_end"] is None
    assert any(r["step"] == result.steps and r.get("loss") is not None for r in rows(result.run_dir))

    monkeypatch.undo()
    assert main(["report", str(result.run_dir), "--no-png"]) == 0
    card = (result.run_dir / "report.html").read_text()
    assert re.search(r"validation loss</dt><dd>[0-9.]+ → not measured", card), card[card.find("validation loss"):][:200]
    assert main(["eval", str(result.run_dir)]) == 0
    measured = json.loads((result.run_dir / "evals.jsonl").read_text().splitlines()[-1])
    assert measured["val_set"] == "run"
    assert main(["report", str(result.run_dir), "--no-png"]) == 0
    card = (result.run_dir / "report.html").read_text()
    assert (f"{result.val_loss_start:.4f} → {measured['val_loss']:.4f} (flopwise eval, step {result.steps})"
            in card), card[card.find("validation loss"):][:200]


# --------------------------------------------------------------------------- item 12: samples during training

def test_samples_every_n_steps_go_to_samples_txt_with_their_step_and_into_the_report(tiny_overrides):
    lines: list[str] = []
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=10", "eval.sample_every=4",
                                                   "eval.sample_tokens=8"])
    result = train(cfg, log=lines.append)
    text = (result.run_dir / "samples.txt").read_text()
    steps = [int(m) for m in re.findall(r"^--- prompt .* · step (\d+) ·", text, re.M)]
    assert steps == [4, 8, 10], text  # due steps, and the end once
    assert sum(1 for line in lines if line.startswith("  sample step")) == 2, lines
    assert main(["report", str(result.run_dir), "--no-png"]) == 0
    page = (result.run_dir / "report.html").read_text()
    for step in (4, 8, 10):
        assert f"sample at step {step}" in page


def test_sample_every_is_validated_like_the_other_fields(tiny_overrides, capsys):
    assert build_config(overrides=tiny_overrides).eval.sample_every > 0  # on by default
    with pytest.raises(ConfigError, match="eval.sample_every"):
        build_config(overrides=tiny_overrides + ["eval.sample_every=-1"])
    assert main(["train", *tiny_overrides, "eval.sample_every=-3"]) != 0
    err = capsys.readouterr().err
    assert "eval.sample_every" in err and "Traceback" not in err, err
