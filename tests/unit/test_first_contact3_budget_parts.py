"""The time budget across a run's processes, piece by piece (issue 45, item 2): what a checkpoint
records and how a resume reads it, when a budget counts as spent, and the rate of a WSD fitted
to ``train.max_hours`` when the budget changes on resume. End to end:
``tests/integration/test_first_contact3_budget.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from flopwise.checkpoints import CheckpointError
from flopwise.config import build_config
from flopwise.train.schedule import (
    TimeContinuation,
    fitted_progress,
    lr_factor,
    lr_for_step,
    resumed_time_schedule,
    saved_continuation,
)
from flopwise.train.stopping import Deadline, TimeFit, budget_spent, saved_budget

CKPT = Path("run/checkpoints/step-0000012")


def fitted(hours: float, *extra: str):
    return build_config(preset="tiny", overrides=["optim.schedule=wsd", "optim.fit_to_time=true",
                                                  "optim.warmup_steps=2", "optim.decay_fraction=0.5",
                                                  f"train.max_hours={hours}", *extra])


def test_a_checkpoint_records_the_runs_time_and_a_resume_continues_it():
    clock = iter([10.0, 40.0]).__next__
    first = Deadline(1.0, start=0.0, state_bytes=0, clock=clock)
    first.record_step(2.0)
    first.record_save(3.0)
    state = first.state_dict()
    assert state == {"spent_s": 10.0, "step_s": 2.0, "save_s": 3.0, "stop_s": 0.0}
    # a new process, started at 1000 on its own clock, has 3590 s left of the hour, not 3600
    second = Deadline(1.0, start=1000.0, state_bytes=0, clock=clock)
    second.load_state_dict(saved_budget({"time_budget": state}, CKPT))
    assert second.end == pytest.approx(1000.0 + 3590.0) and second.spent(1005.0) == pytest.approx(15.0)
    assert second.must_stop(now=1000.0 + 3590.0 - 1.1 * 5.0 + 0.1)
    assert not second.must_stop(now=1000.0 + 3590.0 - 1.1 * 5.0 - 0.1)
    # the fitted schedule's progress is the run's: a resume at half the budget is at half, not at 0
    fit = TimeFit(second, clock=lambda: 1000.0 + 1790.0)
    assert fit.measure() == pytest.approx(fitted_progress(1800.0, 3600.0, 2.0, 3.0))
    assert 0.49 < fit.measure() < 0.52


def test_a_budget_is_spent_when_the_run_stopped_on_it():
    budget = {"spent_s": 3592.0, "step_s": 4.0, "save_s": 5.0}  # 3592 + 1.1 * 9 > 3600
    assert budget_spent(1.0, budget)
    assert not budget_spent(1.01, budget)  # raised: time for a step and a save again
    assert not budget_spent(0.0, budget)  # no budget
    assert not budget_spent(1.0, {})  # a checkpoint that recorded none
    # the room a stop keeps for its validation and sample counts too: 3580 + 1.1 * (4 + 5 + 10) > 3600
    assert budget_spent(1.0, {"spent_s": 3580.0, "step_s": 4.0, "save_s": 5.0, "stop_s": 10.0})
    assert not budget_spent(1.0, {"spent_s": 3580.0, "step_s": 4.0, "save_s": 5.0})


@pytest.mark.parametrize("value, problem", [
    ("abc", "expected an object"),
    ({"spent_s": -1.0, "step_s": 0.0, "save_s": 0.0}, "time_budget'.spent_s = -1.0"),
    ({"spent_s": float("nan"), "step_s": 0.0, "save_s": 0.0}, "time_budget'.spent_s = nan"),
    ({"spent_s": 1.0, "step_s": True, "save_s": 0.0}, "time_budget'.step_s = True"),
    ({"spent_s": 1.0, "step_s": 0.0}, "time_budget'.save_s = None"),
])
def test_a_damaged_time_budget_is_refused_naming_the_file_and_field(value, problem):
    with pytest.raises(CheckpointError) as err:
        saved_budget({"time_budget": value}, CKPT)
    assert str(CKPT / "state.json") in str(err.value) and problem in str(err.value), err.value
    assert saved_budget({}, CKPT) == {}  # an older checkpoint: none recorded


def test_an_unchanged_budget_goes_on_as_it_was():
    cfg = fitted(1.0)
    assert resumed_time_schedule(fitted(1.0), None, 40, cfg, {"spent_s": 3000.0, "step_s": 2.0, "save_s": 3.0}) \
        == (None, "")
    cont, note = resumed_time_schedule(fitted(1.0), None, 40, cfg, {})
    assert cont is None and "records no time spent" in note


def test_a_budget_raised_in_the_stable_phase_moves_the_decay_to_the_new_end():
    cont, note = resumed_time_schedule(fitted(1.0), None, 40, fitted(2.0),
                                       {"spent_s": 600.0, "step_s": 2.0, "save_s": 3.0})
    assert cont is None and "same under both (0.003)" in note and "train.max_hours 1 -> 2" in note, note


def test_a_budget_raised_after_the_decay_holds_the_rate_at_the_floor():
    cfg = fitted(2.0)
    floor = cfg.optim.lr * cfg.optim.min_lr_ratio
    cont, note = resumed_time_schedule(fitted(1.0), None, 40, cfg, {"spent_s": 3595.0, "step_s": 2.0, "save_s": 3.0})
    assert isinstance(cont, TimeContinuation) and cont.lr == pytest.approx(floor), cont
    assert f"held at {floor:.3g} from step 41" in note and "fitting it to 2 h anew would set 0.003" in note, note
    assert lr_for_step(40, 2000, 0, cfg.optim, 0, None, 0.6, cont) == pytest.approx(floor)
    assert lr_for_step(60, 2000, 0, cfg.optim, 0, None, 0.9, cont) == pytest.approx(floor)


def test_a_budget_raised_mid_decay_continues_the_decay_to_the_new_end():
    old, cfg = fitted(1.0), fitted(2.0)
    o = cfg.optim
    budget = {"spent_s": 2700.0, "step_s": 2.0, "save_s": 3.0}
    cont, note = resumed_time_schedule(old, None, 40, cfg, budget)
    left_at = o.lr * lr_factor(fitted_progress(2700.0, 3600.0, 2.0, 3.0), o, 0.0)  # the old budget's rate there
    assert isinstance(cont, TimeContinuation) and cont.lr == pytest.approx(left_at) and o.lr * 0.1 < left_at < o.lr
    assert f"continues from {left_at:.3g} at step 40" in note and "decays (linear)" in note, note
    rates = [lr_for_step(40 + i, 2000, 0, o, 0, None, p, cont) for i, p in enumerate([cont.from_progress + 0.01,
                                                                                      0.6, 0.8, 1.0])]
    assert rates[0] < left_at and rates == sorted(rates, reverse=True)
    assert rates[-1] == pytest.approx(o.lr * o.min_lr_ratio)
    # saved in the checkpoint as it is, and read back the same, beside the step-based kind
    assert saved_continuation({"lr_continuation": cont._asdict()}) == cont
    # a later resume at the same (raised) budget keeps following it
    kept, kept_note = resumed_time_schedule(cfg, cont, 50, cfg, {"spent_s": 4000.0, "step_s": 2.0, "save_s": 3.0})
    assert kept == cont and "continuation set at step 40" in kept_note
