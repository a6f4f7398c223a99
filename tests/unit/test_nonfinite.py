"""Bad steps: the bounds on skips and rollbacks (per run, per checkpoint, across resumes and
rollbacks), and collapses (gradient norm ~0 at ln V) -- the guard on its own, then in real
tiny training runs on CPU (issue 16: `train.nonfinite=rollback` rolled back 700 times).

The runs here make the *loss* NaN after the backward (conftest's ``nan_at``): the gradients stay
finite, so they test the bounds and the loss half of the guard. A NaN made in the backward --
a finite loss, a NaN gradient norm -- under each policy, and a real divergence from a huge
learning rate, are in tests/integration/test_divergence.py."""

import json
import math
from pathlib import Path

import pytest
import torch

from flopwise.checkpoints import latest_checkpoint
from flopwise.config import TrainConfig, build_config
from flopwise.train import setup as trainer_module  # where the run builds its model
from flopwise.train.stopping import NonFiniteError, NonFiniteGuard
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1"]
LN_V = math.log(512)


# --------------------------------------------------------------------------- the guard alone

def guard(policy: str, patience: int = 3, spike_factor: float = 0.0, warmup: int = 10,
          uniform_loss: float | None = None, **train) -> NonFiniteGuard:
    """The guard of ``train.nonfinite=policy`` and the other ``train`` settings given."""
    t = TrainConfig(nonfinite=policy, nonfinite_patience=patience, spike_factor=spike_factor, **train)
    return NonFiniteGuard(t, uniform_loss=uniform_loss, warmup=warmup)


def test_rollbacks_are_bounded_per_checkpoint_and_per_run():
    g = guard("rollback", nonfinite_max_rollbacks=3, nonfinite_max_rollbacks_per_checkpoint=2)
    for _ in range(2):
        assert g.refusal("step-0000004") == ""
        g.record_rollback("step-0000004")
    assert "already rolled back to step-0000004 2 time(s)" in g.refusal("step-0000004")
    assert "train.nonfinite_max_rollbacks_per_checkpoint=2" in g.refusal("step-0000004")
    assert g.refusal("step-0000008") == ""  # another checkpoint: its own count
    g.record_rollback("step-0000008")
    assert "3 rollback(s) already in this run" in g.refusal("step-0000012")
    assert "train.nonfinite_max_rollbacks=3" in g.refusal("step-0000012")
    assert guard("rollback").refusal(None) == "no checkpoint to roll back to"


def test_skips_are_bounded_and_patience_still_counts():
    g = guard("skip", nonfinite_max_skips=2)
    for _ in range(2):
        assert not g.check(float("nan"), 1.0)
        assert g.refusal(None) == ""
        g.record_skip()
        assert g.check(1.0, 1.0)  # a finite step in between: the streak starts over...
    assert not g.check(1.0, float("inf"))
    assert "train.nonfinite_max_skips=2" in g.refusal(None)  # ...the total does not
    g = guard("skip", patience=1)
    g.check(float("nan"), 1.0), g.check(float("nan"), 1.0)
    assert g.refusal(None) == "2 in a row exceeds train.nonfinite_patience=1"


def test_counts_survive_a_checkpoint_round_trip_through_json():
    g = guard("rollback")
    g.record_rollback("step-0000002"), g.record_rollback("step-0000002"), g.record_skip()
    state = json.loads(json.dumps(g.state_dict()))  # as state.json stores it
    h = guard("rollback", nonfinite_max_rollbacks_per_checkpoint=2)
    h.load_state_dict(state)
    assert (h.rollbacks, h.skipped, h.rollbacks_to) == (2, 1, {"step-0000002": 2})
    assert "already rolled back to step-0000002" in h.refusal("step-0000002")
    guard("stop").load_state_dict({"skipped": 1, "rollbacks": 0, "mean": None, "seen": 0})  # older


