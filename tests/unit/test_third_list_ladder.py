"""Issue 44, item 17: what preflight predicts after the ladder. A scale-out to N ranks that was
not measured (skipped for the budget, or failed) gives no N-rank launch and no N-rank
prediction, and says so; one that was measured is predicted with every device's hours and its
share of the ceiling per device; a share of the measured ceiling above 100% is a disturbed
measurement, flagged, never printed as a result. Measurements are scripted; nothing is timed."""

import pytest
import torch

from flopwise.config import build_config
from flopwise.measure.ceiling import Ceiling
from flopwise.plan.flops import flops_per_token
from flopwise.tune.preflight import preflight
from flopwise.tune.request import TuneHooks, TuneRequest
from flopwise.tune.trial import TrialError

ONE_RANK = 1000.0  # tok/s of every one-rank trial below
TWO_RANKS = 1600.0  # ... and of the two-rank launch: 80% scaling efficiency


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    """No end-to-end training and a CPU without native bf16: only the ladder and what follows it."""
    monkeypatch.setattr("flopwise.tune.preflight.end_to_end", lambda *a: {"recompiles": [], "save_s": 0.5})
    monkeypatch.setattr("flopwise.tune.ladder.cpu_native_bf16", lambda: None)
    monkeypatch.setattr("flopwise.tune.preflight.cpu_native_bf16", lambda: None)


def ceiling_at(flops_per_s: float):
    def fixed(gemms, device, dtype, **kw):
        return Ceiling(flops_per_s, 0.01, [], str(dtype))
    return fixed


def result(rate: float, world: int = 1) -> dict:
    return {"tok_per_s": rate, "tok_per_s_windows": [rate * 0.995, rate, rate * 1.005], "peak_gb": None,
            "data_share": 0.01, "first_loss": 9.0, "world": world, "strategy": "ddp" if world > 1 else "single"}


def config(tiny_overrides):
    return build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.threads=1"])


@pytest.mark.parametrize("how", ["skipped", "failed"])
def test_a_scale_out_not_measured_gives_no_n_rank_launch_nor_its_prediction(tiny_overrides, tmp_path, monkeypatch,
                                                                           how):
    monkeypatch.setattr("flopwise.tune.preflight.measure_ceiling", ceiling_at(1e12))
    now = {"t": 0.0}

    def here(cfg, spec, device):
        now["t"] += 100 if how == "skipped" else 0  # a trial longer than the whole budget: the scale-out is skipped
        return result(ONE_RANK)

    def spawned(cfg, spec, device, world=1, timeout_s=None):
        raise TrialError("a trial process died: exit code -9")

    lines = []
    report = preflight(config(tiny_overrides), TuneRequest(
        out_dir=tmp_path / "pf", log=lines.append, ladder=True, world=2,
        budget_minutes=1, price_per_gpu_hour=3.0), TuneHooks(measure_fn=here, spawn_fn=spawned, clock=lambda: now["t"]))
    lad = report["ladder"]
    ranks = next(r for r in lad["rungs"] if r["rung"] == "ranks")
    assert ranks["status"] == ("skipped" if how == "skipped" else "error") and not ranks["kept"]
    assert lad["world"] == 1 and lad["world_asked"] == 2, lad  # the launch measured is one rank's
    assert not [x for x in lines if "torchrun" in x], lines  # no N-rank launch was measured: none is written
    assert "(flopwise train --config" in lines[-1]
    said = [x for x in lines if "2-rank launch was not measured" in x]
    assert len(said) == 1 and f"ranks {ranks['status']}" in said[0], lines
    p = report["prediction"]
    assert p["world"] == 1 and p["tok_per_s"] == ONE_RANK and p["cost"] == pytest.approx(p["hours"] * 3.0)


def test_a_measured_scale_out_is_predicted_with_every_devices_hours_and_a_per_device_ceiling(tiny_overrides,
                                                                                             tmp_path, monkeypatch):
    cfg = config(tiny_overrides)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    monkeypatch.setattr("flopwise.tune.preflight.measure_ceiling", ceiling_at(TWO_RANKS * fpt))  # 2x one device's

    def spawned(cfg, spec, device, world=1, timeout_s=None):
        return result(TWO_RANKS if world == 2 else ONE_RANK, world)

    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append, ladder=True, world=2,
                                        price_per_gpu_hour=3.0),
                       TuneHooks(measure_fn=lambda c, s, d: result(ONE_RANK), spawn_fn=spawned))
    assert report["ladder"]["world"] == 2
    p = report["prediction"]
    assert p["world"] == 2 and p["tok_per_s"] == TWO_RANKS
    assert p["cost"] == pytest.approx(p["hours"] * 3.0 * 2)  # two GPUs' hours
    c = report["ceiling"]  # one device's GEMM ceiling against one device's share of the 2-rank rate
    assert c["share_of_ceiling"] == pytest.approx(0.5) and not c.get("disturbed")
    assert any("reaches 50% of it" in x for x in lines), lines


def test_a_share_of_the_measured_ceiling_above_100_percent_is_flagged_not_reported(tiny_overrides, tmp_path,
                                                                                   monkeypatch):
    cfg = config(tiny_overrides)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    rate = 500.0
    monkeypatch.setattr("flopwise.tune.preflight.measure_ceiling", ceiling_at(rate * fpt / 23.48))  # a disturbed one
    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append, remeasure_rounds=0),
                       TuneHooks(measure_fn=lambda c, s, d: result(rate)))
    c = report["ceiling"]
    assert c["share_of_ceiling"] is None and c["disturbed"], c  # no result
    assert c["share_of_ceiling_measured"] == pytest.approx(23.48)  # kept, as what was seen
    line = next(x for x in lines if x.startswith("preflight: measured ceiling"))
    assert "reaches 2348%" not in line and "2348%" in line and "disturbed" in line, line
    assert "flopwise plan --peak-tflops" not in line, line  # a disturbed ceiling is nothing to plan with


def test_the_ceiling_is_measured_in_the_runs_dtype_on_the_chosen_micro_batch(tiny_overrides, tmp_path, monkeypatch):
    """The ordinary case stays as it was: a share under 100% is the result."""
    cfg = config(tiny_overrides)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    seen = {}

    def fixed(gemms, device, dtype, **kw):
        seen.update(device=device, dtype=dtype)
        return Ceiling(1000.0 * fpt / 0.68, 0.01, [], str(dtype))

    monkeypatch.setattr("flopwise.tune.preflight.measure_ceiling", fixed)
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lambda s: None, remeasure_rounds=0),
                       TuneHooks(measure_fn=lambda c, s, d: result(1000.0)))
    assert report["ceiling"]["share_of_ceiling"] == pytest.approx(0.68) and not report["ceiling"].get("disturbed")
    assert seen["device"] == torch.device("cpu")
