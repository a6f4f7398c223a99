"""A time budget is the run's, across its processes (issue 45, item 2).

``train.max_hours`` with ``optim.fit_to_time``: a run stopped by its budget, resumed with the
command its stop line prints, trains nothing and says so; raising ``train.max_hours`` trains only
the time added, and the rate goes on from where the run left it (told at the start); a run
preempted by a real SIGTERM mid-decay continues the budget it had left, and its rate continues
the decay. The run's clock is the tick clock (0.1 s a reading), so every run takes the same
steps however loaded the machine is. CPU, the tiny model on the small corpus."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from flopwise.checkpoints import latest_checkpoint, read_state
from flopwise.cli import main
from flopwise.config import build_config
from flopwise.train.trainer import train

BUDGET = ["train.max_steps=2000", "optim.schedule=wsd", "optim.fit_to_time=true", "optim.warmup_steps=2",
          "optim.decay_fraction=0.5", "eval.every=0", "eval.sample_tokens=0", "train.log_every=1",
          "train.checkpoint_every=0"]
HOURS = 0.003  # 10.8 s of the tick clock: about a dozen steps, half of them decaying


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def lrs(run_dir: Path) -> dict[int, float]:
    """The rate of each logged training step."""
    return {r["step"]: r["lr"] for r in rows(run_dir) if r.get("lr") is not None and "event" not in r}


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def spent_s(run_dir: Path) -> float:
    """The run's time spent, as its latest checkpoint recorded it."""
    return read_state(latest_checkpoint(run_dir))["time_budget"]["spent_s"]


def budget_run(tiny_overrides, clock, hours: float = HOURS, **kw):
    cfg = build_config(overrides=tiny_overrides + BUDGET + [f"train.max_hours={hours}"])
    return cfg, train(cfg, clock=clock, **kw)


@pytest.mark.slow
def test_a_spent_budget_trains_nothing_and_a_raised_one_only_the_time_added(tiny_overrides, tick_clock, capsys):
    cfg, first = budget_run(tiny_overrides, tick_clock, log=lambda s: None)
    assert first.stopped == "the time budget is used with the decay finished" and first.steps > 4
    run, peak, floor = first.run_dir, cfg.optim.lr, cfg.optim.lr * cfg.optim.min_lr_ratio
    before = snapshot(run)
    capsys.readouterr()
    # The command the stop line prints, in a real `flopwise train`: the budget is spent.
    assert main(["train", "--config", str(run / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert snapshot(run) == before, "the resume changed the run"  # no step, no row, no checkpoint
    line = next((x for x in out.splitlines() if x.startswith("finished:")), None)
    assert line is not None, out
    assert f"train.max_hours={HOURS:g}" in line and "nothing to train" in line, line
    assert "raise train.max_hours" in line and f"held at {floor:.3g}" in line, line  # how to extend; the rate then

    # train.max_hours raised: only the time added, at the rate the decay ended with (told at the start)
    ended_at = lrs(run)[first.steps]
    assert ended_at < 0.5 * peak
    lines: list[str] = []
    resumed = build_config(config_file=str(run / "config.yaml"), overrides=[f"train.max_hours={2 * HOURS}"])
    second = train(resumed, log=lines.append, clock=tick_clock)
    added = second.steps - first.steps
    # the time added is the first budget again: about as many steps as the first run took (the tick clock's
    # readings per step differ a little between a first start and a resume), where a fresh budget of twice the
    # first would take twice as many
    assert 0 < added < 1.5 * first.steps, (first.steps, second.steps)
    assert spent_s(run) <= 2 * HOURS * 3600
    after = {s: lr for s, lr in lrs(run).items() if s > first.steps}
    assert after and all(lr == pytest.approx(floor) for lr in after.values()), after  # held, not back to the peak
    told = [x for x in lines if x.startswith("  schedule")]
    assert told and "train.max_hours" in told[0] and f"held at {floor:.3g}" in told[0], lines[:30]
    budget = next((x for x in lines if x.startswith("  budget")), "")
    assert "spent before this start" in budget and "left" in budget, lines[:30]


@pytest.mark.slow
def test_a_run_preempted_mid_decay_continues_its_budget_and_its_decay(tiny_overrides, tick_clock):
    peak = build_config(overrides=tiny_overrides + BUDGET + [f"train.max_hours={HOURS}"]).optim.lr

    def log(line: str) -> None:  # a real signal to this process, as a preemption sends one, once the decay began
        row = re.match(r"step +(\d+)/\d+ .*\| lr ([0-9.e+-]+) \|", line)
        if row and int(row.group(1)) > 2 and float(row.group(2)) < peak and not stopping:  # past the warm-up
            stopping.append(int(row.group(1)))
            os.kill(os.getpid(), signal.SIGTERM)

    stopping: list[int] = []
    cfg, first = budget_run(tiny_overrides, tick_clock, log=log)
    assert first.stopped == "SIGTERM received" and [first.steps] == stopping, (first.stopped, first.steps)
    run = first.run_dir
    lines: list[str] = []
    second = train(build_config(config_file=str(run / "config.yaml")), log=lines.append, clock=tick_clock)
    assert second.stopped == "the time budget is used with the decay finished"
    # The budget left, not a new one: past the half of it when stopped (the decay is its second half), so the
    # rest takes fewer steps than the first process did.
    assert 0 < second.steps - first.steps < first.steps, (first.steps, second.steps)
    assert spent_s(run) <= HOURS * 3600
    rates = lrs(run)
    after = [rates[s] for s in sorted(rates) if s > first.steps]
    assert after[0] <= rates[first.steps] < peak, (rates[first.steps], after)  # the decay goes on, not the peak
    assert after == sorted(after, reverse=True) and after[-1] < 0.5 * peak, after
