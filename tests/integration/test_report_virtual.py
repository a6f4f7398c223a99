"""Issue 42, item 3's last clause: the report shows the virtual preflight's predictions
(``preflight --dry-run --rank``'s virtual.json) beside what the preflight and the run measured.

Real tiny CPU runs made by ``flopwise train``; the virtual.json and preflight.json are written
by hand (nothing is traced here), the predictions set from the run's own measured figures so
the errors are known exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flopwise.cli import main
from flopwise.config import build_config
from flopwise.report import build_report

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.checkpoint_every=0", "train.warmup_log_steps=1"]
MB, AC = "train.micro_batch_size", "train.activation_checkpointing"


def settings(mb: int, ac: str = "none", **other: str) -> dict:
    return {MB: mb, AC: ac, "train.compile": other.get("compile", "model"), "train.loss": other.get("loss", "plain"),
            "parallel.strategy": "single"}


def candidate(s: dict, per_gpu: float | None, mfu: float | None = 0.3, peak: float = 0.05, fits: bool = True) -> dict:
    pred = None if per_gpu is None else {"predicted": True, "gpu": "H100 SXM", "tokens_per_s_per_gpu": per_gpu,
                                         "tokens_per_s": per_gpu, "mfu": mfu, "hfu": mfu, "step_s": 0.01,
                                         "breakdown": {"matmul": 0.01}}
    return {"settings": s, "fits": fits, "peak_gib": peak, "cap_gib": 72.0, "prediction": pred}


def virtual_doc(candidates: list[dict], choice: dict) -> dict:
    return {"virtual": {"gpu": "H100 SXM", "world": 1, "cap_gib": 72.0, "candidates": candidates,
                        "choice": {**choice, "margin": 0.05}, "budget": None}}


def preflight_doc(trials: list[dict]) -> dict:
    return {"preset": "tiny", "device": "cpu", "trials": trials,
            "chosen": {"micro_batch_size": 8, "activation_checkpointing": "none"},
            "prediction": {"tok_per_s": 1000.0, "mfu": None, "memory_gb": 0.1, "memory_basis": "assumed"}}


def trial(mb: int, ac: str, tok_per_s: float | None, status: str = "ok") -> dict:
    return {"micro_batch": mb, "checkpointing": ac, "status": status, "tok_per_s": tok_per_s, "mfu": None,
            "peak_gb": None}


def train_run(overrides: list[str], *extra: str) -> Path:
    assert main(["train", *overrides, *QUIET, "train.max_steps=4", "train.log_every=2", *extra]) == 0
    return Path(build_config(overrides=overrides).train.run_dir)


def rows(html: str, key: str) -> dict[str, tuple[float | None, str]]:
    """{column: (data-value, its text)} of the comparison row of ``key``."""
    m = re.search(rf'<tr data-run="[^"]*" data-key="{key}">(.*?)</tr>', html, re.S)
    assert m, key
    out = {}
    for col, value, text in re.findall(r'data-col="([^"]+)" data-value="([^"]*)"[^>]*>(.*?)</td>', m.group(1)):
        out[col] = (float(value) if value else None, re.sub(r"<[^>]+>", "", text))
    return out


def pairs(html: str) -> list[list[str]]:
    """The cells' text of the virtual-vs-preflight table, row by row."""
    m = re.search(r'<table class="comparison virtual-pairs">(.*?)</table>', html, re.S)
    assert m, "no virtual-vs-preflight table"
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", r)]
            for r in re.findall(r"<tr data-run[^>]*>(.*?)</tr>", m.group(1), re.S)]


