"""Issue 45, item 4: preflight's ladder never ships a configuration its own confirmation measured
slower than where it started, and a measured ceiling below the measured throughput is measured
once more before anything is said of it. Measurements are scripted; nothing is timed.

The climb below is the one reported: ``train.compile=blocks`` kept at +17.1% over a start of
5,355 tok/s, then the confirmation measured 4,821 -- 10% below the start, far beyond the
windows' noise."""

import pytest
import yaml

from flopwise.config import build_config
from flopwise.measure.ceiling import Ceiling
from flopwise.plan.flops import flops_per_token
from flopwise.tune.ladder import climb
from flopwise.tune.preflight import preflight
from flopwise.tune.request import Bench, TuneHooks, TuneRequest

START, KEPT, CONFIRMED = 5355.0, 5355.0 * 1.171, 4821.0


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    """No end-to-end training and a CPU without native bf16: only the ladder and what follows it."""
    monkeypatch.setattr("flopwise.tune.preflight.end_to_end", lambda *a, **k: {"recompiles": [], "save_s": 0.5})
    monkeypatch.setattr("flopwise.tune.ladder.cpu_native_bf16", lambda: None)
    monkeypatch.setattr("flopwise.tune.preflight.cpu_native_bf16", lambda: None)


def row(rate: float) -> dict:
    return {"tok_per_s": rate, "tok_per_s_windows": [rate * 0.995, rate, rate * 1.005], "peak_gb": None,
            "data_share": 0.01, "first_loss": 9.0}


def blocks_then_slower(confirmed: float = CONFIRMED):
    """measure_one: the start at START, compile=blocks at KEPT when tried and ``confirmed`` when
    measured again (the confirmation), everything else no faster than the start."""
    seen: dict[str, int] = {}

    def measure_one(cfg, world=1, timeout_s=None):
        if cfg.train.compile != "blocks":
            return row(START)
        seen["blocks"] = seen.get("blocks", 0) + 1
        return row(KEPT if seen["blocks"] == 1 else confirmed)
    return measure_one


def base():
    return build_config(preset="tiny", overrides=["train.compile=off", "train.loss=chunked",
                                                  "train.micro_batch_size=16"])


def test_a_confirmation_slower_than_the_start_beyond_the_noise_falls_back_to_the_start():
    lines = []
    lad = climb(base(), blocks_then_slower(), [16], Bench(fpt=1e7),
                TuneRequest(tokens=10**6, log=lines.append))
    kept = [r for r in lad["rungs"] if r["kept"]]
    assert [(r["rung"], r["change"]) for r in kept] == [("compile", "train.compile=blocks")], lad["rungs"]
    confirm = lad["rungs"][-1]
    assert confirm["rung"] == "confirm" and confirm["status"] == "ok" and confirm["tok_per_s"] == CONFIRMED
    assert not confirm["kept"] and "falling back to the starting configuration" in confirm["why"], confirm
    assert lad["chosen"] == {}, lad["chosen"]  # compile=blocks is not shipped
    assert lad["final"]["tok_per_s"] == START  # the run is predicted from the start's rate
    assert lad["fell_back"]["to"] == "the starting configuration"
    said = [x for x in lines if "slower than the starting configuration" in x]
    assert said and "-10.0%" in said[0] and "4,821" in said[0], lines


def test_a_confirmation_within_the_noise_of_the_start_keeps_the_climb():
    """Slower than the kept rate (the winner's curse) but not beyond the noise of the start:
    no evidence against the climb, which stands."""
    lad = climb(base(), blocks_then_slower(START * 0.99), [16], Bench(fpt=1e7),
                TuneRequest(tokens=10**6, log=lambda s: None))
    assert lad["chosen"] == {"train.compile": "blocks"} and lad["rungs"][-1]["kept"]
    assert "fell_back" not in lad


def test_preflight_yaml_ships_the_start_when_the_confirmation_is_slower(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.threads=1"])
    measure_one = blocks_then_slower()

    def measure_fn(c, spec, device):
        c.train.micro_batch_size, c.train.activation_checkpointing = spec.micro_batch, spec.checkpointing
        return measure_one(c)

    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append,
                                        ladder=True), TuneHooks(measure_fn=measure_fn))
    tuned = yaml.safe_load((tmp_path / "pf" / "preflight.yaml").read_text())
    assert tuned["train"]["compile"] == "off", tuned["train"]  # not the compile=blocks that measured slower
    assert report["prediction"]["tok_per_s"] == START
    chose = next(x for x in lines if x.startswith("preflight: chose"))
    assert "starting configuration" in chose, chose


def ceilings(*flops_per_s: float):
    """measure_ceiling giving these ceilings in turn; the calls are counted in ``.calls``."""
    def measured(gemms, device, dtype, **kw):
        measured.calls += 1
        return Ceiling(flops_per_s[min(measured.calls, len(flops_per_s)) - 1], 0.01, [], str(dtype))
    measured.calls = 0
    return measured


def test_a_ceiling_below_the_measured_throughput_is_measured_again_and_the_second_one_used(
        tiny_overrides, tmp_path, monkeypatch):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.threads=1"])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    rate = 1000.0
    measured = ceilings(rate * fpt / 5.62, rate * fpt / 0.5)  # "reaches 562% of it", then a quiet 50%
    monkeypatch.setattr("flopwise.tune.preflight.measure_ceiling", measured)
    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append, remeasure_rounds=0),
                       TuneHooks(measure_fn=lambda c, s, d: row(rate)))
    assert measured.calls == 2
    c = report["ceiling"]
    assert not c["disturbed"] and c["share_of_ceiling"] == pytest.approx(0.5) and c["remeasured"], c
    assert c["first_share_of_ceiling"] == pytest.approx(5.62)
    said = [x for x in lines if "ceiling" in x]
    assert "562%" in said[0] and "measuring it again" in said[0] and "--peak-tflops" not in said[0], said
    assert "reaches 50% of it" in said[1] and "--peak-tflops" in said[1], said


def test_a_ceiling_disturbed_twice_is_flagged_and_never_offered_to_plan_with(tiny_overrides, tmp_path,
                                                                              monkeypatch):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.threads=1"])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    measured = ceilings(1000.0 * fpt / 5.62, 1000.0 * fpt / 3.0)
    monkeypatch.setattr("flopwise.tune.preflight.measure_ceiling", measured)
    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append, remeasure_rounds=0),
                       TuneHooks(measure_fn=lambda c, s, d: row(1000.0)))
    assert measured.calls == 2  # once more, not until it agrees
    c = report["ceiling"]
    assert c["disturbed"] and c["share_of_ceiling"] is None and c["share_of_ceiling_measured"] == pytest.approx(3.0)
    assert not [x for x in lines if "--peak-tflops" in x], lines
    assert any("disturbed again" in x for x in lines), lines


def test_the_report_ends_the_ladder_where_it_fell_back():
    from flopwise.report.ladder import read_ladder

    lad = climb(base(), blocks_then_slower(), [16], Bench(fpt=1e7), TuneRequest(tokens=10**6, log=lambda s: None))
    ended = read_ladder({"ladder": lad}).last_kept()
    assert ended.index == 0 and ended.tok_per_s == START  # the start, not the compile=blocks rung kept on the way
