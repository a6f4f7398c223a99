"""Issue 54 (the fourth list), time budgets: item 1, a budget that the warm-up ignored.

Through the real trainer with its clock injected (``tick_clock``: 0.1 s a reading, however
loaded this machine is)."""

from __future__ import annotations

import json
from pathlib import Path

from flopwise.config import build_config
from flopwise.train.trainer import train

BUDGET_S = 8.0  # about a dozen steps of the tick clock, a 1 s save kept aside
FITTED = ["train.max_steps=2000", "optim.schedule=wsd", "optim.fit_to_time=true", "optim.decay_fraction=0.5",
          "eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.checkpoint_every=0"]


def lrs(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["lr"]) for r in rows if r.get("lr") is not None and "event" not in r]


def test_a_budget_shorter_than_the_warm_up_binds_and_the_schedule_decays_within_it(tiny_overrides, tick_clock):
    """200 warm-up steps against a short budget (issue: 1.1 s): 200 steps ran, and the run stopped 'with the decay
    finished' at the peak rate. Now it stops when the budget is used, within the warm-up, and its
    last rate is the floor's: the warm-up is capped by the fitted decay."""
    cfg = build_config(overrides=tiny_overrides + FITTED + ["optim.warmup_steps=200", f"train.max_hours={BUDGET_S / 3600}"])
    result = train(cfg, clock=tick_clock, log=lambda s: None)
    assert result.stopped == "the time budget is used with the decay finished", result.stopped
    assert 0 < result.steps < 200, result.steps
    rates = lrs(result.run_dir)
    peak, floor = cfg.optim.lr, cfg.optim.lr * cfg.optim.min_lr_ratio
    warm = [(s, lr) for s, lr in rates]
    assert max(lr for _, lr in warm) < peak, warm  # the warm-up never reached the peak in so short a budget
    last = rates[-1][1]
    assert last <= floor * 1.5 + 1e-12, (last, floor, rates[-5:])  # ended at (about) the floor
    # and the spent time is within the budget
    state = json.loads(sorted((result.run_dir / "checkpoints").glob("step-*"))[-1].joinpath("state.json").read_text())
    assert state["time_budget"]["spent_s"] <= BUDGET_S, state["time_budget"]


# ---------------------------------------------------------------- item 17: what a stop and a finished run say
def test_a_time_budget_stop_says_the_run_is_finished_and_how_to_extend_it(tiny_overrides, tick_clock):
    lines: list[str] = []
    cfg = build_config(overrides=tiny_overrides + FITTED + ["optim.warmup_steps=2", f"train.max_hours={BUDGET_S / 3600}"])
    result = train(cfg, clock=tick_clock, log=lines.append)
    stop = next(line for line in lines if line.startswith("  stop "))
    assert "resumes it" not in stop and "the run is finished" in stop, stop
    extend = f"train.max_hours={2 * BUDGET_S / 3600:g}"
    assert f"flopwise train --config {result.run_dir / 'config.yaml'} {extend}" in stop, stop


def test_a_finished_run_says_so_and_how_to_train_it_longer(cli, tiny_overrides):
    proc = cli("train", *tiny_overrides, "train.max_steps=4", "eval.every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("  finished:"))
    assert "all 4 steps of train.max_steps are trained" in line and "train.max_steps=8` trains it longer" in line
    assert "resumes it" not in proc.stdout


def test_a_signal_stop_that_has_no_room_for_a_sample_says_so(tiny_overrides, monkeypatch):
    """A SIGINT stop wrote no sample and said nothing. Where a sample does not fit in what a
    signal's stop may spend (here: made to take longer than that), the stop says why and how to get one."""
    import os
    import signal

    from flopwise.train import hooks

    monkeypatch.setattr(hooks, "SIGNAL_STOP_S", 0.0)  # no room at all after the save
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("step ") and not any("SIG" in x for x in lines[:-1]):
            os.kill(os.getpid(), signal.SIGINT)

    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=2000", "train.log_every=2", "eval.every=0"])
    result = train(cfg, log=log)
    assert result.stopped == "SIGINT received", result.stopped
    said = [line for line in lines if line.startswith("  sample     not written:")]
    assert said and "a signal's stop spends at most 0 s" in said[0] and "flopwise generate" in said[0], lines[-12:]
    assert not (result.run_dir / "samples.txt").exists() or result.sample == ""
