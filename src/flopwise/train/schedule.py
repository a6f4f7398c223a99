"""Learning-rate schedules as functions of progress, and the batch-size warm-up.

Learning rate
-------------
:func:`lr_factor` gives the multiplier of the peak learning rate for a *progress* in
[0, 1] -- the fraction of the run's budget done, whatever the budget counts: optimizer
steps, tokens, or wall-clock seconds (:func:`time_progress`). One function serves all
three, so a run limited by tokens or by time follows the same shape as one limited by
steps. Convention: pass the progress at the *end* of the step being taken (``(step + 1)
/ total_steps``, tokens after the step / total tokens), so the first step gets a small
but non-zero rate and the last one gets exactly the floor.

- warm-up: linear from 0 to 1 over ``warmup_fraction`` of the run (all schedules);
- ``constant``: 1 after warm-up;
- ``cosine``: half a cosine from 1 after warm-up to ``min_lr_ratio`` at progress 1;
- ``wsd`` (warmup-stable-decay): 1 until ``1 - decay_fraction``, then ``decay_shape``
  (``linear``, ``cosine`` or ``sqrt`` = 1 - sqrt(x)) down to ``min_lr_ratio`` at 1.

WSD needs no total length until the decay begins, which is what makes it fit a
wall-clock budget: with progress = elapsed / budget the decay starts at
``(1 - decay_fraction) * budget`` (:func:`wsd_decay_start`) and reaches the floor exactly
when the budget is spent, so a run that stops on time stops with its decay finished.

Changing the length of a run on resume
--------------------------------------
A cosine (or a WSD in its decay) depends on the run's total length, so recomputing it
for a new ``train.max_steps`` moves the rate of the step being resumed: extending a
finished 80-step cosine to 100 steps would put it back up from the floor. Instead the
rate *continues from where it was* (:class:`Continuation`): from the rate of the last
step taken, the schedule's decay curve (cosine, or the WSD's ``decay_shape``) down to
the floor at the new last step -- held at the floor when the old schedule had already
reached it. When the new length's schedule gives the last step taken the same rate
(a constant schedule, a WSD still in its stable phase, a run still warming up) the new
schedule is simply used: it joins without a jump, and a WSD's decay moves to the new end.

Batch-size warm-up
------------------
:func:`accum_at` ramps gradient accumulation (hence the global batch) linearly in tokens
from ``start_accum`` to ``full_accum`` over the first ``ramp_tokens`` tokens, as
DeepSeek-V3 ramped its batch over its first tokens: small batches are as good per token
early on, when the gradient noise scale is small, and cost fewer tokens per update.
:func:`ramp_plan` lays out the whole run in advance (steps and accumulation per step).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from flopwise.config import ConfigError, OptimConfig, RunConfig, load_run_config

SCHEDULES = ("cosine", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "sqrt")


def decay_curve(x: float, shape: str) -> float:
    """The decay from 1 (x = 0) to 0 (x = 1): ``linear`` 1 - x, ``cosine`` (1 + cos(pi x)) / 2,
    ``sqrt`` 1 - sqrt(x) (fast drop first, the shape of several WSD papers' cool-downs)."""
    x = min(max(x, 0.0), 1.0)
    if shape == "linear":
        return 1.0 - x
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * x))
    if shape == "sqrt":
        return 1.0 - math.sqrt(x)
    raise ValueError(f"decay shape {shape!r}: choose {', '.join(DECAY_SHAPES)}")


def wsd_decay_start(total: float, decay_fraction: float) -> float:
    """Where a WSD decay begins, in the units of ``total`` (steps, tokens or seconds).

    For a wall-clock budget: ``wsd_decay_start(budget_s, f)`` seconds into the run the
    rate starts to fall, and it reaches the floor at ``budget_s``
    (``lr_factor(time_progress(elapsed, budget_s), ...)``)."""
    return total * (1.0 - min(max(decay_fraction, 0.0), 1.0))


def time_progress(elapsed_s: float, budget_s: float, step_s: float = 0.0) -> float:
    """Progress of a run fitted to a wall-clock budget: ``(elapsed + step) / budget`` in [0, 1].

    ``step_s`` (e.g. the running mean step time) evaluates the progress at the *expected end*
    of the step about to run, the same end-of-step convention as for steps and tokens: the
    last step that fits in the budget then gets the floor rate. The trainer stops when the
    next step would not fit (``elapsed + step_s > budget_s``); the budget should exclude
    what is spent after the loop (final evaluation, checkpoint)."""
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    return min(max((elapsed_s + step_s) / budget_s, 0.0), 1.0)


