"""Progress-based learning-rate schedules (cosine, constant, WSD; fitted to time) and the batch ramp."""

import dataclasses
import math
from types import SimpleNamespace

import pytest

from flopwise.config import OptimConfig
from flopwise.train.schedule import accum_at, decay_curve, lr_at, lr_factor, ramp_plan, time_progress, wsd_decay_start

# Fields the schedule reads that OptimConfig may not have yet (added alongside this module).
NEW_FIELDS = dict(name="adamw", muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.0,
                  decay_fraction=0.2, decay_shape="linear")


def ocfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{**NEW_FIELDS, **dataclasses.asdict(OptimConfig()), **kw})


def legacy_lr_at(step, total_steps, cfg):
    """lr_at as it was before WSD: the values the refactor must keep bit for bit."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 40), (10, 11), (10, 111), (20, 7)])
def test_lr_at_keeps_cosine_and_constant_bitwise(schedule, warmup, total):
    for lr, ratio in [(3e-3, 0.1), (6e-4, 0.0), (1.7e-4, 1 / 3)]:
        cfg = ocfg(lr=lr, min_lr_ratio=ratio, warmup_steps=warmup, schedule=schedule)
        assert [lr_at(s, total, cfg) for s in range(total + 2)] == [legacy_lr_at(s, total, cfg)
                                                                    for s in range(total + 2)]


def test_lr_factor_warmup_then_cosine():
    cfg = ocfg(schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0.05, cfg, 0.1) == pytest.approx(0.5)  # half-way through the warm-up
    assert lr_factor(0.1, cfg, 0.1) == pytest.approx(1.0)  # warm-up ends at the peak
    assert lr_factor(0.55, cfg, 0.1) == pytest.approx(0.55)  # cosine half-way: (1 + 0.1) / 2
    assert lr_factor(1.0, cfg, 0.1) == 0.1  # exactly the floor at the end
    assert lr_factor(1.5, cfg, 0.1) == 0.1 and lr_factor(-1.0, cfg, 0.1) == 0.0  # clamped
    assert lr_factor(0.0, cfg, 0.0) == 1.0  # no warm-up: the peak from the start


def test_lr_factor_constant():
    cfg = ocfg(schedule="constant", min_lr_ratio=0.1)
    assert lr_factor(0.02, cfg, 0.04) == pytest.approx(0.5)
    assert {lr_factor(p / 10, cfg, 0.04) for p in range(1, 11)} == {1.0}


@pytest.mark.parametrize("shape,quarter", [("linear", 0.75), ("cosine", (1 + math.cos(math.pi / 4)) / 2),
                                           ("sqrt", 0.5)])
def test_wsd_stable_then_decay_shapes(shape, quarter):
    m = 0.1
    cfg = ocfg(schedule="wsd", decay_fraction=0.2, decay_shape=shape, min_lr_ratio=m)
    assert lr_factor(0.01, cfg, 0.02) == pytest.approx(0.5)  # warm-up
    assert {lr_factor(p / 100, cfg, 0.02) for p in range(2, 81)} == {1.0}  # stable, exactly the peak
    assert lr_factor(0.8, cfg, 0.02) == 1.0  # the decay starts at 1 - decay_fraction
    assert lr_factor(0.805, cfg, 0.02) < 1.0
    assert lr_factor(0.85, cfg, 0.02) == pytest.approx(m + (1 - m) * quarter)  # a quarter into the decay
    assert lr_factor(1.0, cfg, 0.02) == m  # the floor exactly at the end
    values = [lr_factor(0.8 + i / 1000, cfg, 0.02) for i in range(201)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_decay_curves():
    for shape in ("linear", "cosine", "sqrt"):
        assert decay_curve(0.0, shape) == 1.0 and decay_curve(1.0, shape) == 0.0
    assert decay_curve(0.5, "linear") == 0.5 and decay_curve(0.5, "cosine") == pytest.approx(0.5)
    assert decay_curve(0.25, "sqrt") == 0.5  # 1 - sqrt(x): the steepest drop comes first
    with pytest.raises(ValueError):
        decay_curve(0.5, "exp")


def test_lr_at_wsd_in_steps():
    cfg = ocfg(lr=1e-3, warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    total = 101  # steps 0..100: the decay covers steps 80..100
    lrs = [lr_at(s, total, cfg) for s in range(total)]
    assert lrs[:10] == [legacy_lr_at(s, total, ocfg(lr=1e-3, warmup_steps=10)) for s in range(10)]  # same warm-up
    assert set(lrs[9:81]) == {1e-3}  # stable at the peak, exactly
    assert lrs[90] == pytest.approx(5e-4)  # linear, half-way through the decay
    assert lrs[-1] == 0.0  # the floor on the last step
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_wsd_fitted_to_a_time_budget_ends_its_decay_with_the_budget():
    m, budget, step_s = 0.1, 3600.0, 7.3
    cfg = ocfg(schedule="wsd", decay_fraction=0.25, decay_shape="linear", min_lr_ratio=m)
    assert wsd_decay_start(budget, 0.25) == 2700.0
    assert time_progress(1800, budget) == 0.5 and time_progress(4000, budget) == 1.0
    assert lr_factor(time_progress(2699, budget), cfg, 0.01) == 1.0
    assert lr_factor(time_progress(2701, budget), cfg, 0.01) < 1.0
    assert lr_factor(time_progress(budget, budget), cfg, 0.01) == m
    # A simulated loop: each step evaluated at its expected end; stop when the next would not fit.
    elapsed, factors = 0.0, []
    while elapsed + step_s <= budget:
        factors.append(lr_factor(time_progress(elapsed, budget, step_s), cfg, 0.01))
        elapsed += step_s
    assert budget - elapsed < step_s  # stopped on time
    slope = (1 - m) / (0.25 * budget)  # factor per second in the linear decay
    assert m <= factors[-1] <= m + slope * step_s + 1e-12  # the decay is finished (within one step)
    assert factors.count(1.0) == pytest.approx((2700 - 36) / step_s, abs=1)  # stable: warm-up end to decay start


def test_accum_ramp_levels():
    full, ramp = 8, 700  # 7 levels of 100 tokens each
    assert accum_at(0, full, ramp) == 1
    assert accum_at(99, full, ramp) == 1 and accum_at(100, full, ramp) == 2
    assert accum_at(699, full, ramp) == 7 and accum_at(700, full, ramp) == 8
    assert accum_at(10**9, full, ramp) == 8
    seq = [accum_at(t, full, ramp) for t in range(0, 800, 7)]
    assert seq == sorted(seq) and all(isinstance(a, int) for a in seq)
    assert accum_at(0, full, 0) == full  # no ramp
    assert accum_at(0, full, ramp, start_accum=4) == 4 and accum_at(350, full, ramp, start_accum=4) == 6
    assert accum_at(0, 2, ramp, start_accum=5) == 2  # start above full is clamped


@pytest.mark.parametrize("total", [100_000, 100_003, 640])
def test_ramp_plan_adds_up(total):
    micro, full, ramp = 64, 8, 20_000
    steps, accums = ramp_plan(total, micro, full, ramp, start_accum=2)
    assert steps == len(accums)
    assert sum(accums) * micro == -(-total // micro) * micro  # every token, rounded up to a micro-batch
    tokens = 0
    for i, a in enumerate(accums[:-1]):
        assert a == accum_at(tokens, full, ramp, 2)  # each step takes the ramp's accumulation
        tokens += a * micro
    assert 1 <= accums[-1] <= full
    if total == 100_000:
        assert accums[0] == 2 and accums[-2] == full
        assert steps < -(-total // (2 * micro))  # far fewer steps than without growing the batch


def test_ramp_plan_without_ramp_matches_fixed_batch():
    steps, accums = ramp_plan(10_000, 10, 8, 0)
    assert steps == -(-10_000 // 80) and set(accums[:-1]) == {8} and sum(accums) == 1000


def test_a_changed_length_continues_the_rate_from_where_it_was():
    from flopwise.train.schedule import continue_schedule

    cosine = SimpleNamespace(schedule="cosine", decay_shape="linear")
    assert continue_schedule(10, 20, 1e-3, 1e-3, cosine) is None  # the same rate: the new schedule joins
    held = continue_schedule(80, 100, 3e-4, 3e-4 + 1e-9, cosine)
    assert [held.at(s, 3e-4) for s in (80, 90, 99)] == [3e-4] * 3  # a finished cosine stays at its floor
    c = continue_schedule(6, 16, 2e-3, 2.5e-3, cosine)
    rates = [c.at(s, 3e-4) for s in range(6, 16)]
    assert rates[0] < 2e-3 and all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] == pytest.approx(3e-4)
    wsd = continue_schedule(6, 16, 2e-3, 2.5e-3, SimpleNamespace(schedule="wsd", decay_shape="sqrt"))
    assert wsd.shape == "sqrt" and wsd.at(15, 3e-4) == pytest.approx(3e-4)
