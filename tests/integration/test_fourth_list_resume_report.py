"""Issue 54 (the fourth list), item 6: a resumed run's report compared unlike figures -- the
measured tokens/s and MFU were the last start's (run.json is rewritten at each start) while the
wall time was summed over every start. Now every measured figure of the plan-vs-measured table
is the whole run's, the report says how many starts the run had and where it resumed, and the
charts mark the resume points.

Through the real commands: ``flopwise train`` for a few steps, resumed with more steps, then
``flopwise report`` (``flopwise.cli.main``); the expected whole-run figure is worked out here
from metrics.jsonl, window by window, apart from the report's code."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_report import comparison_cells, figures  # noqa: E402

from flopwise.cli import main  # noqa: E402
from flopwise.config import build_config  # noqa: E402
from flopwise.report import png as png_out  # noqa: E402

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=2", "train.checkpoint_every=10"]
WARMUP = 3  # train.warmup_log_steps' default: the steps each start leaves out of its averages


def training_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if isinstance(r.get("loss"), float) and "event" not in r), key=lambda r: r["step"])


def steady(rows: list[dict], at: int, end: float) -> tuple[float, float]:
    """(tokens, seconds) of a start's logged windows after its warm-up: those whose steps all
    come ``WARMUP`` or more steps after the step the start began at."""
    tokens = seconds = 0.0
    prev_step, prev_tokens = at, None
    for r in (r for r in rows if at < r["step"] <= end):
        if prev_step - at >= WARMUP and prev_tokens is not None:
            n = r["tokens"] - prev_tokens
            tokens, seconds = tokens + n, seconds + n / r["tok_per_s"]
        prev_step, prev_tokens = r["step"], r["tokens"]
    return tokens, seconds


def report(run: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert f"report: {run / 'report.html'}" in capsys.readouterr().out
    return (run / "report.html").read_text()


@pytest.mark.slow
def test_a_resumed_runs_report_gives_whole_run_figures_and_marks_the_resume(tiny_overrides, tmp_path, capsys):
    run = Path(build_config(overrides=tiny_overrides).train.run_dir)
    assert main(["train", *tiny_overrides, *QUIET, "train.max_steps=10"]) == 0
    single = tmp_path / "single"  # the run as it was after one start: its report must not change
    subprocess.run(["cp", "-r", str(run), str(single)], check=True)
    assert main(["train", "--config", str(run / "config.yaml"), "train.max_steps=20"]) == 0

    record = json.loads((run / "run.json").read_text())
    starts = record["starts"]
    assert [s["at_step"] for s in starts] == [0, 10]
    rows = training_rows(run)
    first, second = steady(rows, 0, 10), steady(rows, 10, math.inf)
    assert first[1] > 0 and second[1] > 0, rows
    # each start's own average is kept in run.json (the result is the last start's alone)
    assert starts[0]["tok_per_s"] == pytest.approx(first[0] / first[1], rel=1e-6)
    assert starts[1]["tok_per_s"] == pytest.approx(second[0] / second[1], rel=1e-6)
    assert record["result"]["tok_per_s"] == pytest.approx(second[0] / second[1], rel=1e-6)
    whole = (first[0] + second[0]) / (first[1] + second[1])  # every start's steady tokens over their time

    html = report(run, capsys)
    cells = comparison_cells(html)
    assert cells[("run", "tok_per_s", "actual")] == pytest.approx(whole, rel=1e-9), (
        cells[("run", "tok_per_s", "actual")], whole, record["result"]["tok_per_s"])
    assert cells[("run", "mfu", "actual")] is None  # a CPU: no peak, in either start
    last_elapsed = [r["elapsed_s"] for r in rows if r["step"] in (10, 20)]
    assert cells[("run", "wall_time_s", "actual")] == pytest.approx(sum(last_elapsed))
    # the table and the run card say the run had two starts and where it resumed
    table = html[html.index('id="plan-vs-actual"'):html.index("</table>", html.index('id="plan-vs-actual"'))]
    assert "2 starts · resumed at step 10" in table, table[:3000]
    assert re.search(r"average after warm-up over all 2 starts", table), table[:3000]
    assert re.search(r"<dt>starts</dt><dd>2 · resumed at step 10", html), html[html.index("<dt>status"):][:2000]

    figs = figures(html)
    for fid in ("loss", "throughput"):
        assert figs[fid].count('class="resume"') == 1 and ">resumed</text>" in figs[fid], figs[fid][-3000:]
    assert "resumed at step 10" in figs["loss"]
    if png_out.available():
        loss_png = run / "report_figures" / "loss.png"
        assert loss_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # one start: today's figures exactly (run.json's average), and nothing said of resumes
    html = report(single, capsys)
    one = json.loads((single / "run.json").read_text())
    assert comparison_cells(html)[("single", "tok_per_s", "actual")] == one["result"]["tok_per_s"]
    assert 'class="resume"' not in html and "resumed at" not in html and "<dt>starts</dt>" not in html
    assert "over all" not in html and "starts' times" not in html


@pytest.mark.skipif(not png_out.available(), reason="matplotlib is not installed")
def test_the_png_marks_each_resume_with_a_dashed_line_and_its_label():
    from matplotlib.figure import Figure

    from flopwise.report.svg import LineChart, Series, VLine

    chart = LineChart("loss", "Loss", "tokens", "loss", [Series("train", [1, 2, 3, 4], [9.0, 6.0, 5.0, 4.0], "#000")],
                      vlines=[VLine(2.5, "resumed", "#0072B2", "resumed at step 10")])
    ax = Figure().add_subplot()
    png_out._line(ax, chart)
    vertical = [ln for ln in ax.lines if list(ln.get_xdata()) == [2.5, 2.5]]
    assert len(vertical) == 1 and vertical[0].get_linestyle() == "--"
    assert [t.get_text() for t in ax.texts] == ["resumed"]
