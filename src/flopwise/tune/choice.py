"""The one rule that picks among timed configurations, and the one micro-batch search that
applies it, for preflight's micro-batch search and the ladder's micro-batch and checkpointing
rungs alike (``tune/preflight.py``, ``tune/ladder.py``).

A :class:`Trial` is one configuration's timing: the median of its windows' tokens/s and that
median's noise (:func:`median_spread`). :func:`choose` takes the fastest when it leads every
other by more than the noise; among those still within it, one without activation
checkpointing first, then on a GPU the larger micro-batch, on a CPU the faster median.
:func:`tied` says which are within the noise (the search re-measures them before choosing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from flopwise.measure.meter import MIN_NOISE, median

SPREAD_COVERAGE = 0.75  # the median interval's coverage: that of three windows' whole range


@dataclass
class Trial:
    micro_batch: int
    checkpointing: str
    status: str  # ok | oom | no-fit (planner) | error
    tok_per_s: float | None = None  # median over the timed windows
    spread: float | None = None  # the median's noise: median_spread of the windows' tok/s
    windows: int = 0  # timed steps, re-measures included
    mfu: float | None = None
    peak_gb: float | None = None
    predicted_gb: float | None = None
    data_share: float | None = None
    note: str = ""
    rates: list[float] = field(default_factory=list)  # every timed window's tok/s, re-measures included
    rounds: int = 0  # re-measure rounds it took part in
    seconds: float = 0.0  # wall time of its measurements (warm-up and compile included)


def label(t: Trial) -> str:
    return f"micro-batch {t.micro_batch} {'with' if t.checkpointing != 'none' else 'without'} checkpointing"


def short(t: Trial) -> str:
    return f"micro-batch {t.micro_batch}" + (" (checkpointed)" if t.checkpointing != "none" else "")


def median_spread(rates: list[float]) -> float | None:
    """The noise of the median of ``rates``: half the width of its distribution-free interval,
    from the k-th smallest to the k-th largest rate with k as large as keeps the coverage at
    least ``SPREAD_COVERAGE`` (that of three rates' whole range), as a share of the median.
    Up to five rates it is half the range; with more it narrows as the median's uncertainty
    does (six rates: the 2nd to the 5th; twelve: the 4th to the 9th), where half the range
    would only widen with every window added and re-measuring could never separate two trials.
    The one spread of a timing: the search's trials and the ladder's rows alike (the noise that
    decides "within the noise" is that of the medians compared, not of single windows)."""
    n = len(rates)
    if n < 2:
        return None
    s, k = sorted(rates), 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n >= SPREAD_COVERAGE:
        k += 1
    return (s[n - k] - s[k - 1]) / 2 / median(s)


def noise(fastest: Trial, t: Trial, min_noise: float) -> float:
    """The noise between two trials, as a share of the fastest median: their spreads added
    (their intervals overlap), never less than ``min_noise``."""
    return max(min_noise, (fastest.spread or 0.0) + (t.spread or 0.0))


def fitting(trials: list[Trial]) -> list[Trial]:
    return [t for t in trials if t.status == "ok" and t.tok_per_s]


def rate(t: Trial) -> float:
    """A fitting trial's median tokens/s (:func:`fitting` keeps only trials that have one)."""
    assert t.tok_per_s is not None, f"{label(t)} has no rate: not a fitting trial"
    return t.tok_per_s


def tied(trials: list[Trial], min_noise: float = MIN_NOISE) -> list[Trial]:
    """The trials that fit whose median is within the noise of the fastest's (the fastest
    among them), in the search's order."""
    ok = fitting(trials)
    if not ok:
        return []
    fastest = max(ok, key=rate)
    return [t for t in ok if rate(fastest) - rate(t) <= noise(fastest, t, min_noise) * rate(fastest)]


def choose(trials: list[Trial], device_type: str = "cpu", min_noise: float = MIN_NOISE) -> tuple[Trial, str]:
    """The trial to run and why, from the trials' medians and spreads alone (pure: no timing).

    The fastest median wins when it leads every other trial by more than the noise
    (:func:`noise`). Among those still within it (after :func:`remeasure`), a configuration
    without activation checkpointing wins first (it does not recompute the forward pass, and is
    one thing fewer that can go wrong); then, on a GPU (any device but the CPU), the larger
    micro-batch (fewer, larger kernels keep the device busier; the global batch, hence the
    optimisation, is the same), and on a CPU the faster median. The choice is always within
    the noise of the fastest."""
    ok = fitting(trials)
    if not ok:
        raise ValueError("no trial fits")
    fastest = max(ok, key=rate)
    group = tied(trials, min_noise)
    gpu = device_type != "cpu"
    best = min(group, key=lambda t: (t.checkpointing != "none", -t.micro_batch if gpu else 0, -rate(t)))
    rounds = max(t.rounds for t in ok)
    after = f" after {rounds} re-measure round{'s' if rounds != 1 else ''}" if rounds else ""
    if len(ok) == 1:
        return best, "the only configuration that fits"
    if len(group) == 1:
        runner = max((t for t in ok if t is not fastest), key=rate)
        return best, (f"fastest{after}: {1 - rate(runner) / rate(fastest):.1%} ahead of {label(runner)} "
                      f"(noise {noise(fastest, runner, min_noise):.1%})")
    rule = "the larger micro-batch (on a GPU: fewer, larger kernels)" if gpu else "the faster median (on a CPU)"
    others = [t for t in group if t is not best]
    steps = []  # the rules that decided it, in their order
    if best.checkpointing == "none" and any(t.checkpointing != "none" for t in others):
        steps.append("no activation checkpointing")
    if any((t.checkpointing == "none") == (best.checkpointing == "none") for t in others):
        steps.append(rule)
    why = ", then ".join(steps)
    if best is fastest:
        runner = max(others, key=rate)
        gap = 1 - rate(runner) / rate(fastest)
        return best, (f"fastest, but {label(runner)} is within the noise ({gap:.1%} slower, noise "
                      f"{noise(fastest, runner, min_noise):.1%}){after}: a tie goes to {why}")
    return best, (f"within the noise of the fastest ({label(fastest)}, {1 - rate(best) / rate(fastest):.1%}"
                  f" faster, noise {noise(fastest, best, min_noise):.1%}){after}: a tie goes to {why}")


MeasureSize = Callable[[int, str], Trial]  # a micro-batch at a checkpointing mode timed, or why not (its status)
Decided = Callable[[Trial, bool, str], None]  # a size's trial, whether it is now the best, and why


def search(start: Trial, sizes: list[int], measure: MeasureSize, decided: Decided, device_type: str = "cpu",
           modes: tuple[str, ...] = ("full",)) -> tuple[Trial | None, list[int]]:
    """The one micro-batch search, from ``start`` (already timed, at its own checkpointing)
    outward through ``sizes``: the larger ones first (ascending), then the smaller (descending).
    Tokens/s rises with the micro-batch to a peak and then falls or runs out of memory, so a
    direction stops at its first size that is slower than the best so far by more than the noise
    (:func:`noise`: one slow window of a noisy timing does not end it) or fails, and going
    up at its first that does not fit (an out-of-memory or the planner's no: a larger one would
    not fit either; going down a smaller one may); the sizes left in it are not measured (a
    "skipped" trial saying why). Then activation checkpointing,
    each of ``modes`` in turn, for the sizes larger than the best that did not fit without it,
    smallest first, while a size's checkpointed trial becomes the best: recomputing the forward
    costs about a third of a step, and a size it does not pay for leaves the larger ones further
    behind. Each trial becomes the best by :func:`choose` between it and the best so far (the
    tie rule); ``measure(size, mode)`` times one (status "ok" only where it may be chosen),
    ``decided(trial, best_now, why)`` hears of every size, measured or skipped, in order.
    Returns the best (None when nothing fitted) and the sizes checkpointing was for."""
    best = start if start.status == "ok" else None
    mode, too_big = start.checkpointing, [] if best else [start.micro_batch]
    no_fit = f"micro-batch {start.micro_batch} did not fit: a larger one would not either"
    start_too_big = start.status in ("oom", "no-fit")
    for direction, (stop, past_fit) in ((sorted(b for b in sizes if b > start.micro_batch),
                                         (no_fit, True) if start_too_big else ("", False)),
                                        (sorted((b for b in sizes if b < start.micro_batch), reverse=True),
                                         ("", False))):
        for b in direction:
            if stop:
                decided(Trial(b, mode, "skipped", note=stop), False, stop)
                too_big += [b] if past_fit else []
                continue
            before = best
            t = measure(b, mode)
            best, why = _better(best, t, device_type)
            decided(t, best is t, why)
            if t.status in ("oom", "no-fit"):  # going down, a smaller one may still fit
                too_big.append(b)
                if b > start.micro_batch:
                    stop, past_fit = f"micro-batch {b} did not fit: a larger one would not either", True
            elif t.status != "ok":
                stop = t.note if t.status == "skipped" else f"micro-batch {b} failed"
            elif before is not None and rate(before) - rate(t) > noise(before, t, MIN_NOISE) * rate(before):
                stop = f"micro-batch {b} was slower: tokens/s falls past the fastest size"
    bigger = sorted(b for b in set(too_big) if b > (best.micro_batch if best else 0))
    for b in bigger:
        won = False
        for m in (x for x in modes if x != mode):
            t = measure(b, m)
            best, why = _better(best, t, device_type)
            decided(t, best is t, why)
            won = won or best is t
        if not won:
            break
    return best, bigger


def _better(best: Trial | None, t: Trial, device_type: str) -> tuple[Trial | None, str]:
    """The best of ``best`` and the new trial ``t`` by :func:`choose`, and why (a trial that
    cannot be chosen: its note)."""
    if t.status != "ok" or not t.tok_per_s:
        return best, t.note
    if best is None:
        return t, "the first size that fits"
    return choose([best, t], device_type)

