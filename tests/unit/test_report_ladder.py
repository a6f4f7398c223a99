"""The report's Ladder section: the optimization ladder of ``flopwise preflight --ladder``,
read from the ``ladder`` key of the run's ``preflight.json`` -- chart, table, ladder vs actual.

Synthetic runs from ``test_report.write_run`` (run.json measures 4,000 tok/s after warm-up)
with a ladder whose last kept rung measured 5,000 tok/s, so the run / ladder ratio is 0.8."""

import json
import re

import pytest
from test_report import comparison_cells, figures, write_run  # same folder, on sys.path

from flopwise.report import build_report
from flopwise.report import png as png_out
from flopwise.report.ladder import read_ladder

RUNGS = [
    {"rung": "compile", "change": "train.compile=model", "tok_per_s": 4000.0, "mfu": 0.25, "peak_gb": 3.5,
     "loss": 9.0102, "kept": True, "why": "60.0% faster than the previous rung (noise 2.0%); loss within <1e-3",
     "numerics": "same", "delta_prev": 0.6, "delta_start": 0.6, "hours": 1.0, "cost": 20.0, "status": "ok",
     "seconds": 41.6},
    {"rung": "micro_batch", "change": "train.micro_batch_size=16", "tok_per_s": 3900.0, "mfu": 0.24,
     "peak_gb": 6.0, "loss": 9.0101, "kept": False, "why": "2.5% slower than the previous rung",
     "numerics": "same", "delta_prev": -0.025, "delta_start": 0.56, "hours": 1.03, "cost": 20.5, "status": "ok"},
    {"rung": "attention", "change": "model.attention=flash", "tok_per_s": None, "mfu": None, "peak_gb": None,
     "loss": None, "kept": False, "why": "out of memory", "numerics": "same", "delta_prev": None,
     "delta_start": None, "hours": None, "cost": None, "status": "oom"},
    {"rung": "precision", "change": "train.precision=bf16", "tok_per_s": 5000.0, "mfu": None, "peak_gb": None,
     "loss": 9.02, "kept": True, "why": "25.0% faster than the previous rung; loss moved 1e-2", "numerics": "changed",
     "delta_prev": 0.25, "delta_start": 1.0, "hours": 0.8, "cost": None, "status": "ok"},
    {"rung": "checkpointing", "change": "train.activation_checkpointing=none", "tok_per_s": None, "mfu": None,
     "peak_gb": None, "loss": None, "kept": False, "why": "budget spent", "numerics": "same", "delta_prev": None,
     "delta_start": None, "hours": None, "cost": None, "status": "skipped"},
]
LADDER = {"device": "NVIDIA H100 80GB HBM3", "budget_minutes": 15.0, "spent_minutes": 3.2,
          "start": {"tok_per_s": 2500.0, "mfu": 0.16, "peak_gb": 3.1, "loss": 9.01,
                    "settings": {"train.compile": "off", "train.micro_batch_size": 8}},
          "rungs": RUNGS, "chosen": {"train.compile": "model", "train.precision": "bf16"}}


def add_ladder(run_dir, ladder=LADDER, keep_rest=True):
    path = run_dir / "preflight.json"
    doc = json.loads(path.read_text()) if keep_rest else {}
    path.write_text(json.dumps(doc | {"ladder": ladder}))
    return run_dir


def ladder_rows(html, run):
    """[{column: (text, value or None)}] of the ladder table of ``run``, in row order."""
    table = re.search(rf'<table class="ladder" data-run="{re.escape(run)}">(.*?)</table>', html, re.S).group(1)
    rows = []
    for m in re.finditer(r'<tr data-rung="(\d+)" data-kept="(true|false)" data-status="([^"]*)">(.*?)</tr>',
                         table, re.S):
        cells = {"_rung": int(m.group(1)), "_kept": m.group(2) == "true", "_status": m.group(3)}
        for col, value, text in re.findall(r'data-col="([^"]+)"(?: data-value="([^"]*)")?>(.*?)</td>', m.group(4)):
            cells[col] = (text, float(value) if value else None)
        rows.append(cells)
    return rows


