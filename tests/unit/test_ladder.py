"""The optimization ladder's decisions, from scripted measurements (a rate and a first-step
loss per configuration): what is kept, what is not and why, where checkpointing is tried,
the time budget, fp8 -- and preflight --ladder's outputs. Nothing here is timed."""

import json

import pytest
import torch

from flopwise.config import build_config
from flopwise.tune.ladder import climb, rungs
from flopwise.tune.preflight import preflight
from flopwise.tune.request import Bench, TuneHooks, TuneRequest
from flopwise.tune.trial import TrialSpec

CPU = torch.device("cpu")
N_RANK_RUNGS = ("ranks", "strategy", "buckets")


@pytest.fixture(autouse=True)
def _cpu_without_native_bf16(monkeypatch):
    """The rungs of a CPU without AMX / AVX-512 BF16 (the tests that want them say so): the
    climbs below are the same on every machine."""
    monkeypatch.setattr("flopwise.tune.ladder.cpu_native_bf16", lambda: None)


def scripted(rates, losses=None, oom_from=None, extra=None):
    """measure_one: tok/s from the settings that differ from the start, a fixed loss, tight windows.
    ``extra(cfg, world)``, when given, multiplies the rate (the loader and N-rank rungs)."""
    def measure_one(cfg, world=1, timeout_s=None):
        t = cfg.train
        if oom_from and t.micro_batch_size >= oom_from and t.activation_checkpointing == "none":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        key = (t.compile, t.loss, t.micro_batch_size, t.activation_checkpointing)
        rate = rates.get(key, 1000.0) * (extra(cfg, world) if extra else 1.0)
        loss = (losses or {}).get(key, 9.0)
        return {"tok_per_s": rate, "tok_per_s_windows": [rate * 0.995, rate, rate * 1.005], "peak_gb": None,
                "data_share": 0.01, "first_loss": loss, "world": world,
                "strategy": "single" if world == 1 else ("ddp" if cfg.parallel.strategy == "auto"
                                                         else cfg.parallel.strategy)}
    return measure_one


def base(overrides=()):
    return build_config(preset="tiny", overrides=["train.compile=off", "train.loss=chunked",
                                                  "train.micro_batch_size=16", *overrides])


def bench(device=CPU, **kw):
    """Where these climbs run: a model of 1e7 FLOPs a token; no peak or memory limit unless given."""
    return Bench(device, fpt=1e7, **kw)


def ask(**kw):
    """What these climbs are asked: a run of a million tokens, quiet unless given a log."""
    return TuneRequest(**{"tokens": 10**6, "log": lambda s: None, **kw})


def test_cpu_rungs_are_compile_loss_micro_batch_checkpointing_loader_and_threads(monkeypatch):
    plan = rungs(base(), CPU, [1, 2, 4, 8, 16, 32])
    assert [r[0] for r in plan] == ["compile", "loss", "micro-batch", "checkpointing", "loader", "threads"]
    assert plan[4][1] == [{"data.prefetch": 1}, {"data.prefetch": 2}]  # no pinning on a CPU
    assert torch.get_num_threads() not in [o["train.threads"] for o in plan[-1][1]]  # the current count is the start


@pytest.mark.parametrize("native", ["AMX", "AVX-512 BF16"])
def test_a_cpu_with_native_bf16_gets_a_bf16_rung_that_changes_numerics(monkeypatch, native):
    monkeypatch.setattr("flopwise.tune.ladder.cpu_native_bf16", lambda: native)
    plan = rungs(base(["train.precision=float32"]), CPU, [1, 2, 4, 8, 16, 32])
    assert plan[0] == ("precision", [{"train.precision": "bf16"}], "changed")
    assert [r[0] for r in rungs(base(["train.precision=bf16"]), CPU, [16])][0] == "compile"  # already there


def test_the_bf16_rung_is_kept_when_faster_within_changed_numerics(monkeypatch):
    """bf16 changes the first loss on purpose: kept within CHANGED_NUMERICS, refused past it."""
    monkeypatch.setattr("flopwise.tune.ladder.cpu_native_bf16", lambda: "AMX")

    def measure(loss_bf16):
        inner = scripted({})

        def measure_one(cfg, world=1, timeout_s=None):
            m = inner(cfg, world, timeout_s)
            if cfg.train.precision == "bf16":
                m = {**m, "tok_per_s": 2000.0, "tok_per_s_windows": [1990.0, 2000.0, 2010.0], "first_loss": loss_bf16}
            return m
        return measure_one

    kept = climb(base(["train.precision=float32"]), measure(9.05), [16], bench(), ask(budget_minutes=1e9 / 60))
    row = next(r for r in kept["rungs"] if r["rung"] == "precision")
    assert row["kept"], row
    refused = climb(base(["train.precision=float32"]), measure(9.5), [16], bench(), ask(budget_minutes=1e9 / 60))
    row = next(r for r in refused["rungs"] if r["rung"] == "precision")
    assert not row["kept"] and "loss" in row["why"], row