def _feed(g: NonFiniteGuard, steps: list[tuple[float, float]]) -> list[int]:
    """Steps (1-based) at which the guard calls a collapse, fed as the loop feeds it."""
    fired = []
    for i, (loss, gnorm) in enumerate(steps, 1):
        assert g.check(loss, gnorm)
        if g.collapsed(loss, gnorm):
            fired.append(i)
        else:
            g.spike(loss)
    return fired


def test_a_collapse_is_k_flat_steps_in_a_row_after_warm_up():
    g = guard("stop", spike_factor=3.0, warmup=4, collapse_steps=3, uniform_loss=LN_V)
    healthy = [(6.2, 1.3), (6.0, 0.9), (5.8, 0.7), (5.7, 0.6)]
    flat = [(LN_V, 0.0)] * 3
    assert _feed(g, healthy + flat) == [7]
    # Before warm-up flat steps do not count; a healthy step in between restarts the count.
    g = guard("stop", spike_factor=3.0, warmup=4, collapse_steps=3, uniform_loss=LN_V)
    assert _feed(g, [(LN_V, 0.0)] * 5 + [(5.0, 0.5)] + [(LN_V, 0.0)] * 2 + [(5.0, 0.5)]) == []
    # Exactly 0 fires at any loss; ~0 (below 1e-6) only with the loss at ln V (within 1e-4).
    g = guard("stop", warmup=0, collapse_steps=2, uniform_loss=LN_V)
    assert _feed(g, [(3.0, 0.0)] * 2) == [2]
    assert _feed(g, [(LN_V + 5e-5, 3e-7)] * 2) == [2]
    assert _feed(g, [(3.0, 3e-7)] * 4 + [(LN_V + 1e-3, 3e-7)] * 4 + [(LN_V, 1e-3)] * 4) == []
    # Off.
    g = guard("stop", warmup=0, collapse_steps=0, uniform_loss=LN_V)
    assert _feed(g, [(LN_V, 0.0)] * 10) == []


def test_a_collapse_is_never_skipped_only_rolled_back():
    assert "a collapse is not skipped" in guard("skip").refusal("step-0000002", collapse=True)
    assert "a collapse is not skipped" in guard("stop").refusal("step-0000002", collapse=True)
    assert guard("rollback").refusal("step-0000002", collapse=True) == ""


# --------------------------------------------------------------------------- real tiny runs

def _events(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" in r]


def test_rolling_back_to_the_same_checkpoint_stops_at_its_bound(tiny_overrides, monkeypatch, nan_at):
    """Every other step diverges and the finite one in between resets the patience: without the
    bound this rolls back to step 2 again and again (here: 3 times, then the run went on)."""
    nan_at({3, 5, 7})
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=8", "train.checkpoint_every=2",
                                                           "train.nonfinite=rollback"])
    lines = []
    with pytest.raises(NonFiniteError, match=r"at step 4 .*already rolled back to step-0000002 2 time\(s\).*"
                                             r"train.nonfinite_max_rollbacks_per_checkpoint=2"):
        train(cfg, log=lines.append)
    run = Path(cfg.train.run_dir)
    assert sum(": rolled back to step-0000002" in line for line in lines) == 2  # the reload never reset the count
    diag = json.loads((run / "nonfinite-step-0000004.json").read_text())
    assert diag["rollbacks"] == 2 and diag["rollbacks_to"] == {"step-0000002": 2}
    assert "nonfinite_max_rollbacks_per_checkpoint" in diag["stopped_because"]
    assert [e["step"] for e in _events(run) if e["event"] == "nonfinite"] == [3, 4, 4]


def test_rollbacks_in_the_run_stop_at_their_bound(tiny_overrides, monkeypatch, nan_at):
    nan_at({3, 6, 9})  # one rollback to each of step 2, 4 and 6
    cfg = build_config(overrides=tiny_overrides + QUIET + [
        "train.max_steps=10", "train.checkpoint_every=2", "train.nonfinite=rollback", "train.nonfinite_max_rollbacks=2"])
    with pytest.raises(NonFiniteError, match=r"at step 7 .*2 rollback\(s\) already in this run.*max_rollbacks=2"):
        train(cfg, log=lambda s: None)
    assert (Path(cfg.train.run_dir) / "nonfinite-step-0000007.json").is_file()


