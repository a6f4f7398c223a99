"""flopwise preflight: the end-to-end check, the micro-batch search (memory simulated through the
planner, an out-of-memory injected), the tuned config, and predictions from measured numbers."""

import json

import pytest
import torch

from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.tune.preflight import preflight
from flopwise.tune.request import TuneHooks, TuneRequest
from flopwise.tune.trial import TrialSpec, measure


def fake_measure(speeds, oom_from=None):
    """A stand-in for timing: tokens/s per micro-batch; an OOM (as CUDA raises it) from a size on."""
    def run(cfg, spec, device):
        micro_batch, checkpointing = spec.micro_batch, spec.checkpointing
        if oom_from and micro_batch >= oom_from and checkpointing == "none":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"tok_per_s": speeds[micro_batch] * (0.8 if checkpointing == "full" else 1.0), "peak_gb": None,
                "data_share": 0.01}
    return run


def test_search_skips_what_cannot_fit_catches_oom_and_picks_the_fastest(tiny_overrides, tmp_path):
    """The one search (tune/choice.search) from the configured micro-batch 16: the planner says it
    cannot fit, so it goes down -- 8 runs out of memory (going down, a smaller one may fit), 4 is
    the fastest, 2 is slower and 1 is not run -- then checkpointing, smallest first while it pays."""
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.micro_batch_size=16"])  # global 16
    lines = []
    speeds = {1: 100.0, 2: 180.0, 4: 260.0, 8: 350.0, 16: 400.0}
    # The planner puts micro-batch 16 at ~0.020 GiB without checkpointing and ~0.010 with it:
    # a 0.015 GiB device fits 16 only with checkpointing.
    report = preflight(cfg, TuneRequest(memory_gb=0.015, headroom=1.0, out_dir=tmp_path / "pf",
                                        log=lines.append), TuneHooks(measure_fn=fake_measure(speeds, oom_from=8)))
    status = {(t["micro_batch"], t["checkpointing"]): t["status"] for t in report["trials"]}
    assert status[(2, "none")] == status[(4, "none")] == "ok"
    assert status[(1, "none")] == "skipped"  # 2 was slower than 4: tokens/s falls past the fastest size
    assert status[(8, "none")] == "oom"  # caught, noted, not fatal
    assert status[(16, "none")] == "no-fit"  # the planner says it cannot fit: not even tried
    assert (4, "full") not in status  # checkpointing is only tried where plain training does not fit
    assert status[(8, "full")] == status[(16, "full")] == "ok"
    assert report["end_to_end"]["finite"] and report["end_to_end"]["falling"]
    assert report["end_to_end"]["checkpoint_identical"]
    # 8 with checkpointing (280 tok/s) beats 4 without (260), so 16 is tried: 400 x 0.8 = 320 tok/s
    assert report["chosen"] == {"micro_batch_size": 16, "activation_checkpointing": "full"}
    # the measured GEMM ceiling at the chosen micro-batch, and the chosen trial's share of it
    c = report["ceiling"]
    assert c["micro_batch"] == 16 and c["tflops"] > 0 and c["datasheet_tflops"] is None  # a CPU: no datasheet
    assert c["share_of_ceiling"] == pytest.approx(320.0 * c["fpt"] / (c["tflops"] * 1e12))
    assert any(line.startswith("preflight: measured ceiling") and "reaches" in line for line in lines)
    assert any("<- chosen" in line for line in lines) and any(" oom " in line for line in lines)