def test_native_bf16_detection_asks_torch(monkeypatch):
    from flopwise.train import precision

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert precision.cpu_native_bf16() == "AVX-512 BF16"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert precision.cpu_native_bf16() is None


def test_a_trial_computes_with_its_threads_and_gives_them_back(tiny_overrides):
    from flopwise.tune.trial import measure

    before = torch.get_num_threads()
    seen = []
    real = torch.optim.AdamW.step

    def step(self, *a, **kw):  # the optimizer step of the trial: which thread count is it computed with
        seen.append(torch.get_num_threads())
        return real(self, *a, **kw)

    torch.optim.AdamW.step = step
    try:
        cfg = build_config(overrides=tiny_overrides + ["train.compile=off", "train.threads=1"])
        measure(cfg, TrialSpec(8, "none", warmup=1, steps=1), CPU)
    finally:
        torch.optim.AdamW.step = real
    assert seen and set(seen) == {1} and torch.get_num_threads() == before


def test_a_faster_change_is_kept_a_slower_or_noisy_one_is_not():
    rates = {("model", "chunked", 16, "none"): 1500.0,  # +50%: kept
             ("blocks", "chunked", 16, "none"): 1010.0,  # +1%: noise
             ("model", "plain", 16, "none"): 1400.0,  # slower than the kept 1500
             ("model", "chunked", 32, "none"): 1800.0}  # +20% over 1500: kept
    lines = []
    lad = climb(base(), scripted(rates), [8, 16, 32], bench(), ask(log=lines.append))
    kept = [(r["rung"], r["change"]) for r in lad["rungs"] if r["kept"]]
    assert kept == [("compile", "train.compile=model"), ("micro-batch", "train.micro_batch_size=32"),
                    ("confirm", "-")]  # the climbed configuration, measured once more
    assert lad["chosen"] == {"train.compile": "model", "train.micro_batch_size": 32}
    why = {r["change"]: r["why"] for r in lad["rungs"]}
    assert "within the noise" in why["train.compile=blocks"]
    assert "slower than the best so far" in why["train.loss=plain"]
    ckpt = next(r for r in lad["rungs"] if r["rung"] == "checkpointing")
    assert lad["final"]["tok_per_s"] == 1800.0 and ckpt["why"] == "every micro-batch tried fits without it"
    row = next(r for r in lad["rungs"] if r["change"] == "train.micro_batch_size=32")
    assert row["delta_prev"] == pytest.approx(0.2) and row["delta_start"] == pytest.approx(0.8)
    assert row["hours"] == pytest.approx(10**6 / 1800 / 3600)


def test_a_faster_change_that_moves_the_first_loss_is_not_the_same_training():
    rates = {("model", "chunked", 16, "none"): 2000.0}
    losses = {("model", "chunked", 16, "none"): 9.05}  # 5.6e-3 relative: beyond 1e-3
    lad = climb(base(), scripted(rates, losses), [16], bench(), ask())
    row = next(r for r in lad["rungs"] if r["change"] == "train.compile=model")
    assert not row["kept"] and "first-step loss moved" in row["why"]


def test_checkpointing_is_tried_only_for_micro_batches_that_do_not_fit_without():
    rates = {("off", "chunked", 32, "selective"): 1200.0, ("off", "chunked", 32, "full"): 1100.0,
             ("off", "chunked", 64, "selective"): 1300.0, ("off", "chunked", 64, "full"): 1250.0}
    measured = []

    def measure_one(cfg, world=1, timeout_s=None):
        measured.append((cfg.train.micro_batch_size, cfg.train.activation_checkpointing))
        return scripted(rates, oom_from=32)(cfg)

    lad = climb(base(["train.global_batch_size=64"]), measure_one, [16, 32, 64], bench(), ask())
    status = {r["change"]: (r["status"], r["kept"]) for r in lad["rungs"]}
    assert status["train.micro_batch_size=32"] == ("oom", False)
    assert status["train.micro_batch_size=64"] == ("skipped", False)  # 32 did not fit: 64 is not run
    assert (64, "none") not in measured
    assert status["train.micro_batch_size=32 train.activation_checkpointing=selective"] == ("ok", True)
    assert status["train.micro_batch_size=64 train.activation_checkpointing=selective"] == ("ok", True)  # +8%
    assert lad["chosen"] == {"train.micro_batch_size": 64, "train.activation_checkpointing": "selective"}
    assert [r["rung"] for r in lad["rungs"]].count("checkpointing") == 4  # 32 and 64, selective and full