MARGIN = 1.1  # what train.max_hours keeps aside: 10% on top of the predicted step and final save


def fitted_progress(spent_s: float, budget_s: float, step_s: float, save_s: float) -> float:
    """Progress of a WSD fitted to a time budget of ``budget_s`` when the run has spent
    ``spent_s`` (across its processes): :func:`time_progress` over the budget less the final
    save, at the expected end of a step of ``step_s`` (both with :data:`MARGIN`)."""
    return time_progress(spent_s, max(budget_s - MARGIN * save_s, 1e-9), MARGIN * step_s)


def shape_after_warmup(pos: float, warmup_end: float, end: float, cfg) -> float | None:
    """Shape after warm-up, 1 (peak) to 0 (floor), at ``pos`` of a run spanning [0, ``end``];
    ``None`` in a stable phase (constant, WSD before its decay): exactly the peak.

    Unit-free (steps, or fractions of the run) so that :func:`lr_factor` and the step-based
    :func:`lr_at` share it; cosine spans [warmup_end, end], a WSD decay the final
    ``decay_fraction`` of [0, end] (never starting inside the warm-up)."""
    if cfg.schedule == "constant":
        return None
    if cfg.schedule == "cosine":
        if end <= warmup_end:
            return 0.0
        progress = min(max(pos - warmup_end, 0) / (end - warmup_end), 1.0)
        return decay_curve(progress, "cosine")
    if cfg.schedule == "wsd":
        start = max(wsd_decay_start(end, cfg.decay_fraction), warmup_end)
        if pos <= start or end <= start:
            return None
        return decay_curve((pos - start) / (end - start), cfg.decay_shape)
    raise ValueError(f"schedule {cfg.schedule!r}: choose {', '.join(SCHEDULES)}")


def blend(peak: float, min_ratio: float, shape: float | None) -> float:
    """``peak`` at shape 1, ``peak * min_ratio`` at shape 0, linear in between; ``None``
    (a stable phase) returns ``peak`` itself, not ``floor + (peak - floor)``, one rounding away."""
    if shape is None:
        return peak
    floor = peak * min_ratio
    return floor + (peak - floor) * shape


