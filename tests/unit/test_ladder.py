"""The optimization ladder's decisions, from scripted measurements (a rate and a first-step
loss per configuration): what is kept, what is not and why, where checkpointing is tried,
the time budget, fp8 -- and preflight --ladder's outputs. Nothing here is timed."""

import json

import pytest
import torch

from flopwise.config import build_config
from flopwise.train.ladder import climb, rungs
from flopwise.train.preflight import preflight

CPU = torch.device("cpu")


def scripted(rates, losses=None, oom_from=None):
    """measure_one: tok/s from the settings that differ from the start, a fixed loss, tight windows."""
    def measure_one(cfg):
        t = cfg.train
        if oom_from and t.micro_batch_size >= oom_from and t.activation_checkpointing == "none":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        key = (t.compile, t.loss, t.micro_batch_size, t.activation_checkpointing)
        rate = rates.get(key, 1000.0)
        loss = (losses or {}).get(key, 9.0)
        return {"tok_per_s": rate, "tok_per_s_windows": [rate * 0.995, rate, rate * 1.005], "peak_gb": None,
                "data_share": 0.01, "first_loss": loss}
    return measure_one


def base(overrides=()):
    return build_config(preset="tiny", overrides=["train.compile=off", "train.loss=chunked",
                                                  "train.micro_batch_size=16", *overrides])


def test_cpu_rungs_are_compile_loss_micro_batch_and_threads():
    plan = rungs(base(), CPU, [1, 2, 4, 8, 16, 32])
    assert [r[0] for r in plan] == ["compile", "loss", "micro-batch", "threads"]
    assert torch.get_num_threads() not in [o["train.threads"] for o in plan[-1][1]]  # the current count is the start


def test_a_trial_computes_with_its_threads_and_gives_them_back(tiny_overrides):
    from flopwise.train.preflight import measure

    before = torch.get_num_threads()
    seen = []
    real = torch.optim.AdamW.step

    def step(self, *a, **kw):  # the optimizer step of the trial: which thread count is it computed with
        seen.append(torch.get_num_threads())
        return real(self, *a, **kw)

    torch.optim.AdamW.step = step
    try:
        cfg = build_config(overrides=tiny_overrides + ["train.compile=off", "train.threads=1"])
        measure(cfg, 8, "none", warmup=1, steps=1, device=CPU)
    finally:
        torch.optim.AdamW.step = real
    assert seen and set(seen) == {1} and torch.get_num_threads() == before


def test_a_faster_change_is_kept_a_slower_or_noisy_one_is_not():
    rates = {("model", "chunked", 16, "none"): 1500.0,  # +50%: kept
             ("blocks", "chunked", 16, "none"): 1010.0,  # +1%: noise
             ("model", "plain", 16, "none"): 1400.0,  # slower than the kept 1500
             ("model", "chunked", 32, "none"): 1800.0}  # +20% over 1500: kept
    lines = []
    lad = climb(base(), scripted(rates), CPU, [8, 16, 32], run_tokens=10**6, fpt=1e7, peak=None,
                log=lines.append)
    kept = [(r["rung"], r["change"]) for r in lad["rungs"] if r["kept"]]
    assert kept == [("compile", "train.compile=model"), ("micro-batch", "train.micro_batch_size=32")]
    assert lad["chosen"] == {"train.compile": "model", "train.micro_batch_size": 32}
    why = {r["change"]: r["why"] for r in lad["rungs"]}
    assert "within the noise" in why["train.compile=blocks"]
    assert "slower than the best so far" in why["train.loss=plain"]
    assert lad["final"]["tok_per_s"] == 1800.0 and lad["rungs"][-1]["why"] == "every micro-batch tried fits without it"
    row = next(r for r in lad["rungs"] if r["change"] == "train.micro_batch_size=32")
    assert row["delta_prev"] == pytest.approx(0.2) and row["delta_start"] == pytest.approx(0.8)
    assert row["hours"] == pytest.approx(10**6 / 1800 / 3600)


def test_a_faster_change_that_moves_the_first_loss_is_not_the_same_training():
    rates = {("model", "chunked", 16, "none"): 2000.0}
    losses = {("model", "chunked", 16, "none"): 9.05}  # 5.6e-3 relative: beyond 1e-3
    lad = climb(base(), scripted(rates, losses), CPU, [16], run_tokens=10**6, fpt=1e7, peak=None, log=lambda s: None)
    row = next(r for r in lad["rungs"] if r["change"] == "train.compile=model")
    assert not row["kept"] and "first-step loss moved" in row["why"]


def test_checkpointing_is_tried_only_for_micro_batches_that_do_not_fit_without():
    rates = {(  "off", "chunked", 64, "selective"): 1300.0, ("off", "chunked", 64, "full"): 1200.0}
    lad = climb(base(["train.global_batch_size=64"]), scripted(rates, oom_from=32), CPU, [16, 32, 64],
                run_tokens=10**6, fpt=1e7, peak=None, log=lambda s: None)
    status = {r["change"]: (r["status"], r["kept"]) for r in lad["rungs"]}
    assert status["train.micro_batch_size=32"] == ("oom", False)
    assert status["train.micro_batch_size=64 train.activation_checkpointing=selective"] == ("ok", True)
    assert lad["chosen"]["train.activation_checkpointing"] == "selective"
    assert [r["rung"] for r in lad["rungs"]].count("checkpointing") == 4  # 32 and 64, selective and full


def test_the_time_budget_stops_the_climb_and_says_so():
    now = {"t": 0.0}

    def measure_one(cfg):  # every measurement takes 60 s of the budget
        now["t"] += 60
        return scripted({})(cfg)

    lad = climb(base(), measure_one, CPU, [8, 16, 32], run_tokens=10**6, fpt=1e7, peak=None, budget_s=200,
                clock=lambda: now["t"], log=lambda s: None)
    skipped = [r for r in lad["rungs"] if r["why"] == "the time budget is spent"]
    measured = [r for r in lad["rungs"] if r["status"] == "ok"]
    assert len(measured) == 2 and skipped  # 2 x 60 s of warm-up + start, then 2 options fit the 200 s


def test_preflight_ladder_writes_the_ladder_and_the_tuned_config(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.loss=chunked"])

    def measure_fn(c, micro_batch, checkpointing, warmup, steps, device):
        c.train.micro_batch_size, c.train.activation_checkpointing = micro_batch, checkpointing
        return scripted({("off", "plain", 8, "none"): 3000.0})(c)

    lines = []
    report = preflight(cfg, out_dir=tmp_path / "pf", measure_fn=measure_fn, log=lines.append, ladder=True)
    assert report["ladder"]["chosen"] == {"train.loss": "plain"}
    assert report["prediction"]["tok_per_s"] == 3000.0 and report["choice_reason"] == "the ladder's last kept rung"
    saved = json.loads((tmp_path / "pf" / "preflight.json").read_text())
    assert saved["ladder"]["rungs"] and saved["ladder"]["start"]["settings"]["train.loss"] == "chunked"
    tuned = build_config(config_file=str(tmp_path / "pf" / "preflight.yaml"))
    assert tuned.train.loss == "plain" and tuned.train.micro_batch_size == 8
    assert any(line.startswith("ladder: loss") and "kept" in line for line in lines)