def test_skips_in_the_run_stop_at_their_bound(tiny_overrides, monkeypatch, nan_at):
    nan_at({2, 4, 6})
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=8", "train.nonfinite=skip",
                                                           "train.nonfinite_max_skips=2"])
    with pytest.raises(NonFiniteError, match=r"at step 6 .*2 update\(s\) already skipped.*nonfinite_max_skips=2"):
        train(cfg, log=lambda s: None)
    diag = json.loads((Path(cfg.train.run_dir) / "nonfinite-step-0000006.json").read_text())
    assert diag["skipped"] == 2 and diag["policy"] == "skip"


def test_the_bounds_hold_across_a_resume(tiny_overrides, monkeypatch, nan_at):
    """A rollback made before a checkpoint is counted in it: the resumed run starts with it."""
    nan_at({3})
    common = tiny_overrides + QUIET + ["train.checkpoint_every=2", "train.nonfinite=rollback",
                                       "train.nonfinite_max_rollbacks=1"]
    result = train(build_config(overrides=common + ["train.max_steps=4"]), log=lambda s: None)
    state = json.loads((latest_checkpoint(result.run_dir) / "state.json").read_text())
    assert state["guard"]["rollbacks"] == 1 and state["guard"]["rollbacks_to"] == {"step-0000002": 1}
    monkeypatch.undo()
    nan_at({2})  # step 6 of the resumed run
    with pytest.raises(NonFiniteError, match=r"at step 6 .*1 rollback\(s\) already in this run"):
        train(build_config(overrides=common + ["train.max_steps=8"]), log=lambda s: None)


def _collapsed_model(monkeypatch):
    """The model the trainer builds, with every weight zero: a real collapse -- the logits are
    0 (the loss is exactly ln V) and every gradient is exactly 0, so AdamW never moves it."""
    real = trainer_module.build_model

    def build_model(*a, **kw):
        model = real(*a, **kw)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        return model

    monkeypatch.setattr(trainer_module, "build_model", build_model)


def test_a_collapse_stops_the_run_with_an_event_and_diagnostics(tiny_overrides, monkeypatch):
    _collapsed_model(monkeypatch)
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=30", "train.checkpoint_every=4"])
    with pytest.raises(NonFiniteError, match=r"collapse at step 15: gradient norm 0 for 5 steps in a row"):
        train(cfg, log=lambda s: None)  # 10 steps of warm-up, then 5 flat ones
    run = Path(cfg.train.run_dir)
    (event,) = [e for e in _events(run) if e["event"] == "collapse"]
    assert event["step"] == 15 and event["grad_norm"] == 0.0 and event["loss"] == pytest.approx(LN_V, abs=1e-4)
    diag = json.loads((run / "nonfinite-step-0000015.json").read_text())
    assert diag["event"] == "collapse" and "a collapse is not skipped" in diag["stopped_because"]
    assert latest_checkpoint(run).name == "step-0000012"  # nothing of the bad step saved


def test_a_collapse_under_rollback_goes_back_and_then_stops_at_the_bound(tiny_overrides, monkeypatch):
    _collapsed_model(monkeypatch)
    cfg = build_config(overrides=tiny_overrides + QUIET + [
        "train.max_steps=40", "train.checkpoint_every=10", "train.nonfinite=rollback", "train.collapse_steps=2"])
    lines = []
    with pytest.raises(NonFiniteError, match=r"collapse at step 12:.*already rolled back to step-0000010 2 time"):
        train(cfg, log=lines.append)  # flat steps 11 and 12 (after 10 of warm-up), three times
    assert sum(": rolled back to step-0000010" in line for line in lines) == 2