def test_progress_per_trial_repeated_windows_and_the_simpler_choice_within_noise(tiny_overrides, tmp_path):
    """Issue 19: a line as each trial finishes (which of how many), several timed windows per
    trial with their median and spread, and checkpointing not chosen for a gain within the noise:
    the trials tied with the fastest are re-measured in turn first (A B C A B C ...), and the
    table and preflight.json give each row's timed steps."""
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100"])
    asked, order = [], []

    def windows(cfg, spec, device):
        micro_batch, checkpointing, steps = spec.micro_batch, spec.checkpointing, spec.steps
        asked.append(steps)
        order.append((micro_batch, checkpointing))
        base = {1: 100.0, 2: 180.0, 4: 300.0, 8: 300.0, 16: 300.0}[micro_batch]
        base *= 1.015 if checkpointing == "full" else 1.0  # 1.5% faster: noise, not a reason
        if micro_batch >= 8 and checkpointing == "none":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        rates = [base * f for f in (0.99, 1.0, 1.01)][:steps]
        return {"tok_per_s": rates[1], "tok_per_s_windows": rates, "peak_gb": None, "data_share": 0.01}

    lines = []
    report = preflight(cfg, TuneRequest(steps=1, out_dir=tmp_path / "pf", log=lines.append),
                       TuneHooks(measure_fn=windows))
    assert set(asked) == {3}  # --steps 1 still times three windows: one gives no spread
    # the search from the configured 8 (out of memory: 16 is not run), down to 4 and 2 (slower: 1 is not
    # run), 8 with checkpointing (within the noise of 4: 16 is not tried), then three rounds of the two tied
    assert order == [(8, "none"), (4, "none"), (2, "none"), (8, "full")] + [(4, "none"), (8, "full")] * 3
    progress = [line for line in lines if line.startswith("preflight: trial ")]
    table = next(i for i, line in enumerate(lines) if line.lstrip().startswith("micro-batch"))
    assert len(progress) == 5 + 1 and all(lines.index(line) < table for line in progress)
    assert progress[0].startswith("preflight: trial 1/5 without checkpointing: micro-batch 8 ")
    assert " oom" in progress[0]
    assert progress[1].startswith("preflight: trial 2/5 without checkpointing: micro-batch 16 · skipped: ")
    assert progress[2].startswith("preflight: trial 3/5 without checkpointing: micro-batch 4 ")
    assert "± 1.0% (median of 3)" in progress[2] and "MFU n/a" in progress[2]
    assert progress[-1].startswith("preflight: trial 1 with checkpointing: micro-batch 8 ")
    assert report["chosen"] == {"micro_batch_size": 4, "activation_checkpointing": "none"}
    assert "within the noise" in report["choice_reason"]
    assert any(line.startswith("preflight: chose micro-batch 4 without checkpointing") for line in lines)
    assert "after 3 re-measure rounds" in report["choice_reason"]
    t = next(x for x in report["trials"] if x["micro_batch"] == 4)
    assert t["tok_per_s"] == 300.0 and t["spread"] == pytest.approx(0.01) and t["windows"] == 3 + 3 * 3
    assert t["rounds"] == 3 and len(t["rates"]) == 12
    assert lines[table].split()[5] == "steps"
    steps = {tuple(line.split()[:2]): line.split()[5] for line in lines[table + 1:table + 7]}
    assert steps[("2", "none")] == "3" and steps[("4", "none")] == steps[("8", "full")] == "12"
    assert steps[("8", "none")] == steps[("1", "none")] == "-"  # out of memory, not run: no timed step
    saved = json.loads((tmp_path / "pf" / "preflight.json").read_text())
    assert [x["windows"] for x in saved["trials"]] == [0, 3, 12, 0, 0, 12]  # the table's order: 1 .. 16, then 8
    pf = saved["prediction"]
    assert pf["mfu"] is None and pf["memory_basis"] == "assumed"  # CPU: no peak, no measured memory