def test_checkpointing_stops_at_the_first_size_it_does_not_pay_for():
    rates = {("off", "chunked", 32, "selective"): 900.0, ("off", "chunked", 32, "full"): 800.0,
             ("off", "chunked", 64, "selective"): 5000.0}  # never reached
    lad = climb(base(["train.global_batch_size=64"]), scripted(rates, oom_from=32), [16, 32, 64], bench(), ask())
    ckpt = [r["change"] for r in lad["rungs"] if r["rung"] == "checkpointing"]
    assert ckpt == ["train.micro_batch_size=32 train.activation_checkpointing=selective",
                    "train.micro_batch_size=32 train.activation_checkpointing=full"]
    assert lad["chosen"] == {}


def test_the_micro_batch_rung_goes_outward_and_stops_past_the_fastest_size():
    rates = {("off", "chunked", 32, "none"): 1200.0,  # kept
             ("off", "chunked", 64, "none"): 1100.0,  # slower: 128 is not run
             ("off", "chunked", 8, "none"): 900.0}  # slower: 4, 2, 1 are not run
    measured = []

    def measure_one(cfg, world=1, timeout_s=None):
        measured.append(cfg.train.micro_batch_size)
        return scripted(rates)(cfg)

    lad = climb(base(["train.global_batch_size=128"]), measure_one, [1, 2, 4, 8, 16, 32, 64, 128], bench(), ask())
    rows = [(r["change"].split("=")[1], r["status"], r["kept"]) for r in lad["rungs"] if r["rung"] == "micro-batch"]
    assert rows == [("32", "ok", True), ("64", "ok", False), ("128", "skipped", False),
                    ("8", "ok", False), ("4", "skipped", False), ("2", "skipped", False), ("1", "skipped", False)]
    assert sorted(set(measured) - {16}) == [8, 32, 64]
    why = {r["change"]: r["why"] for r in lad["rungs"]}
    assert why["train.micro_batch_size=128"] == "micro-batch 64 was slower: tokens/s falls past the fastest size"


@pytest.mark.parametrize("device, kept", [("cpu", "32"), ("cuda", "32"), ("cpu-slower", None), ("cuda-smaller", "16")])
def test_the_micro_batch_rung_decides_a_tie_by_the_searchs_rule(monkeypatch, device, kept):
    """One rule for both micro-batch searches (tune/choice.py): within the noise the ladder's
    rung keeps, as the search would choose, on a CPU the faster median and on a GPU the larger
    micro-batch -- and the search's choose() between the same two trials agrees with the row."""
    from flopwise.tune.choice import Trial, choose

    monkeypatch.setattr("flopwise.tune.ladder.planned_gb", lambda cfg, dev: 0.0)
    rate32 = {"cpu": 1005.0, "cuda": 1005.0, "cpu-slower": 995.0, "cuda-smaller": 995.0}[device]
    dev = torch.device("cuda" if device.startswith("cuda") else "cpu")
    rates = {("off", "chunked", 32, "none"): rate32, ("off", "chunked", 64, "none"): 500.0,
             ("off", "chunked", 8, "none"): 500.0}
    if device == "cuda-smaller":  # the larger size is the current one: a smaller one within the noise is not kept
        rates = {("off", "chunked", 32, "none"): 500.0, ("off", "chunked", 8, "none"): 1005.0}
    lad = climb(base(["train.global_batch_size=128"]), scripted(rates), [8, 16, 32, 64],
                bench(device=dev, fresh=True), ask())
    rows = {r["change"].split("=")[1]: r for r in lad["rungs"] if r["rung"] == "micro-batch" and r["status"] == "ok"}
    got = [b for b, r in rows.items() if r["kept"]]
    assert got == ([kept] if kept and kept != "16" else []), {b: r["why"] for b, r in rows.items()}
    for b, r in rows.items():  # the row's verdict is choose()'s between the start and that size
        start = Trial(16, "none", "ok", tok_per_s=1000.0, spread=lad["start"]["spread"])
        size = Trial(int(b), "none", "ok", tok_per_s=r["tok_per_s"], spread=r["spread"])
        assert (choose([start, size], dev.type)[0] is size) == r["kept"], (b, r["why"])


def test_an_option_the_memory_model_says_cannot_fit_is_not_run():
    measured = []

    def measure_one(cfg, world=1, timeout_s=None):
        measured.append((cfg.train.micro_batch_size, cfg.train.activation_checkpointing))
        return scripted({}, extra=lambda c, w: 1 + c.train.micro_batch_size / 100)(cfg)  # larger is faster

    # planned peak (tiny preset): 32 -> 0.25 GiB, 64 -> 0.43 GiB (0.16 with checkpointing); 90% of 0.4 GiB is 0.36
    lad = climb(base(["train.global_batch_size=128"]), measure_one, [16, 32, 64, 128], bench(memory_gb=0.4), ask())
    row = next(r for r in lad["rungs"] if r["change"] == "train.micro_batch_size=64")
    assert row["status"] == "no-fit" and row["why"].startswith("planner: 0.43 GiB > 90% of 0.4 GiB"), row["why"]
    assert (64, "none") not in measured and (128, "none") not in measured
    assert any(b == 64 and ckpt != "none" for b, ckpt in measured)  # where checkpointing makes it fit, it runs


