"""When a run must stop early, and how it does so without losing work.

- :class:`SignalStop`: SIGTERM / SIGINT (preemption, Ctrl-C) ask the loop to finish the
  current step, save a checkpoint and exit 0; a second signal exits at once (the last
  complete checkpoint stays valid: saves are atomic).
- :class:`Deadline`: ``train.max_hours`` -- before each step, stop if that step plus a
  final save would not fit in the budget (the save's duration is measured, or estimated
  from the bytes to write before the first save). The budget is the run's: checkpoints
  record the time spent, and a resume continues it (:func:`budget_spent` when none is left).
- :class:`NonFiniteGuard`: the step's loss and gradient norm are checked before the
  optimizer update (one scalar transfer per step); the policy decides what happens, and
  loss spikes against a running mean are reported as events. A collapse -- the gradient
  norm at ~0 for several steps, typically with the loss at ln V -- is a bad step too: a
  diverged run often sits there, finite and learning nothing, before its first NaN.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from flopwise.checkpoints import CheckpointError
from flopwise.config import TrainConfig
from flopwise.errors import FlopwiseError
from flopwise.parallel.distributed import DistEnv
from flopwise.train.schedule import MARGIN as BUDGET_MARGIN
from flopwise.train.schedule import fitted_progress


class NonFiniteError(FlopwiseError, RuntimeError):
    """Training stopped on a non-finite loss or gradient; the message names the step."""


class SignalStop:
    """Turns the first SIGTERM/SIGINT into a request to stop after the current step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second one: no more waiting
            os.write(2, f"\nflopwise: {signal.Signals(signum).name} again: exiting now without saving\n".encode())
            os._exit(128 + signum)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            if signal.getsignal(s) == self._handle:  # one set meanwhile (ignore_sigterm) stays
                signal.signal(s, h)
        self._previous = {}


def ignore_sigterm() -> None:
    """Ignore SIGTERM from now on, in a process that is about to end anyway: a rank stopping
    because another rank died is sent SIGTERM by ``torchrun`` too, which would cut off the one
    line that says why. (SIGINT still interrupts; torchrun's SIGKILL follows its SIGTERM.)"""
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass
class StopWork:
    """What a stop does after its final save -- validate, write a sample -- and how long each
    takes here: measured whenever the run does it (``*_s``), until then estimated in steps'
    time (``*_steps``, from the sizes: a validation's windows against a step's). A time budget
    keeps room for both (:meth:`Deadline.must_stop`); a signal's stop does what is cheap."""

    val_s: float | None = None
    sample_s: float | None = None
    val_steps: float = 0.0
    sample_steps: float = 0.0

    def validation(self, step_s: float) -> float:
        return self.val_s if self.val_s is not None else self.val_steps * step_s

    def sample(self, step_s: float) -> float:
        return self.sample_s if self.sample_s is not None else self.sample_steps * step_s

    def seconds(self, step_s: float) -> float:
        return self.validation(step_s) + self.sample(step_s)


