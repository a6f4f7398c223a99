"""Issue 54 (the fourth list), item 18: the report's predictions that coincide, its legends, and
the PNG's log-axis ticks -- on a run directory written as flopwise train writes it, through
build_report, the function `flopwise report` calls."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_report import figures, write_run  # noqa: E402

from flopwise.report.report import build_report  # noqa: E402


def _memory_svg(html: str) -> str:
    return next(svg for fid, svg in figures(html).items() if "memory" in fid)


def test_plan_and_preflight_memory_that_coincide_are_one_line_naming_both(tmp_path):
    run = write_run(tmp_path, "a-rather-long-run-name-of-the-users-2026-11-28", lr=3e-3, cuda=True)
    (run / "preflight.json").write_text(json.dumps({"measured": {"tok_per_s": 4500.0, "mfu": 0.35},
                                                    "memory_gb": 2.01}))  # the plan's 2.0 within 2%
    html = build_report([run], png=False).read_text()
    svg = _memory_svg(html)
    assert "plan 2 = preflight 2.01" in svg, re.findall(r"<text[^>]*>([^<]*(?:plan|preflight)[^<]*)</text>", svg)
    # one run: no legend repeats its name (the page's title says it)
    legends = re.findall(r"<text[^>]*>([^<]*)</text>", html)
    assert not [t for t in legends if t.startswith("a-rather-long-run-name-of-the-users-2026-11-28 · ")], legends


def test_predictions_apart_stay_two_lines_and_two_runs_keep_their_names(tmp_path):
    a = write_run(tmp_path, "run-a", lr=3e-3, cuda=True)
    b = write_run(tmp_path, "run-b", lr=1e-3, cuda=True)
    html = build_report([a, b], png=False).read_text()
    svg = _memory_svg(html)
    assert "run-a · plan" in svg and "run-a · preflight" in svg and " = " not in svg  # 2.0 and 2.4 GiB apart


def test_the_png_log_axis_ticks_are_plain_numbers(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from flopwise.report import png
    from flopwise.report.svg import LineChart, Series

    chart = LineChart("loss", "Loss", "tokens", "loss", [Series("train", [1, 2, 3], [9.0, 6.0, 3.5], "#000")],
                      log_y=True)
    ax = Figure().add_subplot()
    png._line(ax, chart)
    major, minor = ax.yaxis.get_major_formatter(), ax.yaxis.get_minor_formatter()
    assert [major(v, 0) for v in (1.0, 10.0)] == ["1", "10"] and minor(6.0, 0) == "6", (major(6.0, 0), minor(6.0, 0))