def test_the_time_budget_stops_the_climb_and_says_so():
    now = {"t": 0.0}

    def measure_one(cfg, world=1, timeout_s=None):  # every measurement takes 60 s of the budget
        now["t"] += 60
        return scripted({})(cfg)

    lad = climb(base(), measure_one, [8, 16, 32], bench(), ask(budget_minutes=200 / 60), lambda: now["t"])
    skipped = [r for r in lad["rungs"] if r["why"] == "the time budget is spent"]
    measured = [r for r in lad["rungs"] if r["status"] == "ok"]
    assert len(measured) == 2 and skipped  # 2 x 60 s of warm-up + start, then 2 options fit the 200 s


def test_preflight_ladder_writes_the_ladder_and_the_tuned_config(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.loss=chunked"])

    def measure_fn(c, spec, device):
        c.train.micro_batch_size, c.train.activation_checkpointing = spec.micro_batch, spec.checkpointing
        return scripted({("off", "plain", 8, "none"): 3000.0})(c)

    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append, ladder=True),
                       TuneHooks(measure_fn=measure_fn))
    assert report["ladder"]["chosen"] == {"train.loss": "plain"}
    assert report["prediction"]["tok_per_s"] == 3000.0 and report["choice_reason"] == "the ladder's last kept rung"
    saved = json.loads((tmp_path / "pf" / "preflight.json").read_text())
    assert saved["ladder"]["rungs"] and saved["ladder"]["start"]["settings"]["train.loss"] == "chunked"
    tuned = build_config(config_file=str(tmp_path / "pf" / "preflight.yaml"))
    assert tuned.train.loss == "plain" and tuned.train.micro_batch_size == 8
    assert any(line.startswith("ladder: loss") and "kept" in line for line in lines)


def test_the_loader_rung_keeps_prefetch_when_it_pays():
    def extra(cfg, world):
        return {0: 1.0, 1: 1.10, 2: 1.12}[cfg.data.prefetch]  # depth 2: +1.8% over depth 1, inside the noise

    lad = climb(base(), scripted({}, extra=extra), [16], bench(), ask())
    rows = {r["change"]: r for r in lad["rungs"] if r["rung"] == "loader"}
    assert rows["data.prefetch=1"]["kept"] and not rows["data.prefetch=2"]["kept"]
    assert "within the noise" in rows["data.prefetch=2"]["why"]
    assert lad["chosen"] == {"data.prefetch": 1}


def scaling(efficiency):
    """N ranks at ``efficiency[strategy, bucket_mb]`` of N x one rank."""
    def extra(cfg, world):
        if world == 1:
            return 1.0
        strategy = "ddp" if cfg.parallel.strategy == "auto" else cfg.parallel.strategy
        return world * efficiency.get((strategy, cfg.parallel.bucket_mb), 0.8)
    return extra


def test_at_n_ranks_the_ladder_scales_out_then_climbs_strategy_and_buckets():
    eff = {("ddp", 25.0): 0.80, ("zero1", 25.0): 0.88, ("zero1", 50.0): 0.95, ("fsdp2", 25.0): 0.70}
    lines = []
    # 121 MB of gradients (d_model 512, 20 layers): every bucket size tried makes buckets of its own
    big = ["model.d_model=512", "model.n_layers=20"]
    lad = climb(base(["train.threads=2", "train.global_batch_size=64", *big]), scripted({}, extra=scaling(eff)), [16],
                bench(peak=1e12), ask(log=lines.append, price_per_gpu_hour=2.0, world=4))
    rows = [r for r in lad["rungs"] if r["rung"] in ("ranks", "strategy", "buckets")]
    assert [(r["rung"], r["change"], r["kept"]) for r in rows] == [
        ("ranks", "4 ranks, parallel.strategy=ddp", True),
        ("strategy", "parallel.strategy=zero1", True),  # +10%
        ("strategy", "parallel.strategy=fsdp2", False),  # slower than zero1
        ("buckets", "parallel.bucket_mb=10.0", False),  # 0.8 of 4 ranks: slower
        ("buckets", "parallel.bucket_mb=50.0", True),  # +8%
        ("buckets", "parallel.bucket_mb=100.0", False)]
    assert lad["chosen"] == {"parallel.strategy": "zero1", "parallel.bucket_mb": 50.0}
    assert lad["world"] == 4 and lad["scaling_efficiency"] == pytest.approx(0.80)
    assert "3.20x one rank's rate, 80% scaling efficiency" in rows[0]["why"]
    final = lad["final"]
    assert final["tok_per_s"] == pytest.approx(4 * 0.95 * 1000)
    assert final["mfu"] == pytest.approx(final["tok_per_s"] * 1e7 / (1e12 * 4))  # per device
    assert final["cost"] == pytest.approx(final["hours"] * 2.0 * 4)  # every device's hours


