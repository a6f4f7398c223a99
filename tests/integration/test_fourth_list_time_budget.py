"""Issue 54 (the fourth list), item 5: "train for N minutes" is a budget of its own.

``train.max_hours`` with neither ``train.max_steps`` nor ``train.max_tokens`` was refused, and a
fake ``max_tokens`` then made the header, the progress lines, the ETA, the epochs and ``plan``
speak of that fake figure. Through the real trainer with its clock injected (``tick_clock``: 0.1 s
a reading, however loaded this machine is)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from flopwise.config import TIME_USED, build_config
from flopwise.evaluate.runner import run_finished
from flopwise.train.trainer import train

BUDGET_S = 8.0  # about a dozen steps of the tick clock, the final save kept aside
ALONE = ["train.max_steps=0", "train.max_tokens=0", f"train.max_hours={BUDGET_S / 3600}", "optim.warmup_steps=2",
         "eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.checkpoint_every=0"]


def line(lines: list[str], start: str) -> str:
    return next(x for x in lines if x.startswith(start))


def test_a_time_budget_alone_trains_until_it_is_used_and_says_so(tiny_overrides, tick_clock):
    cfg = build_config(overrides=tiny_overrides + ALONE)
    assert cfg.time_only and cfg.total_steps() == 0
    lines: list[str] = []
    result = train(cfg, clock=tick_clock, log=lines.append)
    assert result.stopped == TIME_USED and result.steps > 2, (result.stopped, result.steps)
    # the header speaks of the time, not of a step count
    flops = line(lines, "  FLOPs ")
    assert "as many steps as train.max_hours holds" in flops and "steps ×" not in flops, flops
    budget = line(lines, "  budget ")
    assert "the run's only limit" in budget, budget
    assert "cosine to" in line(lines, "  optimizer ") and "over train.max_hours" in line(lines, "  optimizer ")
    # no "step 5/0", and the ETA is the time left of the budget with the tokens it should reach
    steps = [x for x in lines if x.startswith("step ")]
    assert steps and not any("/" in x.split("|")[0] for x in steps), steps[:2]
    assert all("of training left in train.max_hours · ≈" in x and "tokens by its end at this pace" in x
               for x in steps), steps[-1]
    # its end is the run's end: done, finished, and how to extend it
    assert line(lines, "done: ").startswith(f"done: {result.steps:,} steps")
    finished = line(lines, "  finished: ")
    assert "the run's only limit, is used" in finished, finished
    assert f"train.max_hours={2 * BUDGET_S / 3600:g}` trains it longer" in finished, finished
    assert not any(x.startswith("  stop ") for x in lines), [x for x in lines if "stop" in x]
    # the schedule ended at the floor within the budget
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rates = [r["lr"] for r in rows if r.get("lr") is not None and "event" not in r]
    floor = cfg.optim.lr * cfg.optim.min_lr_ratio
    assert rates[-1] <= floor * 1.5, (rates[-1], floor)
    state = json.loads(sorted((result.run_dir / "checkpoints").glob("step-*"))[-1].joinpath("state.json").read_text())
    assert state["time_budget"]["spent_s"] <= BUDGET_S, state["time_budget"]
    assert run_finished(result.run_dir)  # what `flopwise eval --watch` waits for
    # resumed as it is, it has nothing left to train, and changes nothing
    again: list[str] = []
    second = train(build_config(overrides=tiny_overrides + ALONE), clock=tick_clock, log=again.append)
    assert second.steps == result.steps and "already used its time budget" in "\n".join(again), again[-3:]


def test_with_a_rate_to_go_by_the_header_gives_the_tokens_and_epochs_a_time_budget_reaches(tiny_overrides,
                                                                                            tick_clock):
    """With a peak (``train.peak_tflops``), the plan's rate gives the tokens the time is expected to
    reach, and the epochs of those tokens -- not of a fake max_tokens."""
    cfg = build_config(overrides=tiny_overrides + ALONE + ["train.peak_tflops=0.01", "train.max_hours=0.1"])
    lines: list[str] = []

    def log(text: str) -> None:  # the header is all this test reads: stop at the first step's line
        lines.append(text)
        if text.startswith("step "):
            raise KeyboardInterrupt

    try:
        train(cfg, clock=tick_clock, log=log)
    except KeyboardInterrupt:
        pass
    plan = json.loads((tmp_run(cfg) / "plan.json").read_text())
    rate = plan["effective_flops"] / plan["flops_per_token"]  # tokens/s at the plan's 40% of the peak
    budget = line(lines, "  budget ")
    assert "tokens expected at" in budget and "(the plan's 40% MFU)" in budget, budget
    assert math.isclose(tokens(budget.split("≈")[1]), rate * 360, rel_tol=0.01), (rate * 360, budget)
    flops = line(lines, "  FLOPs ")
    assert "as many steps as train.max_hours holds (≈" in flops, flops
    assert math.isclose(tokens(flops.split("(≈")[1]), rate * 360, rel_tol=0.01), (rate * 360, flops)
    data = line(lines, "  data ")
    assert re.search(r"\(≈\d+\.\d\d epochs\)", data), data


def tmp_run(cfg) -> Path:
    return Path(cfg.train.run_dir)


def tokens(text: str) -> float:
    """``1.63M tokens ...`` -> 1.63e6."""
    figure = re.match(r"([\d.]+)([KMG]?) tokens", text)
    assert figure, text
    return float(figure[1]) * {"K": 1e3, "M": 1e6, "G": 1e9, "": 1.0}[figure[2]]


def test_with_several_limits_the_header_says_which_is_expected_to_end_the_run(tiny_overrides, tick_clock):
    def header(extra: list[str]) -> str:
        lines: list[str] = []

        def log(text: str) -> None:
            lines.append(text)
            if text.startswith("step "):
                raise KeyboardInterrupt

        try:
            train(build_config(overrides=tiny_overrides + extra), clock=tick_clock, log=log)
        except KeyboardInterrupt:
            pass
        return line(lines, "  budget ")

    many = header(["train.max_steps=100000", "train.max_hours=0.1", "train.peak_tflops=0.01", "eval.every=0"])
    assert "with train.max_steps: at" in many and "it ends the run first, at ≈" in many, many
    few = header(["train.max_steps=3", "train.max_hours=0.1", "train.peak_tflops=0.01", "eval.every=0",
                  "train.run_dir=" + str(tiny_overrides[-1].split("=", 1)[1]) + "-few"])
    assert "so train.max_steps ends the run first" in few, few


def test_the_virtual_preflight_prices_a_time_budget_alone_as_its_hours():
    """``--rank`` of a config whose only limit is its time: the tokens that time buys at the
    choice's predicted rate, not a budget of 0 tokens."""
    from test_virtual_preflight import CAP, result, settings

    from flopwise.tune import virtual

    cfg = build_config("tiny", overrides=["train.max_steps=0", "train.max_tokens=0", "train.max_hours=2"])
    choice = virtual.choose([virtual.candidate(settings(8), result(8, 30.0, work=4), CAP)])
    b = virtual.budget(choice, cfg, 1)
    assert b["source"] == "train.max_hours" and b["hours"] == 2 and b["hours_given"], b
    rate = choice["prediction"]["tokens_per_s_per_gpu"]
    assert b["tokens"] == pytest.approx(2 * 3600 * rate, rel=1e-6), (b["tokens"], rate)
    v = {"world": 1, "gpu": "H100 SXM"}
    assert "(train.max_hours) on 1 × H100 SXM" in virtual._budget_lines(b, v)[0]
