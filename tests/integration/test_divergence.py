"""Real divergences through ``train()`` on CPU: a gradient that is NaN while the loss stays
finite, under each ``train.nonfinite`` policy, and a learning rate so large the run blows up.

The tests in tests/unit/test_nonfinite.py make the *loss* NaN after the backward, so the
gradients there stay finite and only the loss half of the guard is ever exercised. Here the
NaN is made in the backward itself: a tensor hook on one real parameter of the model the run
builds turns that parameter's gradient into NaN on chosen backward passes. The loss the step
reports is the model's own (finite); only the global gradient norm is NaN -- the
gradient-NaN path of the guard and of ``handle_bad_step``. Were that path broken, the NaN
gradient would reach AdamW and make the weights NaN, or the bad step would go by without an
event: each test checks both, by what the run wrote (metrics.jsonl, the diagnostics file,
the checkpoints) and by the weights it ended with.

Assertions are on outcomes -- which step was bad, what was skipped, rolled back or stopped,
what the weights and the optimizer hold -- never on when the host learnt of a bad step.

One micro-batch per step (``train.global_batch_size`` = ``train.micro_batch_size``): the
k-th backward pass of a run is step k's, counting again the steps a rollback trains anew.

The loop reads a step's values at once on the steps that log, validate or save, and every
other step's one step late (after the next step is issued): each policy is run both ways --
``train.log_every=1`` (every step read at once) and ``LATE`` (the bad step read a step late).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from flopwise.checkpoints import latest_checkpoint
from flopwise.config import build_config
from flopwise.train import setup as run_setup  # where the run builds its model
from flopwise.train.stopping import NonFiniteError
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.global_batch_size=8"]
LATE = "train.log_every=100"  # only checkpoint steps and the last are read at once; the others one step late
READS = pytest.mark.parametrize("reads", [[], [LATE]], ids=["read-at-once", "read-late"])
POISONED = "layers.1.mlp.w_down.weight"  # a real weight in the middle of the model (not tied, not the head)


class NanGradients:
    """Installs itself on the model the trainer builds: the gradient of ``POISONED`` becomes
    NaN on the backward passes numbered in ``at`` (1-based). Records, for every forward pass,
    a copy of that weight (what the step started from), and keeps the model."""

    def __init__(self, monkeypatch, at: set[int]):
        self.at, self.backward_calls, self.model = set(at), 0, None
        self.seen: list[torch.Tensor] = []  # the poisoned weight at the start of each forward
        real = run_setup.build_model

        def build_model(*a, **kw):
            model = real(*a, **kw)
            self.model = model
            param = dict(model.named_parameters())[POISONED]
            param.register_hook(self._grad)
            model.register_forward_pre_hook(lambda mod, args: self.seen.append(param.detach().clone())
                                            if mod.training else None)
            return model

        monkeypatch.setattr(run_setup, "build_model", build_model)

    def _grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.backward_calls += 1
        return torch.full_like(grad, float("nan")) if self.backward_calls in self.at else grad

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _nonfinite_events(run: Path) -> list[dict]:
    return [r for r in _rows(run) if r.get("event") == "nonfinite"]


def _assert_gradient_nan_only(event: dict) -> None:
    """The step was bad through its gradient: the loss finite, the gradient norm NaN (the sink
    writes a non-finite float as null)."""
    assert event["loss"] is not None and math.isfinite(event["loss"]), event
    assert event["grad_norm"] is None or not math.isfinite(event["grad_norm"]), event


def _assert_finite(weights: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not bad, f"{what}: non-finite weights in {bad}"


def _checkpoint(run: Path, step: int) -> Path:
    path = run / "checkpoints" / f"step-{step:07d}"
    assert (path / "COMPLETE").is_file(), f"no complete {path.name}: {sorted(p.name for p in path.parent.iterdir())}"
    return path


def _model_pt(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)


def _adam_steps(ckpt: Path) -> set[int]:
    """AdamW's per-parameter step counts in a checkpoint: the updates really applied (Muon keeps
    no count: under optim.name=muon, those of the AdamW half)."""
    saved = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    parts = saved["optimizers"].values() if "optimizers" in saved else [saved]  # Muon + AdamW: one each
    steps = {int(s["step"]) for part in parts for s in part["state"].values() if "step" in s}
    assert steps, f"no AdamW step count in {ckpt / 'optimizer.pt'}"
    return steps


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    moved = [k for k in want if not torch.equal(got[k], want[k])]
    assert not moved, f"{what}: {moved} changed"


def _run(tiny_overrides, *extra: str):
    return build_config(overrides=tiny_overrides + QUIET + list(extra))


@READS
def test_stop_on_a_nan_gradient_writes_diagnostics_and_keeps_the_weights(tiny_overrides, monkeypatch, reads):
    nan = NanGradients(monkeypatch, {3})
    cfg = _run(tiny_overrides, "train.max_steps=5", "train.checkpoint_every=2", "train.nonfinite=stop", *reads)
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradients at step 3 \(loss [0-9.]+, grad norm nan\)"):
        train(cfg, log=lambda s: None)
    run = Path(cfg.train.run_dir)
    (event,) = _nonfinite_events(run)
    assert event["step"] == 3 and event["policy"] == "stop"
    _assert_gradient_nan_only(event)
    diag = json.loads((run / "nonfinite-step-0000003.json").read_text())  # NaN is valid for json.loads
    assert diag["policy"] == "stop" and diag["event"] == "nonfinite" and diag["step"] == 3
    assert math.isfinite(diag["loss"]) and math.isnan(diag["grad_norm"])
    assert latest_checkpoint(run).name == "step-0000002"  # nothing of the bad step saved
    _assert_finite(nan.weights(), "after the stop")  # the NaN gradient never reached the weights


@READS
@pytest.mark.parametrize("optimizer", ["optim.fused=true", "optim.fused=false", "optim.name=muon"],
                         ids=["adamw-fused", "adamw-foreach", "muon"])
def test_skip_on_a_nan_gradient_drops_exactly_that_update(tiny_overrides, monkeypatch, optimizer, reads):
    """Steps 3 and 5 (the last) of 5 have a NaN gradient. A skipped update changes nothing:
    AdamW counted 3 updates by step 4 (not 4), and the weights the run ends with are step 4's
    checkpoint, bit for bit -- step 5 went by without touching them. Each optimizer: fused AdamW
    and Muon can be told to skip on the device, the other AdamW cannot."""
    nan = NanGradients(monkeypatch, {3, 5})
    cfg = _run(tiny_overrides, "train.max_steps=5", "train.checkpoint_every=2", "train.nonfinite=skip", optimizer,
               "eval.every=5", *reads)
    lines = []
    result = train(cfg, log=lines.append)
    run = Path(cfg.train.run_dir)
    assert result.steps == 5
    events = _nonfinite_events(run)
    assert [e["step"] for e in events] == [3, 5] and {e["policy"] for e in events} == {"skip"}
    for e in events:
        _assert_gradient_nan_only(e)
    assert sum("update skipped" in line for line in lines) == 2, lines
    assert not list(run.glob("nonfinite-step-*.json"))  # skipped, not stopped
    step4 = _checkpoint(run, 4)
    assert _adam_steps(_checkpoint(run, 2)) == {2}
    assert _adam_steps(step4) == {3}  # 4 steps, 1 skipped
    assert json.loads((step4 / "state.json").read_text())["guard"]["skipped"] == 1
    final = nan.weights()
    _assert_finite(final, "after the run")
    _assert_identical(final, _model_pt(step4), "weights after the skipped step 5 vs step 4")
    # A skipped last step still ends the run where it was due: its checkpoint, its validation.
    _assert_identical(_model_pt(_checkpoint(run, 5)), _model_pt(step4), "the last checkpoint vs step 4's")
    assert any(r.get("step") == 5 and r.get("val_loss") is not None for r in _rows(run)), _rows(run)[-3:]


def _rolled_back(tiny_overrides, monkeypatch, bad: int, *extra: str) -> tuple[NanGradients, Path, list[str]]:
    """A 5-step run saving every 2 steps under rollback, step ``bad``'s gradient NaN: the model's
    recorder, the run directory and the log; its one event checked (that step, a NaN gradient)."""
    nan = NanGradients(monkeypatch, {bad})
    cfg = _run(tiny_overrides, "train.max_steps=5", "train.checkpoint_every=2", "train.nonfinite=rollback",
               "train.keep_checkpoints=0", *extra)
    lines: list[str] = []
    train(cfg, log=lines.append)
    run = Path(cfg.train.run_dir)
    (event,) = _nonfinite_events(run)
    assert event["step"] == bad and event["policy"] == "rollback"
    _assert_gradient_nan_only(event)
    return nan, run, lines


def test_rollback_on_a_nan_gradient_reloads_the_checkpoint_and_trains_on(tiny_overrides, monkeypatch):
    """Step 4's gradient is NaN: the run goes back to step 2 -- undoing step 3's update, which
    was applied -- and trains steps 3..5 again on the data after step 4's batch."""
    nan, run, lines = _rolled_back(tiny_overrides, monkeypatch, 4)
    assert sum(": rolled back to step-0000002" in line for line in lines) == 1, lines
    step2, final = _checkpoint(run, 2), _checkpoint(run, 5)
    saved = _model_pt(step2)[POISONED]
    # Forward passes 1..4 are steps 1..4 of the first try; a later one started from step 2's weights again.
    assert len(nan.seen) > 4 and not torch.equal(nan.seen[3], saved)  # step 4 started from step 3's update
    assert any(torch.equal(w, saved) for w in nan.seen[4:]), "no step after the rollback started from step 2's weights"
    state = json.loads((final / "state.json").read_text())
    assert state["guard"]["rollbacks"] == 1 and state["guard"]["rollbacks_to"] == {"step-0000002": 1}
    # AdamW's count came back with the checkpoint: 2 + steps 3, 4, 5 trained again (not 6).
    assert _adam_steps(final) == {5}
    # The data since the checkpoint was skipped, not replayed (that would be 2 + 3 batches): 4
    # batches, then 3 more (one more if the bad step was learnt of after the next batch was drawn).
    assert state["loader"]["batches"] >= 7, state["loader"]
    weights = nan.weights()
    _assert_finite(weights, "after the run")
    _assert_identical(weights, _model_pt(final), "weights after the run vs its last checkpoint")