def test_bucket_sizes_that_make_the_same_buckets_are_measured_once():
    """DDP fills a first 1 MB bucket, then buckets of bucket_mb: every size at least as large as
    the gradients makes the same two, so only the first such size (the configured 25 MB counts)
    is measured and the others say why they were not."""
    def buckets(overrides):
        lad = climb(base(["train.threads=2", *overrides]), scripted({}, extra=scaling({})), [16], bench(), ask(world=2))
        return [(r["change"].split("=")[1], r["status"], r["why"]) for r in lad["rungs"] if r["rung"] == "buckets"]

    tiny = buckets([])  # 7.0 MB of gradients: 10, 50 and 100 MB make the buckets 25 MB makes
    assert [(mb, status) for mb, status, _ in tiny] == [("10.0", "skipped"), ("50.0", "skipped"), ("100.0", "skipped")]
    assert "the buckets of 25 MB: the gradients (7.0 MB) fit in one bucket of either size" in tiny[0][2], tiny
    mid = buckets(["model.d_model=512", "model.n_layers=4"])  # 37.0 MB: 50 is the first size to hold them all
    assert [(mb, status) for mb, status, _ in mid] == [("10.0", "ok"), ("50.0", "ok"), ("100.0", "skipped")]
    assert "the buckets of 50 MB" in mid[2][2], mid


def test_buckets_are_not_climbed_under_fsdp2_nor_strategies_that_cannot_run_this_config():
    def n_rank_rows(overrides, eff):
        cfg = base(["train.threads=2", *overrides])
        lad = climb(cfg, scripted({}, extra=scaling(eff)), [16], bench(), ask(world=2))
        return [(r["rung"], r["change"]) for r in lad["rungs"] if r["rung"] in ("ranks", "strategy", "buckets")]

    # FSDP2 reduce-scatters block by block: it has no bucket size to climb
    assert n_rank_rows(["parallel.strategy=fsdp2"], {("fsdp2", 25.0): 0.9}) == [
        ("ranks", "2 ranks, parallel.strategy=fsdp2"), ("strategy", "parallel.strategy=ddp"),
        ("strategy", "parallel.strategy=zero1")]
    # Muon: zero1 and fsdp2 would split its whole-matrix state, so only ddp's buckets are climbed
    assert n_rank_rows(["parallel.strategy=ddp", "optim.name=muon"], {}) == [
        ("ranks", "2 ranks, parallel.strategy=ddp"), ("buckets", "parallel.bucket_mb=10.0"),
        ("buckets", "parallel.bucket_mb=50.0"), ("buckets", "parallel.bucket_mb=100.0")]


def test_a_climbed_micro_batch_the_ranks_cannot_split_is_a_skipped_scale_out():
    rates = {("off", "chunked", 32, "none"): 2000.0}
    cfg = base(["train.threads=2", "train.global_batch_size=32"])
    lad = climb(cfg, scripted(rates, extra=scaling({})), [16, 32], bench(), ask(world=2))
    ranks = next(r for r in lad["rungs"] if r["rung"] == "ranks")
    assert ranks["status"] == "skipped" and "x 2 ranks = 64" in ranks["why"]
    assert lad["chosen"] == {"train.micro_batch_size": 32} and lad["final"]["tok_per_s"] == 2000.0


def test_preflight_sends_n_rank_and_isolated_trials_to_fresh_processes(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.threads=1"])
    calls = {"here": 0, "spawned": [], "timeouts": []}

    def measure_fn(c, spec, device):
        calls["here"] += 1
        return scripted({})(c)

    def spawn_fn(c, spec, device, world=1, timeout_s=None):
        calls["spawned"].append(world)
        calls["timeouts"].append(timeout_s)
        return scripted({}, extra=scaling({}))(c, world)

    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "a", log=lines.append, ladder=True, world=2),
                       TuneHooks(measure_fn=measure_fn, spawn_fn=spawn_fn))
    assert f"(torchrun --nproc-per-node 2 -m flopwise train --config {tmp_path / 'a' / 'preflight.yaml'})" in lines[-1]
    measured_here = sum(r["status"] == "ok" for r in report["ladder"]["rungs"] if r["rung"] not in N_RANK_RUNGS)
    # auto on a CPU: one-rank trials in this process, after one untimed warm-up of the start
    assert report["isolation"] == "reset" and calls["here"] == 2 + measured_here
    assert set(calls["spawned"]) == {2} and report["ladder"]["world"] == 2
    assert report["prediction"]["tok_per_s"] == pytest.approx(1600.0)  # the 2-rank rate carries the run
    tuned = build_config(config_file=str(tmp_path / "a" / "preflight.yaml"))
    assert tuned.parallel.strategy == "ddp"  # what auto resolved to, measured, is what the run launches
    calls.update(here=0, spawned=[], timeouts=[])
    now = {"t": 0.0}

    def clock():  # every look at the clock: 1 s later
        now["t"] += 1
        return now["t"]

    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "b", log=lambda s: None, ladder=True, isolation="process",
                                        budget_minutes=1),
                       TuneHooks(measure_fn=measure_fn, spawn_fn=spawn_fn, clock=clock))
    start, *options = calls["timeouts"]
    assert start is None and options and all(0 < t < 60 for t in options)  # the start is not timed out
    assert options == sorted(options, reverse=True)  # each option gets what is left of the minute
    assert report["isolation"] == "process" and calls["here"] == 0 and set(calls["spawned"]) == {1}
    measured = sum(r["status"] == "ok" for r in report["ladder"]["rungs"])
    assert len(calls["spawned"]) == 1 + measured  # a fresh process has nothing to warm: no untimed start