def lr_factor(progress: float, cfg, warmup_fraction: float) -> float:
    """Multiplier of the peak rate at ``progress`` in [0, 1] (clamped) of the run.

    ``cfg`` needs ``schedule``, ``min_lr_ratio`` and, for WSD, ``decay_fraction`` and
    ``decay_shape``. Warm-up: ``progress / warmup_fraction`` while below it (from ~0);
    afterwards in [min_lr_ratio, 1], exactly ``min_lr_ratio`` at progress 1 for cosine
    and WSD. For a step-driven run ``warmup_fraction = warmup_steps / total_steps``."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_fraction > 0 and progress < warmup_fraction:
        return progress / warmup_fraction
    return blend(1.0, cfg.min_lr_ratio, shape_after_warmup(progress, min(warmup_fraction, 1.0), 1.0, cfg))


class Continuation(NamedTuple):
    """The rate of a run whose length changed on resume, from step ``from_step`` (0-based,
    the first step after the checkpoint) to ``total - 1``: ``lr`` (the rate of step
    ``from_step - 1`` under the previous schedule) decaying along ``shape`` to the floor at
    the last step. Saved in checkpoints, so a later resume at the same length follows it."""

    from_step: int
    lr: float
    total: int
    shape: str  # a decay_curve shape

    def at(self, step: int, floor: float) -> float:
        """The rate of ``step`` (``>= from_step``): end-of-step convention, so the first step
        is a little below ``lr`` and the last one exactly ``floor``."""
        if self.lr <= floor:
            return self.lr  # held (the old schedule had reached its floor)
        x = (step - self.from_step + 1) / max(self.total - self.from_step, 1)
        return floor + (self.lr - floor) * decay_curve(x, self.shape)


def continue_schedule(from_step: int, total: int, previous_rate: float, new_rate: float, cfg) -> Continuation | None:
    """How the rate goes on when a run resumed at ``from_step`` steps now has ``total``:
    ``None`` when the new length's schedule gives the last step taken (``from_step - 1``)
    the same rate as before (``previous_rate == new_rate``: it joins seamlessly), else a
    :class:`Continuation` from ``previous_rate``. ``cfg``: the optimizer config
    (``schedule``, ``decay_shape``)."""
    if from_step <= 0 or previous_rate == new_rate:
        return None
    return Continuation(from_step, previous_rate, total, cfg.decay_shape if cfg.schedule == "wsd" else "cosine")


class TimeContinuation(NamedTuple):
    """:class:`Continuation` for a WSD fitted to ``train.max_hours`` whose budget changed on
    resume: from ``from_progress`` (the share of the new budget ``budget_s`` spent at the
    resume) the rate goes from ``lr`` (where the previous budget's schedule left it) along
    ``shape`` to the floor as the new budget ends -- held at ``lr`` when that is the floor
    already. Applies from step ``from_step`` on; saved in checkpoints like a Continuation."""

    from_step: int
    from_progress: float
    lr: float
    budget_s: float
    shape: str

    def at(self, progress: float, floor: float) -> float:
        """The rate at ``progress`` (the share of the budget at the end of the step)."""
        if self.lr <= floor:
            return self.lr
        x = (progress - self.from_progress) / max(1.0 - self.from_progress, 1e-9)
        return floor + (self.lr - floor) * decay_curve(x, self.shape)


def saved_continuation(saved: dict[str, Any]) -> Continuation | TimeContinuation | None:
    """The continuation a checkpoint saved (``lr_continuation``), of either kind."""
    before = saved.get("lr_continuation")
    if not isinstance(before, dict):
        return None
    return TimeContinuation(**before) if "from_progress" in before else Continuation(**before)


def accum_at(tokens_seen: int, full_accum: int, ramp_tokens: int, start_accum: int = 1) -> int:
    """Micro-batches to accumulate for the step that starts after ``tokens_seen`` tokens.

    Linear in tokens from ``start_accum`` (at 0) to ``full_accum`` (from ``ramp_tokens``
    on): each accumulation level lasts ``ramp_tokens / (full - start)`` tokens. Integer,
    non-decreasing; ``ramp_tokens <= 0`` means no ramp."""
    start = min(max(start_accum, 1), full_accum)
    if ramp_tokens <= 0 or tokens_seen >= ramp_tokens:
        return full_accum
    return start + (full_accum - start) * max(tokens_seen, 0) // ramp_tokens


class RampPlan(NamedTuple):
    """A run laid out in advance: ``steps`` optimizer steps, ``accums[i]`` micro-batches in step i."""

    steps: int
    accums: list[int]


def ramp_plan(total_tokens: int, micro_batch_tokens: int, full_accum: int, ramp_tokens: int,
              start_accum: int = 1) -> RampPlan:
    """Steps and per-step accumulation to consume ``total_tokens`` with a batch ramp.

    ``micro_batch_tokens`` is the tokens of one accumulation step across all ranks
    (micro_batch_size x seq_len x world size). The last step takes only the micro-batches
    still needed, so ``sum(accums) * micro_batch_tokens`` equals ``total_tokens`` rounded up
    to a whole micro-batch (the step's own token count must be passed to the loss). Without
    a ramp the step count equals ``ceil(total / (full_accum * micro_batch_tokens))``."""
    if micro_batch_tokens <= 0 or full_accum <= 0:
        raise ValueError("micro_batch_tokens and full_accum must be > 0")
    remaining = -(-max(total_tokens, 0) // micro_batch_tokens)  # micro-batches still to run
    accums: list[int] = []
    tokens = 0
    while remaining > 0 and 0 < ramp_tokens and tokens < ramp_tokens:
        a = min(accum_at(tokens, full_accum, ramp_tokens, start_accum), remaining)
        accums.append(a)
        remaining -= a
        tokens += a * micro_batch_tokens
    full_steps, rest = divmod(remaining, full_accum)  # after the ramp: full batches, then the rest
    accums.extend([full_accum] * full_steps)
    if rest:
        accums.append(rest)
    return RampPlan(len(accums), accums)


# ----------------------------------------------------------------------------- the rate of a step

def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warm-up from lr/warmup to lr over ``warmup_steps``, then cosine decay to
    ``lr * min_lr_ratio`` at the last step, constant at lr, or WSD: lr until the final
    ``decay_fraction`` of the steps, then ``decay_shape`` to the floor at the last step.
    The shapes are those of :func:`lr_factor`, in steps.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    # Steps 0 .. total_steps - 1; cosine spans warm-up end .. last step (at least one step).
    end = cfg.warmup_steps + max(total_steps - cfg.warmup_steps - 1, 1)
    if cfg.schedule == "wsd":
        end = max(total_steps - 1, cfg.warmup_steps)
    return blend(cfg.lr, cfg.min_lr_ratio, shape_after_warmup(step, cfg.warmup_steps, end, cfg))


def lr_for_step(step: int, total_steps: int, tokens_after: int, o: OptimConfig, max_tokens: int,
                ramp: RampPlan | None, time_used: float | None,
                cont: Continuation | TimeContinuation | None = None) -> float:
    """The learning rate of the next step: by steps (:func:`lr_at`), by tokens during a batch
    ramp (steps differ in size; ``max_tokens`` is the run's), by the share of the time budget
    used (``time_used``) for a WSD fitted to ``train.max_hours``, or along ``cont`` after a
    resume that changed the run's length or time budget (:func:`resumed_schedule`)."""
    if isinstance(cont, TimeContinuation):
        if time_used is not None and step >= cont.from_step:
            return cont.at(time_used, o.lr * o.min_lr_ratio)
    elif cont is not None and step >= cont.from_step:
        return cont.at(step, o.lr * o.min_lr_ratio)
    if time_used is not None:
        fitted = lr_factor(time_used, o, 0.0)
        if step < o.warmup_steps:  # the budget binds from the first step: a warm-up it cuts short decays too
            return o.lr * min((step + 1) / o.warmup_steps, fitted)
        return o.lr * fitted
    if ramp is not None:
        return o.lr * lr_factor(tokens_after / max_tokens, o, o.warmup_steps / max(total_steps, 1))
    return lr_at(step, total_steps, o)


def resumed_schedule(checkpoint: Path, saved: dict[str, Any], step: int, total_steps: int, cfg: RunConfig,
                     ramped: bool, budget: dict[str, float] | None = None
                     ) -> tuple[Continuation | TimeContinuation | None, str]:
    """The learning rate of a resumed run whose length (``train.max_steps``/``max_tokens``)
    may have changed since ``checkpoint`` (its own config.yaml holds the length its steps were
    taken under): ``(continuation or None, a note for the log, "" when nothing changed)``.

    An unchanged length keeps the schedule as it was (bit-identical to an uninterrupted run).
    A changed one goes on from the rate of the last step taken (:func:`continue_schedule`)
    instead of recomputing the schedule for the new length, which would move the rate
    (extending a finished cosine would raise it from its floor). A WSD fitted to
    ``train.max_hours`` follows the time the run spent instead (``budget``: what the
    checkpoint recorded, :func:`resumed_time_schedule`)."""
    o, t = cfg.optim, cfg.train
    saved_cont = saved_continuation(saved)
    try:
        old = load_run_config(checkpoint / "config.yaml")
    except (ConfigError, OSError):
        old = None
    if cfg.fits_to_time:  # progress is the share of train.max_hours used, not of the steps
        return resumed_time_schedule(old, saved_cont, step, cfg, budget or {})
    before = saved_cont if isinstance(saved_cont, Continuation) else None
    if ramped:
        if old is not None and (old.train.max_tokens, old.train.max_steps) != (t.max_tokens, t.max_steps):
            raise ConfigError([f"train.run_dir {t.run_dir!r}: a batch-ramped run's schedule follows its tokens, so "
                               f"its length cannot change on resume (train.max_tokens {old.train.max_tokens} -> "
                               f"{t.max_tokens}, train.max_steps {old.train.max_steps} -> {t.max_steps}): keep "
                               f"train.max_tokens={old.train.max_tokens} train.max_steps={old.train.max_steps}, "
                               "or pass --fresh to start over"])
        return None, ""
    old_total = before.total if before is not None else (old.total_steps() if old is not None else total_steps)
    floor = o.lr * o.min_lr_ratio
    if old_total == total_steps:
        if before is None:
            return None, ""
        return before, (f"the rate follows the continuation set at step {before.from_step:,} when the run's length "
                        f"changed: {_continuation_text(before, floor)}")

    def previous(k: int) -> float:  # the rate step k had
        return before.at(k, floor) if before is not None and k >= before.from_step else lr_at(k, old_total, o)

    last = step - 1
    prev_rate, new_rate = previous(last), lr_at(last, total_steps, o)
    cont = continue_schedule(step, total_steps, prev_rate, new_rate, o)
    change = f"length {old_total:,} -> {total_steps:,} steps"
    if cont is None:
        end = f" (its decay now ends at step {total_steps:,})" if o.schedule == "wsd" else ""
        return None, (f"{change}: step {step:,}'s rate is the same under both ({new_rate:.3g}), so the {o.schedule} "
                      f"schedule of {total_steps:,} steps goes on from there{end}")
    restart = lr_at(step, total_steps, o)
    return cont, (f"{change}: {_continuation_text(cont, floor)}, where the {old_total:,}-step schedule left it "
                  f"(recomputing the {o.schedule} schedule for {total_steps:,} steps would set {restart:.3g} "
                  f"at step {step + 1:,})")


def _continuation_text(c: Continuation, floor: float) -> str:
    if c.lr <= floor:
        return f"the rate is held at {c.lr:.3g} from step {c.from_step + 1:,} to {c.total:,}"
    return (f"the rate continues from {c.lr:.3g} at step {c.from_step:,} and decays ({c.shape}) to {floor:.3g} "
            f"at step {c.total:,}")


def duration(seconds: float) -> str:
    """A time spent, in the unit a budget of its size is thought of in."""
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


def fitted_rate(progress: float, o: OptimConfig, cont: TimeContinuation | None) -> float:
    """The rate of a WSD fitted to the time budget at ``progress`` (after its warm-up steps)."""
    return cont.at(progress, o.lr * o.min_lr_ratio) if cont is not None else o.lr * lr_factor(progress, o, 0.0)


def resumed_time_schedule(old: RunConfig | None, saved_cont: Continuation | TimeContinuation | None, step: int,
                          cfg: RunConfig, budget: dict[str, float]) -> tuple[TimeContinuation | None, str]:
    """The rate of a resumed WSD fitted to ``train.max_hours``: its progress is the share of the
    run's budget spent, which the checkpoint recorded (``budget``: :data:`stopping.BUDGET_FIELDS`), so an
    unchanged budget goes on exactly where it was. A changed one -- train.max_hours raised to
    train longer -- goes on from the rate the old budget's schedule had reached
    (:class:`TimeContinuation`), as a changed length does by steps: fitting the schedule to the
    new budget anew would put a finished decay back up to the peak."""
    o, t = cfg.optim, cfg.train
    if not budget:
        return None, ("the checkpoint records no time spent (written before flopwise kept it): the schedule fitted "
                      "to train.max_hours starts its budget over at this start")
    timed = saved_cont if isinstance(saved_cont, TimeContinuation) else None
    old_h = old.train.max_hours if old is not None and old.fits_to_time else t.max_hours
    floor = o.lr * o.min_lr_ratio
    if old_h == t.max_hours:
        if timed is None:
            return None, ""
        return timed, (f"the rate follows the continuation set at step {timed.from_step:,} when train.max_hours "
                       f"changed: {_time_continuation_text(timed, floor)}")
    spent, step_s = budget["spent_s"], budget["step_s"]
    save_s = budget["save_s"] + budget.get("stop_s", 0.0)  # what the fit keeps aside: the save, the stop's work
    change = f"train.max_hours {old_h:g} -> {t.max_hours:g} ({duration(spent)} of the run's spent)"
    if step < o.warmup_steps:  # the warm-up goes by steps: the fit starts after it
        return None, f"{change}: still warming up, so the schedule is fitted to the new budget"
    p_old = fitted_progress(spent, old_h * 3600, step_s, save_s)
    p_new = fitted_progress(spent, t.max_hours * 3600, step_s, save_s)
    prev_rate = fitted_rate(p_old, o, timed if timed is not None and timed.budget_s == old_h * 3600 else None)
    new_rate = fitted_rate(p_new, o, None)
    if prev_rate == new_rate:
        return None, (f"{change}: the rate is the same under both ({new_rate:.3g}), so the WSD fitted to the new "
                      f"budget goes on from there (its decay now starts {o.decay_fraction:.0%} before the new end)")
    cont = TimeContinuation(step, p_new, prev_rate, t.max_hours * 3600,
                            o.decay_shape if o.schedule == "wsd" else "cosine")
    return cont, (f"{change}: {_time_continuation_text(cont, floor)}, where the schedule fitted to {old_h:g} h left "
                  f"it (fitting it to {t.max_hours:g} h anew would set {new_rate:.3g} at step {step + 1:,})")


def _time_continuation_text(c: TimeContinuation, floor: float) -> str:
    if c.lr <= floor:
        return f"the rate is held at {c.lr:.3g} from step {c.from_step + 1:,} to the end of the budget"
    return (f"the rate continues from {c.lr:.3g} at step {c.from_step:,} and decays ({c.shape}) to {floor:.3g} "
            f"as the budget ends")


def extension_note(cfg: RunConfig, saved: dict[str, Any], step: int, total_steps: int) -> str:
    """What the rate does when a run whose time budget is spent gets a larger ``train.max_hours``
    (for the line that says the budget is spent)."""
    o = cfg.optim
    if not cfg.fits_to_time:
        return f"the rate goes on along the {o.schedule} schedule of {total_steps:,} steps from step {step + 1:,}"
    cont = saved_continuation(saved)
    rate = fitted_rate(1.0, o, cont if isinstance(cont, TimeContinuation) else None)
    return f"the rate is then held at {rate:.3g}, where the schedule fitted to this budget left it"
