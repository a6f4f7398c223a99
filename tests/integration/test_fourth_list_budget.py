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