def test_ladder_section_chart_table_and_ratio(tmp_path):
    ladder_run = add_ladder(write_run(tmp_path, "run-a", lr=3e-3, cuda=True))
    plain = write_run(tmp_path, "run-b", lr=1e-3, cuda=False)
    html = build_report([ladder_run, plain], out=tmp_path / "r.html", png=False).read_text()

    # one section, for the run that has a ladder; linked from the navigation
    assert html.count('<section class="ladder"') == 1 and '<section class="ladder" data-run="run-a">' in html
    assert '<h2 id="Ladder">' in html and '<a href="#Ladder">ladder</a>' in html
    section = html[html.index('<h2 id="Ladder">'):html.index('<h2 id="Training">')]
    assert "NVIDIA H100 80GB HBM3" in section and "3.2 of 15 min spent" in section
    assert "5 rungs tried, 2 kept" in section
    assert "train.compile=model, train.precision=bf16" in section  # the chosen settings
    assert "&lt;1e-3" in section and "<1e-3" not in section  # escaped

    # the chart: a bar per rung with a rate, in rung order from the start; kept filled, rejected hollow grey
    figs = figures(html)
    assert [f for f in figs if f.startswith("ladder")] == ["ladder-0-run-a"]
    svg = figs["ladder-0-run-a"]
    bars = re.findall(r'<rect class="segment" data-series="([^"]+)" data-run="([^"]+)"[^>]*?(fill="[^"]+"[^>]*)>',
                      svg)
    assert [(series, label) for series, label, _ in bars] == [
        ("start", "start"), ("kept", "train.compile=model"), ("rejected", "train.micro_batch_size=16"),
        ("kept", "train.precision=bf16")]
    paint = {label: attrs for _, label, attrs in bars}
    assert paint["train.compile=model"].startswith('fill="#0072B2"')  # the run's colour
    assert paint["train.micro_batch_size=16"].startswith('fill="#ffffff" stroke="#9A9A9A"')  # hollow, grey
    assert "stroke" not in paint["train.compile=model"]
    labels = re.findall(r'text-anchor="end" font-size="12">([^<]*)<title>', svg)
    assert labels == ["start", "train.compile=model", "train.micro_batch_size=16", "model.attention=flash",
                      "train.precision=bf16", "train.activation_checkpointing=none"]
    ends = re.findall(r'<text class="bar-end"[^>]*>([^<]*)</text>', svg)
    assert ends == ["2,500", "4,000", "3,900", "oom", "5,000", "skipped"]
    assert all(f">{name}<" in svg for name in ("start", "kept", "rejected"))  # the legend

    # the table: one row per rung, the start first
    rows = ladder_rows(html, "run-a")
    assert [r["_rung"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["kept"][0] for r in rows] == ["start", "yes", "no", "no (oom)", "yes", "no (skipped)"]
    start, compile_, micro, flash, bf16, _ = rows
    assert start["rung"][0] == "start" and start["change"][0] == "starting configuration"
    assert start["tok_per_s"] == ("2,500", 2500.0) and start["mfu"][0] == "16.0%" and start["peak_gb"][0] == "3.10"
    assert start["delta_prev"][0] == "-" and start["hours"][0] == "-"
    assert compile_["change"][0] == "train.compile=model" and compile_["tok_per_s"] == ("4,000", 4000.0)
    assert compile_["delta_prev"] == ("+60.0%", 0.6) and compile_["delta_start"][0] == "+60.0%"
    assert compile_["hours"] == ("1.00", 1.0) and compile_["cost"] == ("$20.00", 20.0)
    assert compile_["seconds"] == ("42", 41.6) and micro["seconds"] == ("-", None)  # a ladder before seconds
    assert compile_["numerics"][0] == "same" and compile_["why"][0].startswith("60.0% faster")
    assert micro["delta_prev"][0] == "-2.5%" and micro["delta_start"][0] == "+56.0%" and not micro["_kept"]
    assert all(flash[c] == ("-", None) for c in ("tok_per_s", "mfu", "peak_gb", "delta_prev", "hours", "cost"))
    assert flash["_status"] == "oom" and flash["why"][0] == "out of memory"
    assert bf16["mfu"][0] == "-" and bf16["numerics"][0] == "changed" and bf16["delta_start"][0] == "+100.0%"
    assert bf16["hours"][0] == "0.80" and bf16["cost"][0] == "-"

    # ladder vs actual: the last kept rung (5,000) against the run's steady 4,000 tok/s
    m = re.search(r'<p class="ladder-vs-actual" data-run="run-a" data-ladder="([^"]*)" data-actual="([^"]*)" '
                  r'data-ratio="([^"]*)">(.*?)</p>', html, re.S)
    assert float(m.group(1)) == 5000.0 and float(m.group(2)) == 4000.0 and float(m.group(3)) == pytest.approx(0.8)
    assert "rung 4 (train.precision=bf16)" in m.group(4) and "0.80×" in m.group(4)
    cells = comparison_cells(html)
    assert cells[("run-a", "tok_per_s", "actual")] == float(m.group(2))  # the same measured throughput
    # the ladder's start is not the run's preflight prediction: the table still reads 4,500
    assert cells[("run-a", "tok_per_s", "preflight")] == pytest.approx(4500.0)


def test_a_ladder_scaled_out_to_n_ranks_says_so_with_its_scaling_efficiency(tmp_path):
    ranks = {"rung": "ranks", "change": "4 ranks, parallel.strategy=ddp", "tok_per_s": 18000.0, "kept": True,
             "why": "the launch asked for: 3.60x one rank's rate, 90% scaling efficiency", "status": "ok"}
    ladder = {**LADDER, "world": 4, "scaling_efficiency": 0.9, "rungs": [*RUNGS, ranks]}
    run = add_ladder(write_run(tmp_path, "run-a", lr=3e-3, cuda=True), ladder)
    html = build_report([run], out=tmp_path / "r.html", png=False).read_text()
    section = html[html.index('<h2 id="Ladder">'):html.index('<h2 id="Training">')]
    assert "scaled out to 4 ranks at 90% scaling efficiency" in section
    assert "rung 6 (4 ranks, parallel.strategy=ddp)" in section  # the run is compared with the N-rank rate
    one_rank = build_report([add_ladder(write_run(tmp_path, "run-b", lr=3e-3, cuda=True))], out=tmp_path / "s.html",
                            png=False).read_text()
    assert "scaled out" not in one_rank


def test_ladder_vs_actual_from_the_metrics_and_the_start_when_nothing_kept(tmp_path):
    run = write_run(tmp_path, "run-a", lr=3e-3, cuda=False)
    record = json.loads((run / "run.json").read_text())
    del record["result"]  # an interrupted run: the throughput comes from metrics.jsonl after warm-up
    (run / "run.json").write_text(json.dumps(record))
    rejected = [r | {"kept": False} for r in RUNGS]
    add_ladder(run, LADDER | {"rungs": rejected}, keep_rest=False)  # a preflight.json with only the ladder
    html = build_report([run], out=tmp_path / "r.html", png=False).read_text()
    m = re.search(r'data-ladder="([^"]*)" data-actual="([^"]*)" data-ratio="([^"]*)">(.*?)</p>', html, re.S)
    actual = comparison_cells(html)[("run-a", "tok_per_s", "actual")]
    assert 3900 < actual < 3940  # 3900 + step, windows after the first
    assert float(m.group(1)) == 2500.0 and float(m.group(2)) == actual
    assert float(m.group(3)) == pytest.approx(actual / 2500.0) and "the start (no rung kept)" in m.group(4)
    svg = figures(html)["ladder-0-run-a"]
    assert svg.count('data-series="kept"') == 0 and svg.count('data-series="rejected"') == 3
    # the ladder's numbers never stand in for the preflight prediction
    assert comparison_cells(html)[("run-a", "tok_per_s", "preflight")] is None


def test_ladder_that_measured_nothing_keeps_its_table(tmp_path):
    failed = {"device": "cpu", "start": {"tok_per_s": None, "settings": {}},
              "rungs": [RUNGS[2], RUNGS[4]], "chosen": {}}
    run = add_ladder(write_run(tmp_path, "run-a", lr=3e-3, cuda=False), failed)
    html = build_report([run], out=tmp_path / "r.html", png=False).read_text()
    assert not any(f.startswith("ladder") for f in figures(html))  # no bar to draw
    assert [r["_status"] for r in ladder_rows(html, "run-a")] == ["ok", "oom", "skipped"]
    assert 'data-ratio=""' in html and "the ladder measured no tokens/s" in html


def test_no_ladder_no_section(tmp_path):
    run = write_run(tmp_path, "run-a", lr=3e-3, cuda=True)  # preflight.json without "ladder"
    bare = write_run(tmp_path, "run-b", lr=3e-3, cuda=True)
    (bare / "preflight.json").unlink()
    html = build_report([run, bare], out=tmp_path / "r.html", png=False).read_text()
    assert 'class="ladder' not in html and 'id="Ladder"' not in html and 'href="#Ladder"' not in html
    assert "Optimization ladder" not in html and not any(f.startswith("ladder") for f in figures(html))
    assert read_ladder(None) is None and read_ladder({"ladder": None}) is None and read_ladder({}) is None


def test_ladder_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert png_out.available()
    run = add_ladder(write_run(tmp_path, "run-a", lr=3e-3, cuda=True))
    html = build_report([run], out=tmp_path / "r.html").read_text()
    png = tmp_path / "r_figures" / "ladder-0-run-a.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"PNG copies of the {len(figures(html))} figures" in html  # the ladder's among them