HUGE_LR = "optim.lr=1e30"


def test_a_huge_learning_rate_diverges_and_stops(tiny_overrides, monkeypatch):
    """optim.lr=1e30: AdamW's first update (lr/5 in warm-up, times ~the sign of the gradient)
    moves every weight by ~2e29, so at step 2 the squares in the first RMSNorm overflow float32
    (any value above ~1.8e19 does, whatever the CPU or the order of the sums): the norm's scale
    is rsqrt(inf) = 0, the logits are all 0 and the loss is a finite ln V, while the norm's
    backward makes 0 * inf = NaN -- a non-finite gradient under a finite loss, at step 2.
    (Smaller rates diverge too, but at a step that depends on where the sums land near the
    overflow: 1e3 ... 1e8 stopped at steps 2 to 7 here, some through a NaN loss.)"""
    nan = NanGradients(monkeypatch, set())  # no NaN made: only to keep the model
    cfg = _run(tiny_overrides, "train.max_steps=6", HUGE_LR, "train.nonfinite=stop")
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradients at step 2 "):
        train(cfg, log=lambda s: None)
    run = Path(cfg.train.run_dir)
    (event,) = _nonfinite_events(run)
    assert event["step"] == 2
    _assert_gradient_nan_only(event)
    diag = json.loads((run / "nonfinite-step-0000002.json").read_text())
    assert diag["policy"] == "stop" and diag["lr"] > 1e29 and math.isnan(diag["grad_norm"])
    _assert_finite(nan.weights(), "after the stop")