@pytest.mark.parametrize("kwargs, problem", [
    ({"world": 2}, "--nproc-per-node 2 needs --ladder"),
    ({"world": 3, "ladder": True}, "must be a multiple of --nproc-per-node 3"),
    ({"world": 0, "ladder": True}, "--nproc-per-node 0: must be at least 1"),
    ({"ladder": True, "isolation": "fork"}, "--isolation 'fork'"),
    ({"ladder": True, "budget_minutes": -1}, "--budget-minutes -1: the ladder needs a time budget above 0"),
])
def test_preflight_refuses_a_launch_it_cannot_make_before_any_work(tiny_overrides, tmp_path, kwargs, problem):
    from flopwise.config import ConfigError

    cfg = build_config(overrides=tiny_overrides + ["train.compile=off"])
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lambda s: None, **kwargs), TuneHooks(measure_fn=None))
    assert not (tmp_path / "pf" / "preflight.json").exists()


def test_a_step_is_extrapolated_from_its_parts():
    from flopwise.tune.trial import extrapolated_step_s

    micro, opt = [0.08, 0.12, 0.14, 0.30], 0.05  # a first, two steady ones, a last one that also reduces
    assert extrapolated_step_s(micro, opt, accum=4) == pytest.approx(sum(micro) + opt)  # the probe is the step
    assert extrapolated_step_s(micro, opt, accum=8) == pytest.approx(0.08 + 6 * 0.13 + 0.30 + 0.05)
    # two prefetched heads (data.prefetch=2): both counted once, the steady one stands for the other five
    assert extrapolated_step_s(micro, opt, accum=8, head=2) == pytest.approx(0.08 + 0.12 + 5 * 0.14 + 0.30 + 0.05)
    assert extrapolated_step_s([0.1, 0.3], opt, accum=8) == pytest.approx(7 * 0.1 + 0.3 + 0.05)  # no steady one
    assert extrapolated_step_s([0.2], opt, accum=4) == pytest.approx(4 * 0.2 + 0.05)  # one measured: it stands for all
    with pytest.raises(ValueError, match="accum >= 1"):
        extrapolated_step_s([], opt, accum=2)


def test_a_checkpointed_size_beyond_the_probe_runs_whole_micro_batches_of_the_same_loss(tiny_overrides):
    """A probe of 48 sequences and a micro-batch of 32: the step is rounded up to 64 (two whole
    micro-batches), not 48 sequences' divisor applied to 32 (which scaled the loss by 2/3)."""
    from flopwise.tune.trial import measure

    overrides = tiny_overrides + ["train.compile=off", "train.threads=1", "data.loader=epoch"]
    probed = measure(build_config(overrides=overrides + ["train.global_batch_size=128"]),
                     TrialSpec(32, "none", warmup=0, steps=1, probe_sequences=48), CPU)
    whole = measure(build_config(overrides=overrides + ["train.global_batch_size=64"]),
                    TrialSpec(32, "none", warmup=0, steps=1), CPU)
    assert probed["probe_sequences"] == 64 and probed["first_loss"] == whole["first_loss"]


def test_the_ladder_probe_is_four_of_the_largest_micro_batch_that_fits(tiny_overrides):
    from flopwise.tune.preflight import probe_sequences

    cfg = build_config(overrides=tiny_overrides + ["train.global_batch_size=256"])
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert probe_sequences(cfg, sizes, Bench(CPU, memory_gb=0, headroom=0.9)) == 0  # no memory size: the whole batch
    probe = probe_sequences(cfg, sizes, Bench(CPU, memory_gb=0.05, headroom=0.9))
    largest = probe // 4  # the prefetched head (up to 2), a steady micro-batch, the last
    assert 0 < probe < 256 and probe == 4 * largest and largest & (largest - 1) == 0  # every size up to it divides it
    from flopwise.tune.ladder import planned_gb, with_settings

    def fits(b):
        return planned_gb(with_settings(cfg, {"train.micro_batch_size": b}), CPU) <= 0.9 * 0.05
    assert fits(largest) and not fits(2 * largest)
    assert probe_sequences(cfg, sizes, Bench(CPU, memory_gb=1000, headroom=0.9)) == 0  # all fit: 4 x 256 is not smaller