def test_a_run_without_virtual_json_reads_as_before_then_one_put_in_by_hand_shows(tiny_overrides):
    run = train_run(tiny_overrides)
    html = build_report([run], png=False).read_text()
    assert "virtual preflight" not in html and 'data-col="trace' not in html
    assert ("<th>plan</th><th>preflight</th><th>measured</th><th>plan error</th><th>preflight error</th>"
            "<th>notes</th>") in html

    cfg = build_config(overrides=tiny_overrides)
    mine = settings(cfg.train.micro_batch_size, cfg.train.activation_checkpointing,
                    compile=cfg.train.compile, loss=cfg.train.loss)
    measured = rows(html, "tok_per_s")["actual"][0]  # what the report reads as measured, before virtual.json
    assert measured and measured > 0
    predicted = measured / 1.25  # the run measured 25% more than predicted
    faster = settings(16, "full")
    doc = virtual_doc([candidate(mine, predicted, mfu=0.2, peak=0.05),
                       candidate({**mine, "train.compile": "blocks"}, predicted * 2),
                       candidate(faster, 3 * predicted), candidate(settings(32), None, fits=False)],
                      choice=candidate(faster, 3 * predicted))
    (run / "virtual.json").write_text(json.dumps(doc))
    (run / "preflight.json").write_text(json.dumps(preflight_doc(
        [trial(cfg.train.micro_batch_size, cfg.train.activation_checkpointing, 0.5 * predicted),
         trial(16, "full", 1.5 * predicted), trial(32, "none", None, "oom"), trial(2, "none", 10.0)])))
    html = build_report([run], png=False).read_text()

    tps = rows(html, "tok_per_s")
    assert tps["trace"][0] == pytest.approx(predicted) and "predicted" in tps["trace"][1]  # the run's settings
    assert tps["trace_error"][0] == pytest.approx(0.25) and tps["trace_error"][1] == "+25.0%"
    assert "virtual preflight: predicted for 1 × H100 SXM, the candidate with the run" in html
    mfu = rows(html, "mfu")
    assert mfu["trace"][0] == pytest.approx(0.2) and "20.0% predicted" in mfu["trace"][1]
    assert mfu["actual"][0] is None and mfu["trace_error"][1] == "n/a"  # a CPU: no device peak, no MFU measured
    mem = rows(html, "memory_gb")
    assert mem["trace"][0] == pytest.approx(0.05) and "traced" in mem["trace"][1]
    assert mem["trace_error"][0] == pytest.approx((mem["actual"][0] - 0.05) / 0.05)
    assert rows(html, "wall_time_s")["trace"][0] is None  # the virtual preflight predicts no wall time here

    table = pairs(html)
    # a row per candidate of a trial's micro-batch and checkpointing, in the trials' order; the oom
    # trial's candidate did not fit by trace, and the micro-batch-2 trial has no candidate
    assert [r[1:3] for r in table] == [[str(cfg.train.micro_batch_size), "none"]] * 2 + [["16", "full"], ["32", "none"]]
    assert table[0][4].endswith("predicted") and table[0][5].endswith("measured") and table[0][6] == "0.50×"
    assert table[1][6] == "0.25×" and "compile blocks" in table[1][3]
    assert table[2][6] == "0.50×"
    assert table[3][4:] == ["does not fit (traced)", "oom", "n/a"]


def test_choice_is_held_against_the_run_when_its_settings_were_not_traced(tiny_overrides):
    run = train_run(tiny_overrides)
    measured = rows(build_report([run], png=False).read_text(), "tok_per_s")["actual"][0]
    assert measured and measured > 0
    other = settings(16, "full")
    (run / "virtual.json").write_text(json.dumps(virtual_doc([candidate(other, measured / 2)],
                                                             choice=candidate(other, measured / 2))))
    html = build_report([run], png=False).read_text()
    tps = rows(html, "tok_per_s")
    assert tps["trace"][0] == pytest.approx(measured / 2) and tps["trace_error"][0] == pytest.approx(1.0)
    assert "its choice (the run" in html
    assert "virtual-pairs" not in html  # no preflight.json: nothing measured to pair with


def test_virtual_json_beside_preflight_json_travels_with_the_run(tiny_overrides, tmp_path):
    folder = tmp_path / "pf"
    folder.mkdir()
    (folder / "preflight.json").write_text(json.dumps(preflight_doc([trial(8, "none", 900.0)])))
    virtual = json.dumps(virtual_doc([candidate(settings(8), 1000.0)], choice=candidate(settings(8), 1000.0)))
    (folder / "virtual.json").write_text(virtual)
    run = train_run(tiny_overrides, f"train.preflight={folder / 'preflight.json'}")
    assert (run / "virtual.json").read_text() == virtual
    html = build_report([run], png=False).read_text()
    assert pairs(html)[0][4:] == ["1K tok/s predicted", "900 tok/s measured", "0.90×"]


