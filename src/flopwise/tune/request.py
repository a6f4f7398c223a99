"""What a ``flopwise preflight`` is asked to do, and what that comes to on this machine.

:class:`TuneRequest` is the request as the command line gives it, built once (``cli.py``'s
``cmd_preflight``) and passed down whole: what to measure, the budget, the isolation and the
ranks, the run being predicted, where the output goes and where progress lines go.
:class:`Bench` is what preflight resolves from it, the configuration and the device before
the first trial: the memory a trial must fit, whether trials run in fresh processes, and the
FLOPs and peak their rates are turned into MFU with. The micro-batch search, the ladder and
the prediction read both instead of a dozen loose arguments each. :class:`TuneHooks` is what
a test injects instead (the measuring functions, the clock), passed beside the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from flopwise.tune.trial import measure, measure_in_processes

Log = Callable[[str], None]
MIN_WINDOWS = 3  # timed windows per trial: fewer give no spread
# Rounds of re-measuring the trials still within the noise of the fastest (each round times
# every one of them once more, as many windows as its trial did, in the same order: A B A B).
# Three rounds quadruple those trials' windows, which narrows the median's interval (see
# median_spread) by about a third (under normal noise, from about 0.85 to 0.54 standard
# deviations, at a higher coverage); a tie left after that is within what this machine can tell
# apart in a preflight, at most four times those trials' first cost, and the search's time stays
# bounded by --budget-minutes as well.
REMEASURE_ROUNDS = 3


@dataclass(frozen=True)
class TuneRequest:
    """One preflight as asked; the defaults are ``flopwise preflight``'s."""

    # What to measure: the micro-batch search, or the optimization ladder (``tune/ladder.py``),
    # which keeps fp8 only with ``ladder_fp8``.
    ladder: bool = False
    ladder_fp8: bool = False
    # The run the prediction is for: its tokens or its hours (0: the configuration's), and the
    # price of a GPU hour (0: no cost).
    tokens: int = 0
    hours: float = 0.0
    price_per_gpu_hour: float = 0.0
    # The memory a trial must fit: ``headroom`` of ``memory_gb`` (0: the GPU's; on a CPU, no limit).
    memory_gb: float = 0.0
    headroom: float = 0.9
    # The budget: warm-up and timed steps per trial (at least MIN_WINDOWS timed), the minutes
    # the search with its re-measures, or the ladder, may take, and the re-measure rounds.
    warmup: int = 2
    steps: int = 3
    budget_minutes: float = 15.0
    remeasure_rounds: int = REMEASURE_ROUNDS
    # Isolation of one-rank trials (auto, reset or process), and the ranks the ladder scales out to.
    isolation: str = "auto"
    world: int = 1
    # Where preflight.json and preflight.yaml go ("": runs/PRESET-preflight); where progress lines go.
    out_dir: str | Path = ""
    log: Log = print

    @property
    def windows(self) -> int:
        """Timed windows per trial: ``steps``, at least MIN_WINDOWS."""
        return max(self.steps, MIN_WINDOWS)

    def out(self, preset: str) -> Path:
        """The directory preflight.json and preflight.yaml go to."""
        return Path(self.out_dir or f"runs/{preset or 'run'}-preflight")


@dataclass(frozen=True)
class TuneHooks:
    """What a test puts in place of the real thing under a preflight, apart from what a user asks
    (:class:`TuneRequest`): how a trial is measured in this process and in fresh ones
    (``tune/trial.py``) and the clock the budgets and progress lines are kept by. The defaults
    are the real ones; the command line never builds one."""

    measure_fn: Callable[..., dict[str, Any]] = measure
    spawn_fn: Callable[..., dict[str, Any]] = measure_in_processes
    clock: Callable[[], float] = time.perf_counter


@dataclass(frozen=True)
class Bench:
    """Where the trials run and what their figures are judged against, resolved once by preflight
    from the request, the configuration and the device (the defaults: a CPU without a memory
    limit or a datasheet peak)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    memory_gb: float = 0.0  # the GPU's memory, or --memory-gb's (0: no limit)
    headroom: float = 0.9  # the share of it a trial may use
    fresh: bool = False  # one-rank trials each in a fresh process (--isolation, resolved)
    fpt: float = 0.0  # the model's training FLOPs per token (plan/flops.py)
    peak: float | None = None  # the device's datasheet FLOP/s (None: no MFU)
    peak_note: str = ""  # where the peak came from

    def fits(self, gb: float) -> bool:
        """Whether a peak of ``gb`` GiB is within the headroom (always, without a memory size)."""
        return not self.memory_gb or gb <= self.headroom * self.memory_gb

    def mfu(self, tok_per_s: float, world: int = 1) -> float | None:
        """Model FLOP utilization per device of ``tok_per_s`` over ``world`` devices (None without a peak)."""
        return tok_per_s * self.fpt / (self.peak * world) if self.peak else None