def test_a_probed_trial_trains_on_the_probe_batch_and_reports_the_runs_rate(tiny_overrides):
    from flopwise.tune.trial import measure

    cfg = build_config(overrides=tiny_overrides + ["train.compile=off", "train.threads=1", "data.loader=epoch",
                                                   "train.global_batch_size=64"])
    probed = measure(cfg, TrialSpec(8, "none", warmup=1, steps=3, probe_sequences=16), CPU)
    small = build_config(overrides=tiny_overrides + ["train.compile=off", "train.threads=1", "data.loader=epoch",
                                                     "train.global_batch_size=16"])
    whole_probe = measure(small, TrialSpec(8, "none", warmup=1, steps=3), CPU)
    assert probed["probe_sequences"] == 16 and whole_probe["probe_sequences"] is None
    assert probed["first_loss"] == whole_probe["first_loss"]  # the same 16 sequences, the same step
    assert len(probed["tok_per_s_windows"]) == 3 and probed["tok_per_s"] > 0


def test_preflight_probes_the_ladder_where_a_memory_size_bounds_the_micro_batch(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off", "train.threads=1",
                                                   "train.global_batch_size=256"])
    probes = []

    def measure_fn(c, spec, device):
        probes.append(spec.probe_sequences)
        return scripted({})(c)

    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lambda s: None,
                                        ladder=True, memory_gb=0.05), TuneHooks(measure_fn=measure_fn))
    assert report["ladder_probe_sequences"] and set(probes) == {report["ladder_probe_sequences"]}


def test_the_climbed_configuration_is_measured_again_against_the_winners_curse():
    """A kept rate is the best of noisy measurements: here the option measured 1,500 tok/s when
    tried and 1,350 when measured again. The ladder's final rate -- what the run is predicted
    from -- is the second, and the row says how far the first read high."""
    seen = {}

    def measure_one(cfg, world=1, timeout_s=None):
        t = cfg.train
        key = (t.compile, t.loss, t.micro_batch_size)
        seen[key] = seen.get(key, 0) + 1
        rate = 1000.0 if key == ("off", "chunked", 16) else (1500.0 if seen[key] == 1 else 1350.0)
        return {"tok_per_s": rate, "tok_per_s_windows": [rate] * 3, "peak_gb": None, "data_share": 0.01,
                "first_loss": 9.0}

    lad = climb(base(), measure_one, [16], bench(), ask())
    confirm = lad["rungs"][-1]
    assert confirm["rung"] == "confirm" and confirm["kept"] and confirm["tok_per_s"] == 1350.0
    assert lad["final"]["tok_per_s"] == 1350.0 and lad["selection_bias"] == pytest.approx(1500 / 1350 - 1)
    assert confirm["delta_prev"] == pytest.approx(-0.1) and "measured again: -10.0%" in confirm["why"]


def test_nothing_kept_nothing_to_confirm_and_no_budget_no_confirmation():
    lad = climb(base(), scripted({}), [16], bench(), ask())
    assert "confirm" not in [r["rung"] for r in lad["rungs"]]  # the start was measured once, unselected
    now = {"t": 0.0}

    def measure_one(cfg, world=1, timeout_s=None):
        now["t"] += 60
        return scripted({("blocks", "chunked", 16, "none"): 2000.0})(cfg)

    lad = climb(base(), measure_one, [16], bench(), ask(budget_minutes=2.5), lambda: now["t"])
    confirm = lad["rungs"][-1]
    assert confirm["rung"] == "confirm" and confirm["status"] == "skipped" and "may read high" in confirm["why"]
    assert lad["final"]["tok_per_s"] == 2000.0


def test_time_is_held_back_so_the_climb_ends_confirmed():
    """Every trial takes 60 s. Once a rung is kept, an option may use the budget only down to
    one start trial's worth (60 s), so the confirmation still runs -- without that hold the
    last option would take the budget's end and the final rate would be an unconfirmed best."""
    now, timeouts = {"t": 0.0}, []

    def measure_one(cfg, world=1, timeout_s=None):
        now["t"] += 60
        timeouts.append(timeout_s)
        return scripted({("blocks", "chunked", 16, "none"): 2000.0})(cfg)

    lad = climb(base(), measure_one, [8, 16, 32], bench(), ask(budget_minutes=5), lambda: now["t"])
    rows = lad["rungs"]
    assert [r["rung"] for r in rows if r["status"] == "ok"] == ["compile", "compile", "confirm"], rows
    assert rows[-1]["kept"] and lad["final"]["tok_per_s"] == 2000.0
    held = [r for r in rows if r["status"] == "skipped"]
    assert held and held[0]["why"] == "the time budget is spent (the last 60 s are held for the confirmation)"
    assert lad["start"]["seconds"] == 60 and all(r["seconds"] == 60 for r in rows if r["status"] == "ok")
    # the start is never cut; options get what is left above the hold; the confirmation all that is left
    assert timeouts == [None, None, 180.0, 60.0, 60.0], timeouts