class Deadline:
    """``max_hours`` of training time, the run's across its processes; 0 = none.

    A resumed run continues the budget its checkpoint recorded (:meth:`state_dict`): the
    time every earlier process spent up to that save (set-up included; the time between
    processes is not the run's), so a preempted 24-hour run gets what was left of its 24
    hours, not another 24. ``start`` is this process's start, on ``clock``."""

    MARGIN = BUDGET_MARGIN  # 10% on top of the predicted step + save

    def __init__(self, max_hours: float, start: float, state_bytes: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.max_hours, self.start, self.clock = max_hours, start, clock  # clock: seconds, as ``start``
        self.spent_before = 0.0  # the run's time spent by earlier processes (a resume)
        self.carried = False  # whether that came from a checkpoint (one from an older flopwise records none)
        self.end = start + max_hours * 3600 if max_hours > 0 else None
        self.save_s = 1.0 + state_bytes / 100e6  # until a save is measured: 100 MB/s, +1 s
        self.step_s = 0.0
        self.stop_work = StopWork()  # a stop's validation and sample after its save: kept room for

    @property
    def budget_s(self) -> float:
        return self.max_hours * 3600

    def spent(self, now: float | None = None) -> float:
        """The run's time spent so far: earlier processes' and this one's."""
        return self.spent_before + ((self.clock() if now is None else now) - self.start)

    def record_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s == 0 else max(seconds, 0.9 * self.step_s + 0.1 * seconds)

    def record_save(self, seconds: float) -> None:
        self.save_s = seconds

    def must_stop(self, now: float | None = None) -> bool:
        """Whether one more step, a final save and the stop's validation and sample would overrun
        the budget."""
        if self.end is None:
            return False
        now = self.clock() if now is None else now
        return now + self.MARGIN * (self.step_s + self.save_s + self.stop_work.seconds(self.step_s)) > self.end

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint records: the run's time spent up to it, and the step, save and stop-work
        times this process kept room for, so a resume decides as it would have (:func:`budget_spent`)."""
        return {"spent_s": self.spent(), "step_s": self.step_s, "save_s": self.save_s,
                "stop_s": self.stop_work.seconds(self.step_s)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue the budget of a checkpoint (:func:`saved_budget`; {} from one that predates it:
        nothing spent)."""
        if not state:
            return
        self.spent_before, self.step_s, self.save_s = state["spent_s"], state["step_s"], state["save_s"]
        self.carried = True
        if self.end is not None:
            self.end = self.start + self.budget_s - self.spent_before


BUDGET_FIELDS = ("spent_s", "step_s", "save_s", "stop_s")


def saved_budget(saved: dict[str, Any], checkpoint: Path) -> dict[str, float]:
    """A checkpoint's ``time_budget`` (:meth:`Deadline.state_dict`), checked: {} when it has none
    (written before flopwise recorded it); a value that is not a finite number >= 0 is refused,
    naming the file and the field, rather than moving the budget."""
    budget = saved.get("time_budget")
    if budget is None:
        return {}
    where = f"{checkpoint / 'state.json'}: field 'time_budget'"
    if not isinstance(budget, dict):
        raise CheckpointError(f"{where} = {budget!r}: expected an object of {', '.join(BUDGET_FIELDS)}")
    out = {}
    for name in BUDGET_FIELDS:
        v = budget.get(name, 0.0 if name == "stop_s" else None)  # stop_s: recorded since a stop validates
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise CheckpointError(f"{where}.{name} = {v!r}: expected a number of seconds >= 0")
        out[name] = float(v)
    return out


def budget_spent(max_hours: float, budget: dict[str, float]) -> bool:
    """Whether a run whose checkpoint recorded ``budget`` has no step left in ``train.max_hours``:
    the test the run stopped on (one more step, a save and the stop's validation and sample would
    overrun it; with a time-fitted schedule, its progress reaching 1 is the same inequality)."""
    if max_hours <= 0 or not budget:
        return False
    room = budget["step_s"] + budget["save_s"] + budget.get("stop_s", 0.0)
    return budget["spent_s"] + Deadline.MARGIN * room >= max_hours * 3600


class NonFiniteGuard:
    """What to do about bad steps (``stop`` | ``skip`` | ``rollback``), within bounds; loss spikes.

    A bad step is a non-finite loss or gradient norm, or the ``collapse_steps``-th step in a
    row of a collapse (:meth:`collapsed`). ``skip`` drops the update, ``rollback`` reloads the
    last checkpoint; either stops the run instead -- with the diagnostics the ``stop`` policy
    writes -- once :meth:`refusal` names a bound:

    - ``patience``: bad steps in a row. A finite step in between resets it, so on its own it
      does not end a run that alternates (a learning rate far too high rolled back 700 times
      in 5 minutes), hence the totals:
    - ``max_skips``: skipped updates in the run;
    - ``max_rollbacks``: rollbacks in the run, and ``max_rollbacks_per_checkpoint`` to one and
      the same checkpoint (rolling back to it again replays the same weights).

    The counts travel in :meth:`state_dict` (saved in every checkpoint), so the totals hold
    across resumes. A rollback reloads weights, optimizer and RNG only, never this state: the
    checkpoint's older counts must not undo the rollback being counted.
    """

    COLLAPSE_GRAD_NORM = 1e-6  # "~0": below any healthy run's global norm (O(0.1-10)) by 5 orders
    COLLAPSE_LOSS_TOL = 1e-4  # "at ln V": the uniform prediction's loss, to this much

    def __init__(self, t: TrainConfig, uniform_loss: float | None = None, warmup: int = 10):
        """The guard of ``t``'s ``nonfinite*``, ``collapse_steps`` and ``spike_factor`` settings;
        ``uniform_loss`` = ln(model vocabulary size); no spike or collapse is seen in the first
        ``warmup`` steps."""
        self.policy = t.nonfinite
        self.patience = t.nonfinite_patience
        self.spike_factor = t.spike_factor
        self.warmup = warmup
        self.max_skips = t.nonfinite_max_skips
        self.max_rollbacks = t.nonfinite_max_rollbacks
        self.max_rollbacks_per_checkpoint = t.nonfinite_max_rollbacks_per_checkpoint
        self.collapse_steps = t.collapse_steps
        self.uniform_loss = uniform_loss
        self.in_a_row = 0
        self.skipped = 0
        self.rollbacks = 0
        self.rollbacks_to: dict[str, int] = {}  # checkpoint name -> rollbacks to it
        self.collapsed_in_a_row = 0
        self.mean: float | None = None  # running mean of the loss (EMA)
        self.seen = 0

    def check(self, loss: float, grad_norm: float) -> bool:
        """True when the step is finite (and resets the streak)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.collapsed_in_a_row = 0  # not a flat step: a collapse is counted in consecutive finite steps
        return False

    def collapsed(self, loss: float, grad_norm: float) -> bool:
        """Whether this finite step completes a collapse: ``collapse_steps`` steps in a row, after
        the first ``warmup`` steps, whose gradient norm is exactly 0, or below
        ``COLLAPSE_GRAD_NORM`` with the loss within ``COLLAPSE_LOSS_TOL`` of ln V. Counted as one
        more bad step in a row (patience) when it fires; the streak starts over after it."""
        if self.collapse_steps <= 0:
            return False
        at_uniform = self.uniform_loss is not None and abs(loss - self.uniform_loss) <= self.COLLAPSE_LOSS_TOL
        flat = grad_norm == 0.0 or (at_uniform and abs(grad_norm) < self.COLLAPSE_GRAD_NORM)
        if not flat or self.seen < self.warmup:
            self.collapsed_in_a_row = 0
            return False
        self.collapsed_in_a_row += 1
        if self.collapsed_in_a_row < self.collapse_steps:
            return False
        self.collapsed_in_a_row = 0
        self.in_a_row += 1
        return True

    def exhausted(self) -> bool:
        return self.in_a_row > self.patience

    def refusal(self, checkpoint: str | None, collapse: bool = False) -> str:
        """Why this bad step stops the run instead of being skipped or rolled back ("" when the
        policy applies); ``checkpoint`` names the one a rollback would go to (None: none).

        A collapse is never skipped: skipping drops one update, but the weights are already
        collapsed and the next steps would be the same; only a rollback undoes it."""
        if collapse and self.policy != "rollback":
            return (f"train.nonfinite={self.policy}: a collapse is not skipped (the weights are already collapsed); "
                    "train.nonfinite=rollback goes back to the last checkpoint, train.collapse_steps=0 turns "
                    "the check off")
        if self.policy == "stop":
            return "train.nonfinite=skip or rollback continues past it"
        if self.exhausted():
            return f"{self.in_a_row} in a row exceeds train.nonfinite_patience={self.patience}"
        if self.policy == "skip" and self.skipped >= self.max_skips:
            return (f"{self.skipped} update(s) already skipped in this run: the bound "
                    f"train.nonfinite_max_skips={self.max_skips} is reached")
        if self.policy == "rollback":
            if checkpoint is None:
                return "no checkpoint to roll back to"
            if self.rollbacks >= self.max_rollbacks:
                return (f"{self.rollbacks} rollback(s) already in this run: the bound "
                        f"train.nonfinite_max_rollbacks={self.max_rollbacks} is reached")
            n = self.rollbacks_to.get(checkpoint, 0)
            if n >= self.max_rollbacks_per_checkpoint:
                return (f"already rolled back to {checkpoint} {n} time(s): the bound "
                        f"train.nonfinite_max_rollbacks_per_checkpoint={self.max_rollbacks_per_checkpoint} is reached")
        return ""

    def record_skip(self) -> None:
        self.skipped += 1

    def record_rollback(self, checkpoint: str) -> None:
        self.rollbacks += 1
        self.rollbacks_to[checkpoint] = self.rollbacks_to.get(checkpoint, 0) + 1

    def spike(self, loss: float) -> float | None:
        """The loss / running-mean ratio when this finite loss is a spike, else None; updates the mean."""
        ratio = None
        if self.spike_factor > 0 and self.mean is not None and self.seen >= self.warmup and self.mean > 0:
            if loss > self.spike_factor * self.mean:
                ratio = loss / self.mean
        self.mean = loss if self.mean is None else 0.95 * self.mean + 0.05 * loss
        self.seen += 1
        return ratio

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "rollbacks": self.rollbacks, "rollbacks_to": dict(self.rollbacks_to),
                "mean": self.mean, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        """Resume the counts of a checkpoint (a resumed run; never a rollback, see the class)."""
        self.skipped = int(state.get("skipped", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.rollbacks_to = {str(k): int(v) for k, v in state.get("rollbacks_to", {}).items()}
        self.mean = state.get("mean")
        self.seen = int(state.get("seen", 0))


class TimeFit:
    """WSD fitted to ``train.max_hours``: progress is the share of the run's time budget used
    (:meth:`Deadline.spent`, across its processes; the final save's time kept aside), so the decay
    ends as the budget does, and a resumed run continues it."""

    def __init__(self, deadline: Deadline, clock: Callable[[], float] = time.perf_counter):
        self.deadline, self.clock = deadline, clock
        self.agreed_progress: float | None = None  # under data parallelism: rank 0's, shared each step

    def measure(self) -> float:
        """The share of the budget used, by this process's clock."""
        d = self.deadline
        assert d.end is not None, "TimeFit needs a time budget: train.max_hours > 0"
        return fitted_progress(d.spent(self.clock()), d.budget_s, d.step_s, d.save_s + d.stop_work.seconds(d.step_s))

    def progress(self) -> float:
        return self.agreed_progress if self.agreed_progress is not None else self.measure()

    def seconds_left(self) -> float:
        """Training time left before the fitted schedule ends: the budget, less what is kept aside
        for the final save and the stop's work (as :meth:`measure` keeps it), less what is spent."""
        d = self.deadline
        kept = BUDGET_MARGIN * (d.save_s + d.stop_work.seconds(d.step_s))
        return max(d.budget_s - kept - d.spent(self.clock()), 0.0)

    @staticmethod
    def done(progress: float) -> bool:
        """Whether the budget is used at ``progress`` (the step's :meth:`progress`, read once): from
        the first step, warm-up or not (the schedule's warm-up is capped by the fitted decay,
        :func:`~flopwise.train.schedule.lr_for_step`, so a budget shorter than the warm-up still
        ends at the floor rate)."""
        return progress >= 1.0


def stop_votes(env: DistEnv, signals: SignalStop, deadline: Deadline, fit: TimeFit | None) -> list[float]:
    """This rank's votes on stopping -- a signal received, ``train.max_hours`` reached, rank 0's
    progress through a time-fitted schedule -- to be summed over ranks in the next step's
    all-reduce (``train_step.step_values``): none without data parallelism."""
    if not env.distributed:
        return []
    progress = fit.measure() if fit is not None and env.is_main else 0.0
    return [float(signals.requested), float(fit is None and deadline.must_stop()), progress]


def by_signal(reason: str) -> bool:
    """Whether :func:`stop_reason`'s ``reason`` is a signal's (this rank's or another's), not
    the time budget's."""
    return reason.endswith(" received") or reason == "a signal received by another rank"


def stop_reason(env: DistEnv, signals: SignalStop, deadline: Deadline, fit: TimeFit | None,
                agreed: list[float] | None) -> str:
    """Why to stop before the next step ("" to go on), the same answer on every rank: a
    signal that reached any rank, ``train.max_hours`` by any rank's clock. Under data
    parallelism it is the ranks' votes of the last step read (``agreed``: summed in that step's
    all-reduce, with its loss -- no collective, no read of its own; at most a step later than
    one rank alone would stop), and a WSD fitted to the time budget follows rank 0's clock, so
    every rank sets the same learning rate: its progress travels in the same votes."""
    signal_, late = signals.requested, fit is None and deadline.must_stop()
    if env.distributed:
        if not agreed:  # no step read yet: every rank starts the fitted schedule at rank 0's 0
            if fit is not None and fit.agreed_progress is None:
                fit.agreed_progress = 0.0
            return ""
        n_signals, n_late, progress = agreed
        if fit is not None:
            fit.agreed_progress = progress
        if n_signals and not signal_:
            return "a signal received by another rank"
        signal_, late = bool(n_signals), bool(n_late)
    if signal_:
        return f"{signals.name} received"
    if late:
        return f"train.max_hours={deadline.max_hours:g} reached" + (" (by the slowest rank's clock)"
                                                                    if env.distributed else "")
    return ""