def test_a_huge_learning_rate_under_skip_stops_at_the_patience(tiny_overrides):
    """Skipping cannot save a run whose weights are already blown up: every step from 2 on has a
    NaN gradient; 3 are skipped, the 4th in a row exceeds train.nonfinite_patience=3."""
    cfg = _run(tiny_overrides, "train.max_steps=8", HUGE_LR, "train.nonfinite=skip")
    with pytest.raises(NonFiniteError, match=r"at step 5 .*4 in a row exceeds train.nonfinite_patience=3"):
        train(cfg, log=lambda s: None)
    run = Path(cfg.train.run_dir)
    events = _nonfinite_events(run)
    assert [e["step"] for e in events] == [2, 3, 4, 5]
    for e in events:
        _assert_gradient_nan_only(e)
    diag = json.loads((run / "nonfinite-step-0000005.json").read_text())
    assert diag["policy"] == "skip" and diag["skipped"] == 3 and diag["in_a_row"] == 4


def test_rollback_of_a_step_read_late_undoes_the_step_issued_after_it(tiny_overrides, monkeypatch):
    """Step 3's gradient is NaN and step 3 is read only after step 4 was issued (it neither logs
    nor saves): the rollback to step 2 undoes step 4's work too, and the run goes on from step
    2's weights, on the data after step 3's batch -- what a read before each update would do."""
    nan, run, _ = _rolled_back(tiny_overrides, monkeypatch, 3, LATE)
    saved = _model_pt(_checkpoint(run, 2))[POISONED]
    # Forward passes 1..4: steps 1..4 of the first try (4 issued before 3 was read); the 5th, the
    # first after the rollback, starts from step 2's weights.
    assert len(nan.seen) == 4 + 3 and torch.equal(nan.seen[4], saved), len(nan.seen)
    state = json.loads((_checkpoint(run, 5) / "state.json").read_text())
    assert state["guard"]["rollbacks"] == 1 and _adam_steps(_checkpoint(run, 5)) == {5}
    # the loader resumes after step 3's batch: 3 batches, then steps 3..5 again -- 6, not 7 (step 4's
    # batch, drawn before the rollback, is drawn again, as a check before each update would)
    assert state["loader"]["batches"] == 6, state["loader"]