def test_on_cuda_the_attention_rung_skips_autos_own_pick_and_compile_modes_come_last():
    cuda = torch.device("cuda")
    cfg = build_config(preset="tiny", overrides=["train.compile=model", "train.loss=plain", "train.precision=bf16"])
    plan = dict((name, options) for name, options, _ in rungs(cfg, cuda, [8, 16, 32]))
    names = [name for name, _, _ in rungs(cfg, cuda, [8, 16, 32])]
    from flopwise.model.attention import select_backend

    auto = select_backend("auto", cuda, torch.bfloat16)[0]
    assert {"model.attention": auto} not in plan["attention"]  # measuring auto's pick again is a wasted trial
    assert names[-1] == "compile mode" and names.index("compile mode") > names.index("micro-batch")
    assert plan["compile mode"] == [{"train.compile_mode": "max-autotune"}, {"train.compile_mode": "reduce-overhead"}]
    cfg.train.compile_mode = "max-autotune"
    assert [o["train.compile_mode"] for o in dict((n, o) for n, o, _ in rungs(cfg, cuda, [16]))["compile mode"]] == [
        "reduce-overhead"]


@pytest.mark.parametrize("asked", [False, True])
def test_fp8_is_measured_where_it_runs_and_kept_only_when_asked(monkeypatch, asked):
    """On a GPU that runs float8 (capability 8.9+, torchao installed) the fp8 rung is measured
    and its row marked; it changes numerics, so it is kept only with --ladder-fp8."""
    import flopwise.tune.ladder as ladder_mod

    cuda = torch.device("cuda")
    monkeypatch.setattr(ladder_mod, "fp8_problem", lambda device: None)

    def measure_one(cfg, world=1, timeout_s=None):
        rate = 1500.0 if cfg.train.fp8 else 1000.0
        loss = 9.004 if cfg.train.fp8 else 9.0  # fp8 moves the first loss by 4e-4: inside 2e-2
        return {"tok_per_s": rate, "tok_per_s_windows": [rate] * 3, "peak_gb": None, "data_share": 0.01,
                "first_loss": loss}

    cfg = build_config(preset="tiny", overrides=["train.compile=model", "train.loss=plain", "train.precision=bf16"])
    lad = climb(cfg, measure_one, [16], bench(device=cuda), ask(ladder_fp8=asked))
    row = next(r for r in lad["rungs"] if r["rung"] == "fp8")
    assert row["numerics"] == "fp8" and row["status"] == "ok" and row["delta_prev"] == pytest.approx(0.5)
    assert row["kept"] is asked and lad["chosen"].get("train.fp8", False) is asked
    if not asked:
        assert row["why"] == "fp8 changes numerics: kept only when asked for (--ladder-fp8)"
    monkeypatch.setattr(ladder_mod, "fp8_problem", lambda device: "train.fp8=true needs torchao")
    assert "fp8" not in [name for name, _, _ in rungs(cfg, cuda, [16])]  # not offered where it cannot run
    assert "fp8" in [name for name, _, _ in rungs(cfg, cuda, [16], fp8=True)]  # asked for: its row says why not


def test_a_ladder_rows_spread_is_the_medians_as_the_searchs_is():
    """One spread (tune/choice.median_spread): a row of six windows, one far out at each end,
    has the median's interval (the 2nd to the 5th window) as its noise, not half the whole range
    -- which would call a 5% gain noise here, where the search's trials would not."""
    from flopwise.tune.choice import median_spread

    windows = [900.0, 990.0, 1000.0, 1000.0, 1010.0, 1100.0]

    def measure_one(cfg, world=1, timeout_s=None):
        m = scripted({("model", "chunked", 16, "none"): 1050.0})(cfg)
        scale = m["tok_per_s"] / 1000.0
        return {**m, "tok_per_s_windows": [w * scale for w in windows]}

    lad = climb(base(), measure_one, [16], bench(), ask())
    assert lad["start"]["spread"] == pytest.approx(median_spread(windows)) == pytest.approx(0.01)
    row = next(r for r in lad["rungs"] if r["change"] == "train.compile=model")
    assert row["kept"] and row["spread"] == pytest.approx(0.01), row["why"]