@pytest.mark.parametrize("content", ["not json\n", '{"candidates": []}', '{"virtual": {"choice": null}}',
                                     '{"virtual": {"choice": 1, "candidates": []}}'],
                         ids=["text", "no-virtual", "no-candidates", "choice-not-an-object"])
def test_a_malformed_virtual_json_beside_preflight_json_is_refused_before_the_run_dir(tiny_overrides, tmp_path,
                                                                                     capsys, content):
    folder = tmp_path / "pf"
    folder.mkdir()
    (folder / "preflight.json").write_text(json.dumps(preflight_doc([])))
    (folder / "virtual.json").write_text(content)
    run = Path(build_config(overrides=tiny_overrides).train.run_dir)
    assert main(["train", *tiny_overrides, *QUIET, "train.max_steps=1",
                 f"train.preflight={folder / 'preflight.json'}"]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "virtual.json" in x)
    assert f"{folder / 'virtual.json'} (beside train.preflight)" in line and "not a virtual preflight result" in line
    assert "Traceback" not in err
    assert not run.exists()  # refused before the run directory was made


def test_a_virtual_json_of_another_step_beside_preflight_json_is_not_kept_and_says_why(tiny_overrides, tmp_path,
                                                                                      capsys):
    """A stale virtual.json (another model, or another batch) beside preflight.json was copied into
    the run, and the report held the run against it (-99.8%). The virtual preflight records which
    step it traced (``of``); train keeps it only for the same step, and says why it does not."""
    from flopwise.config import step_identity

    mine = build_config(overrides=tiny_overrides)
    other = build_config(overrides=[*tiny_overrides, "model.n_layers=3"])
    folder = tmp_path / "pf"
    folder.mkdir()
    (folder / "preflight.json").write_text(json.dumps(preflight_doc([trial(8, "none", 900.0)])))
    doc = virtual_doc([candidate(settings(8), 1000.0)], choice=candidate(settings(8), 1000.0))
    (folder / "virtual.json").write_text(json.dumps({"virtual": {**doc["virtual"], "of": step_identity(other)}}))
    capsys.readouterr()
    run = train_run(tiny_overrides, f"train.preflight={folder / 'preflight.json'}")
    out = capsys.readouterr()
    line = next((x for x in (out.out + out.err).splitlines() if "virtual.json" in x), "")
    assert "predicted another step (another model)" in line and "not kept" in line, out.out[-2000:]
    assert not (run / "virtual.json").exists()
    assert "virtual preflight" not in build_report([run], png=False).read_text()
    # another batch: said with both figures; the same step: kept
    batch = step_identity(mine) | {"global_batch": mine.train.global_batch_size * 2}
    (folder / "virtual.json").write_text(json.dumps({"virtual": {**doc["virtual"], "of": batch}}))
    train_run([*tiny_overrides, f"train.run_dir={tmp_path / 'b'}"], f"train.preflight={folder / 'preflight.json'}")
    out = capsys.readouterr()
    assert f"global batch {2 * mine.train.global_batch_size} (this run: {mine.train.global_batch_size})" in out.out + out.err
    same = json.dumps({"virtual": {**doc["virtual"], "of": step_identity(mine)}})
    (folder / "virtual.json").write_text(same)
    kept = train_run([*tiny_overrides, f"train.run_dir={tmp_path / 'c'}"], f"train.preflight={folder / 'preflight.json'}")
    assert (kept / "virtual.json").read_text() == same


def test_a_virtual_json_of_another_step_put_in_a_run_by_hand_is_left_out_of_the_report(tiny_overrides):
    from flopwise.config import step_identity

    run = train_run(tiny_overrides)
    other = build_config(overrides=[*tiny_overrides, "model.n_layers=3"])
    doc = virtual_doc([candidate(settings(8), 1000.0)], choice=candidate(settings(8), 1000.0))
    (run / "virtual.json").write_text(json.dumps({"virtual": {**doc["virtual"], "of": step_identity(other)}}))
    html = build_report([run], png=False).read_text()
    assert "virtual preflight predicted another step (another model): left out" in html
    assert 'data-col="trace' not in html