def test_nothing_fits_is_a_clear_error(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100"])
    with pytest.raises(RuntimeError, match="no micro-batch fits"):
        preflight(cfg, TuneRequest(memory_gb=0.001, out_dir=tmp_path / "pf", log=lambda s: None),
                  TuneHooks(measure_fn=fake_measure({})))


def test_tuned_config_and_predictions(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100"])
    speeds = {1: 100.0, 2: 180.0, 4: 300.0, 8: 350.0, 16: 320.0}
    report = preflight(cfg, TuneRequest(hours=2.0, price_per_gpu_hour=3.0, out_dir=tmp_path / "pf",
                                        log=lambda s: None), TuneHooks(measure_fn=fake_measure(speeds)))
    p = report["prediction"]
    assert report["chosen"]["micro_batch_size"] == 8 and p["tok_per_s"] == 350.0
    assert p["tokens"] == int(2.0 * 3600 * 350.0) and p["wall_time_s"] == pytest.approx(p["tokens"] / 350.0)
    assert p["cost"] == pytest.approx(p["hours"] * 3.0)
    tuned = build_config(config_file=tmp_path / "pf" / "preflight.yaml")
    assert tuned.train.micro_batch_size == 8 and tuned.train.activation_checkpointing == "none"
    assert tuned.train.global_batch_size == cfg.train.global_batch_size  # same optimisation, other split
    assert json.loads((tmp_path / "pf" / "preflight.json").read_text())["chosen"] == report["chosen"]


def test_real_measurement_and_the_tuned_run_carries_preflight_into_its_report(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=6"])
    m = measure(cfg, TrialSpec(8, "none", warmup=1, steps=2), torch.device("cpu"))
    assert m["tok_per_s"] > 0 and 0 <= m["data_share"] < 1
    assert len(m["tok_per_s_windows"]) == 2 and m["tok_per_s"] == pytest.approx(sum(m["tok_per_s_windows"]) / 2)
    # global batch 8 (4 sizes), as each trial now times 3 windows at least: the test's time stays as it was
    assert cli_main(["preflight", *tiny_overrides, "train.max_steps=6", "train.global_batch_size=8",
                     "--out", str(tmp_path / "pf"), "--warmup", "1", "--steps", "1"]) == 0
    assert cli_main(["train", "--config", str(tmp_path / "pf" / "preflight.yaml"),
                     f"train.run_dir={tmp_path / 'tuned'}"]) == 0
    assert (tmp_path / "tuned" / "preflight.json").is_file()


def test_max_hours_caps_the_prediction(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=0", "train.max_tokens=1e9", "train.max_hours=1"])
    report = preflight(cfg, TuneRequest(tokens=10**9, out_dir=tmp_path / "pf", log=lambda s: None),
                       TuneHooks(measure_fn=fake_measure({1: 10.0, 2: 20.0, 4: 30.0, 8: 40.0, 16: 50.0})))
    assert report["stops_at_max_hours"] and report["prediction"]["tokens"] == 3600 * 50
    assert report["prediction"]["hours"] == pytest.approx(1.0)


@pytest.mark.slow
def test_compile_diagnostics_are_part_of_the_report(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=blocks"])
    lines = []
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lines.append),
                       TuneHooks(measure_fn=fake_measure({1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0, 16: 5.0})))
    assert report["compile"]["graphs"] >= 1 and "graph_breaks" in report["compile"]
    assert report["end_to_end"]["recompiles"] == []  # fixed shapes: nothing recompiled after warm-up
    assert any(line.startswith("explain: ") for line in lines)


@pytest.mark.slow
def test_the_ladder_at_two_ranks_from_the_command_line_writes_what_torchrun_launches(tiny_overrides, tmp_path,
                                                                                      capsys, monkeypatch):
    """flopwise preflight --ladder --nproc-per-node 2, for real: the one-rank rungs in this process
    (the CPU default), then 2 gloo ranks started by the ladder itself; the tuned config names the
    strategy that was measured. (Fresh one-rank processes: tests/distributed/test_trial.py.) The
    rungs of a CPU without native bf16, on any machine (the bf16 rung: tests/unit/test_ladder.py)."""
    monkeypatch.setattr("flopwise.tune.ladder.cpu_native_bf16", lambda: None)
    out = tmp_path / "pf"
    # A budget that never binds: the climb takes about 2.5 minutes on an idle 2-core machine, but 10 minutes
    # ran out on a loaded one before the 2-rank rung, which then (rightly) leaves the launch at one rank.
    rc = cli_main(["preflight", "--ladder", "--nproc-per-node", "2",
                   "--warmup", "1", "--budget-minutes", "120", "--out", str(out), *tiny_overrides,
                   "train.max_steps=40", "train.compile=off", "train.threads=1", "train.global_batch_size=32"])
    assert rc == 0
    report = json.loads((out / "preflight.json").read_text())
    lad = report["ladder"]
    assert report["isolation"] == "reset" and lad["world"] == 2
    ranks = next(r for r in lad["rungs"] if r["rung"] == "ranks")
    assert ranks["status"] == "ok" and ranks["kept"] and "scaling efficiency" in ranks["why"]
    assert 0 < lad["scaling_efficiency"] and abs(ranks["loss"] - lad["start"]["loss"]) < 1e-4 * lad["start"]["loss"]
    rows = {r["rung"] for r in lad["rungs"]}
    # the bucket size is climbed unless the strategy measured fastest shards (fsdp2 has no DDP buckets):
    # which one wins at 2 ranks on a loaded CPU is the measurement's, not the test's, to say
    assert "strategy" in rows or "fsdp2" in ranks["change"]
    assert ("buckets" in rows) == (lad["chosen"]["parallel.strategy"] != "fsdp2"), lad["chosen"]
    tuned = build_config(config_file=str(out / "preflight.yaml"))
    assert tuned.parallel.strategy == lad["chosen"]["parallel.strategy"] != "auto"
    assert "ladder: ranks" in capsys.readouterr().out


def test_the_search_times_a_probe_of_a_large_global_batch(tiny_overrides, tmp_path):
    """Global batch 256 on a simulated 0.05 GiB device: the trials accumulate a probe (four of the
    largest micro-batch that may fit), not all 256 sequences."""
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.global_batch_size=256"])
    probes = []

    def run(cfg, spec, device):
        probes.append(spec.probe_sequences)
        return {"tok_per_s": 100.0 * spec.micro_batch, "peak_gb": None, "data_share": 0.01}

    report = preflight(cfg, TuneRequest(memory_gb=0.05, out_dir=tmp_path / "pf", log=lambda s: None),
                       TuneHooks(measure_fn=run))
    assert 0 < report["probe_sequences"] < 256 and set(probes) == {report["probe_sequences"]}


def test_the_search_measures_each_size_in_a_fresh_process_when_isolated(tiny_overrides, tmp_path):
    """--isolation process (the default on a GPU): the plain search's trials run in processes of
    their own, as the ladder's do, so one size's out-of-memory or fragmented allocator cannot
    touch the next; auto on a CPU keeps them in this process."""
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100"])
    calls = {"here": 0, "spawned": []}

    def here(cfg, spec, device):
        calls["here"] += 1
        return {"tok_per_s": 100.0 * spec.micro_batch, "peak_gb": None, "data_share": 0.01}

    def spawned(cfg, spec, device, world=1, timeout_s=None):
        calls["spawned"].append((spec.micro_batch, world, spec.probe_sequences))
        return {"tok_per_s": 100.0 * spec.micro_batch, "peak_gb": None, "data_share": 0.01}

    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "a", log=lambda s: None,
                                        isolation="process"), TuneHooks(measure_fn=here, spawn_fn=spawned))
    # from the configured 8 up to 16, then down to 4 (slower: 2 and 1 are not run)
    assert calls["here"] == 0 and [b for b, _, _ in calls["spawned"]] == [8, 16, 4]
    assert report["isolation"] == "process" and report["chosen"]["micro_batch_size"] == 16
    calls.update(here=0, spawned=[])
    report = preflight(cfg, TuneRequest(out_dir=tmp_path / "b", log=lambda s: None),
                       TuneHooks(measure_fn=here, spawn_fn=spawned))
    assert calls["here"] == 3 and not calls["spawned"] and report["isolation"] == "reset"


@pytest.mark.slow
def test_an_isolated_search_on_a_cpu_measures_for_real(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.global_batch_size=8",
                                                   "train.micro_batch_size=4", "train.compile=off"])
    lines = []
    # no re-measuring of sizes tied with the fastest (tests/unit/test_preflight_choice.py covers it): on
    # a loaded machine more sizes tie, and the rounds took this test from 26 s to 114 s in CI
    report = preflight(cfg, TuneRequest(steps=3, warmup=1, out_dir=tmp_path / "pf", log=lines.append,
                                        isolation="process", remeasure_rounds=0))
    # the configured 4 and outward from it, each direction to where tokens/s falls: which sizes that is,
    # the measurement says; every size is measured or skipped past a slower one
    ok = [t for t in report["trials"] if t["status"] == "ok"]
    assert 4 in [t["micro_batch"] for t in ok] and all(t["tok_per_s"] > 0 for t in ok), report["trials"]
    assert {t["status"] for t in report["trials"]} <= {"ok", "skipped"}, report["trials"]
    assert report["isolation"] == "process"


@pytest.mark.parametrize("native", [None, "AVX-512 BF16"])
def test_a_float32_preflight_on_a_cpu_with_native_bf16_points_at_the_ladder(tiny_overrides, tmp_path, monkeypatch,
                                                                            native):
    monkeypatch.setattr("flopwise.tune.preflight.cpu_native_bf16", lambda: native)
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=20"])

    def steady(cfg, spec, device):
        rates = [100.0 * spec.micro_batch * f for f in (0.99, 1.0, 1.01)][:spec.steps]
        return {"tok_per_s": rates[1], "tok_per_s_windows": rates, "peak_gb": None, "data_share": 0.01}

    lines = []
    report = preflight(cfg, TuneRequest(steps=1, out_dir=tmp_path / "pf", log=lines.append),
                       TuneHooks(measure_fn=steady))
    notes = [line for line in lines if "multiplies bf16 natively" in line]
    if native:
        assert report["native_bf16"] == native and len(notes) == 1 and "--ladder" in notes[0], notes
    else:
        assert "native_bf16" not in report and not notes
