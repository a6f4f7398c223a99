"""When a run must stop early, and how it does so without losing work.

- :class:`SignalStop`: SIGTERM / SIGINT (preemption, Ctrl-C) ask the loop to finish the
  current step, save a checkpoint and exit 0; a second signal exits at once (the last
  complete checkpoint stays valid: saves are atomic).
- :class:`Deadline`: ``train.max_hours`` -- before each step, stop if that step plus a
  final save would not fit in the budget (the save's duration is measured, or estimated
  from the bytes to write before the first save).
- :class:`NonFiniteGuard`: the step's loss and gradient norm are checked before the
  optimizer update (one scalar transfer per step); the policy decides what happens, and
  loss spikes against a running mean are reported as events.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient; the message names the step."""


class SignalStop:
    """Turns the first SIGTERM/SIGINT into a request to stop after the current step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

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
            signal.signal(s, h)
        self._previous = {}


class Deadline:
    """``max_hours`` of wall-clock time from ``start``; 0 = none."""

    MARGIN = 1.1  # 10% on top of the predicted step + save

    def __init__(self, max_hours: float, start: float, state_bytes: int):
        self.max_hours = max_hours
        self.end = start + max_hours * 3600 if max_hours > 0 else None
        self.save_s = 1.0 + state_bytes / 100e6  # until a save is measured: 100 MB/s, +1 s
        self.step_s = 0.0

    def record_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s == 0 else max(seconds, 0.9 * self.step_s + 0.1 * seconds)

    def record_save(self, seconds: float) -> None:
        self.save_s = seconds

    def must_stop(self, now: float | None = None) -> bool:
        """Whether one more step and a final save would overrun the budget."""
        if self.end is None:
            return False
        now = time.perf_counter() if now is None else now
        return now + self.MARGIN * (self.step_s + self.save_s) > self.end


class NonFiniteGuard:
    """Policy for non-finite steps (``stop`` | ``skip`` | ``rollback``) and loss-spike events."""

    def __init__(self, policy: str, patience: int, spike_factor: float, warmup: int = 10):
        self.policy = policy
        self.patience = patience
        self.spike_factor = spike_factor
        self.warmup = warmup
        self.in_a_row = 0
        self.skipped = 0
        self.rollbacks = 0
        self.mean: float | None = None  # running mean of the loss (EMA)
        self.seen = 0

    def check(self, loss: float, grad_norm: float) -> bool:
        """True when the step is finite (and resets the streak)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        return False

    def exhausted(self) -> bool:
        return self.in_a_row > self.patience

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
        return {"skipped": self.skipped, "rollbacks": self.rollbacks, "mean": self.mean, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.mean = state.get("mean")
        self.seen = int(state.get("seen", 0))
