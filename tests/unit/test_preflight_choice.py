"""Preflight's choice among its trials (issue 19): synthetic medians and spreads, no timing.

The fastest median wins only by more than the noise (the two trials' spreads added, never below
``MIN_NOISE``); within it the simpler configuration wins: no activation checkpointing, then the
smaller micro-batch."""

import pytest

from flopwise.measure.meter import spread
from flopwise.train.preflight import MIN_NOISE, Trial, choose


def trial(micro_batch, checkpointing, tok_per_s, spread=None, status="ok"):
    return Trial(micro_batch, checkpointing, status, tok_per_s=tok_per_s, spread=spread, windows=3)


def test_checkpointing_is_not_chosen_for_a_difference_within_the_noise():
    # the issue: checkpointing picked for 1.5%, and the choice flipped between runs
    trials = [trial(4, "none", 1000.0, 0.01), trial(16, "full", 1015.0, 0.01)]
    best, reason = choose(trials)
    assert (best.micro_batch, best.checkpointing) == (4, "none")
    assert "within the noise" in reason and "no activation checkpointing" in reason


def test_a_difference_beyond_the_noise_wins_even_with_checkpointing():
    trials = [trial(4, "none", 1000.0, 0.01), trial(16, "full", 1100.0, 0.01)]
    best, reason = choose(trials)
    assert (best.micro_batch, best.checkpointing) == (16, "full")
    assert reason.startswith("fastest") and "9.1% ahead of micro-batch 4 without checkpointing" in reason


def test_the_measured_spread_sets_the_noise():
    noisy = [trial(4, "none", 1000.0, 0.03), trial(8, "none", 1050.0, 0.03)]  # 4.8% apart, noise 6%
    assert choose(noisy)[0].micro_batch == 4
    quiet = [trial(4, "none", 1000.0, 0.005), trial(8, "none", 1050.0, 0.005)]  # 4.8% apart, noise 2%
    assert choose(quiet)[0].micro_batch == 8


def test_without_a_spread_the_floor_applies():
    assert choose([trial(2, "none", 1000.0), trial(8, "none", 1000.0 / (1 - MIN_NOISE / 2))])[0].micro_batch == 2
    assert choose([trial(2, "none", 1000.0), trial(8, "none", 1000.0 / (1 - 2 * MIN_NOISE))])[0].micro_batch == 8


def test_simplest_order_no_checkpointing_then_smaller_micro_batch():
    trials = [trial(16, "full", 1010.0, 0.01), trial(8, "none", 1005.0, 0.01), trial(4, "none", 1000.0, 0.01),
              trial(2, "none", 500.0, 0.01)]
    best, reason = choose(trials)
    assert (best.micro_batch, best.checkpointing) == (4, "none")
    # among checkpointed trials alone, the smaller micro-batch
    best, reason = choose([trial(16, "full", 1010.0, 0.01), trial(8, "full", 1000.0, 0.01)])
    assert best.micro_batch == 8 and "smaller micro-batch" in reason


def test_trials_that_did_not_fit_are_ignored():
    trials = [trial(16, "none", None, status="oom"), trial(32, "none", None, status="no-fit"),
              trial(8, "none", 900.0, 0.02)]
    best, reason = choose(trials)
    assert best.micro_batch == 8 and reason == "the only configuration that fits"
    with pytest.raises(ValueError):
        choose([trial(16, "none", None, status="oom")])


def test_spread_is_half_the_range_over_the_median():
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.1)
    assert spread([100.0, 100.0, 100.0, 100.0]) == 0.0
    assert spread([100.0]) is None
