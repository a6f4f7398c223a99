"""Progress within preflight's long steps: how long a step will take here, said before a phase
of them starts, and where a step is while it runs.

One optimizer step of a large configuration on a small device takes minutes (smollm-360m's
524K tokens on a CPU: its preflight printed two lines, then nothing for five minutes), and
preflight runs several: the end-to-end check's four, each trial's warm-up and timed steps.
:meth:`StepProgress.estimate` says how long one step of a phase will take by the step's FLOPs
at a rate -- the datasheet peak (or ``train.peak_tflops``) at the planner's 40% MFU, or on a
device without one its matmul rate measured on a few of this model's GEMMs (an upper bound: a
step does more than matmuls) -- labelled as an estimate, when that is LONG_STEP_S or more.
While a step runs, :class:`StepProgress` -- told of each micro-batch through
``measure.timing.micro_batch_progress`` -- says which micro-batch the step is at and how long
its rest will take at the pace measured so far: once the step has run PROGRESS_EVERY_S, and
then at most that often, by the preflight's clock (a test's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flopwise.config import RunConfig
from flopwise.measure.ceiling import measure_ceiling, step_gemms
from flopwise.measure.sinks import human
from flopwise.train.hooks import fmt_time
from flopwise.train.precision import resolve
from flopwise.tune.request import Bench, Log

LONG_STEP_S = 10.0  # a step estimated longer is announced before its phase
PROGRESS_EVERY_S = 5.0  # a step is followed once it has run this long, and at most this often
ASSUMED_MFU = 0.40  # the planner's, where a datasheet peak gives the rate
# FLOP/s below any device preflight runs on: a step of fewer FLOPs than LONG_STEP_S of it is
# never long, so no rate is measured for it where no peak gives one (the tiny preset's steps)
SLOWEST_FLOPS = 1e9
GEMM_TOKENS = 128  # tokens of the GEMMs a CPU's rate is measured on: a fraction of a second


@dataclass(frozen=True)
class Rate:
    """The FLOP/s a step is estimated at, and how it was found (the estimate's label)."""

    flops_per_s: float
    basis: str


def step_rate(cfg: RunConfig, bench: Bench) -> Rate:
    """The rate a step of ``cfg`` on ``bench`` is estimated at: the planner's MFU of the peak,
    or, without a peak, this device's matmul rate on the model's GEMMs, measured now."""
    if bench.peak:
        return Rate(ASSUMED_MFU * bench.peak, f"an assumed {ASSUMED_MFU:.0%} of {bench.peak_note}")
    prec = resolve(cfg.train.precision, bench.device)
    tokens = min(GEMM_TOKENS, cfg.train.micro_batch_size * cfg.train.seq_len)
    # the blocks' GEMMs: the LM head's, a vocabulary wide, took seconds of their own on a CPU
    gemms = [g for g in step_gemms(cfg.model, tokens) if not g.name.startswith("lm head")]
    c = measure_ceiling(gemms, bench.device, prec.autocast_dtype or prec.param_dtype, min_seconds=0.01)
    return Rate(c.flops_per_s, "this device's matmul rate, measured on the model's GEMMs; a step does more than "
                               "matmuls, so likely longer")


class StepProgress:
    """Preflight's progress within long steps (the module docstring): :meth:`begin` names the
    phase and its steps, :meth:`estimate` words a step's expected time, and a call
    ``(done, of)`` for each micro-batch (``measure.timing.micro_batch_progress``) says where
    the step is when it has run long enough."""

    def __init__(self, cfg: RunConfig, bench: Bench, log: Log, clock: Callable[[], float],
                 every_s: float = PROGRESS_EVERY_S):
        self.cfg, self.bench, self.log, self.clock, self.every_s = cfg, bench, log, clock, every_s
        self.rate: Rate | None = None  # assumed(): found when a step first may be long
        self.measured: Rate | None = None  # the last whole step's, where its tokens were told
        self.phase, self.steps, self.step, self.tokens = "a step", 0, 0, 0
        self.started = self.said = 0.0

    def begin(self, phase: str, steps: int, tokens: int = 0) -> None:
        """A phase of ``steps`` steps of ``tokens`` tokens (0: not told) starts: its progress
        lines name it and count them; each of its steps done is the rate the next estimate uses."""
        self.phase, self.steps, self.step, self.tokens = phase, steps, 0, tokens

    def estimate(self, tokens: int) -> str:
        """A step of ``tokens`` tokens' expected time here, as words: "" when it is short."""
        flops = self.bench.fpt * tokens
        if not self.bench.peak and flops < LONG_STEP_S * SLOWEST_FLOPS:  # not worth measuring a rate for
            return ""
        rate = self.measured or self.assumed()
        seconds = flops / rate.flops_per_s
        if seconds < LONG_STEP_S:
            return ""
        return (f"about {fmt_time(seconds)} a step here (an estimate: {human(flops)}FLOPs a step at "
                f"{human(rate.flops_per_s)}FLOP/s, {rate.basis}); progress every {self.every_s:g} s within a step")

    def assumed(self) -> Rate:
        """:func:`step_rate`, found once (on a CPU it is a measurement)."""
        if self.rate is None:
            self.rate = step_rate(self.cfg, self.bench)
        return self.rate

    def __call__(self, done: int, of: int) -> None:
        now = self.clock()
        if done == 0:  # a step starts
            self.step += 1
            self.started = now
            return
        if done == of and self.tokens and now > self.started:
            self.measured = Rate(self.bench.fpt * self.tokens / (now - self.started),
                                 f"measured on the {self.phase}'s step {self.step}")
        if now - self.started < self.every_s or now - self.said < self.every_s:
            return
        self.said = now
        elapsed = now - self.started
        count = f"{self.step}/{self.steps}" if self.steps else f"{self.step}"
        rest = (f"~{fmt_time(elapsed / done * (of - done))} left in this step (measured: "
                f"{fmt_time(elapsed / done)} a micro-batch)" if done < of else "step done")
        self.log(f"preflight: {self.phase} step {count}: micro-batch {done}/{of} · {fmt_time(elapsed)} in · {rest}")
