"""A chart's NaN value with a finite error bar -- a diverged step's loss, a task scored on nothing
-- is a gap in its line and draws no bar, in the page's SVG and in the PNG alike; an error bar the
axis cannot hold (negative, or spanning past the largest float) is left out. Never a crash
(issue 43, item 4)."""

from __future__ import annotations

import math
import re

import pytest

from flopwise.report import png
from flopwise.report.svg import LineChart, Series, error_bar, line_chart_svg

NAN = float("nan")
needs_matplotlib = pytest.mark.skipif(not png.available(), reason="matplotlib is not installed ([report] extra)")


def chart(ys, errs, log_y):
    return LineChart("c", "t", "tokens", "loss", [Series("s", list(range(1, len(ys) + 1)), ys, "#000", points=True,
                                                          err=errs)], log_y=log_y)


def coordinates(svg: str) -> list[str]:
    return re.findall(r'(?:x|y|x1|y1|x2|y2|cx|cy)="([^"]*)"', svg) + re.findall(r' d="([^"]*)"', svg)


CASES = {
    "a NaN between finite values": ([1.0, NAN, 2.0], [0.1, 0.1, 0.1], 2),
    "only NaN values": ([NAN, NAN], [0.1, 0.1], 0),
    "a negative error": ([1.0, 2.0], [-0.1, 0.1], 1),
    "an error past the largest float's span": ([1.0, 2.0], [0.1, 1e308], 1),
}


@pytest.mark.parametrize("log_y", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_svg_draws_the_bars_it_can_and_gaps_the_nan(case, log_y):
    ys, errs, bars = CASES[case]
    svg = line_chart_svg(chart(ys, errs, log_y))
    assert not [c for c in coordinates(svg) if re.search(r"nan|inf", c, re.I)], svg
    assert svg.count('class="errorbar"') == bars
    assert svg.count("<title>s: ") == sum(math.isfinite(y) for y in ys)  # a dot per placed point, none for NaN


def test_a_nan_splits_the_line_into_two():
    svg = line_chart_svg(chart([1.0, 1.5, NAN, 2.0, 2.5], [0.1] * 5, log_y=False))
    d = re.search(r'class="series"[^>]* d="([^"]+)"', svg).group(1)
    assert d.count("M") == 2  # (1, 1.0)-(2, 1.5), a gap at 3, (4, 2.0)-(5, 2.5)


@needs_matplotlib
@pytest.mark.parametrize("log_y", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_png_draws_the_same_chart_without_raising(case, log_y):
    ys, errs, _ = CASES[case]
    image = png.render_png(chart(ys, errs, log_y))
    assert image.startswith(b"\x89PNG")


def test_error_bar_is_one_rule():
    assert error_bar(1.0, 0.25) == (0.75, 1.25)
    assert error_bar(NAN, 0.1) is None and error_bar(None, 0.1) is None and error_bar(1.0, NAN) is None
    assert error_bar(1.0, -0.1) is None
    assert error_bar(0.5, 1.0) == (-0.5, 1.5) and error_bar(0.5, 1.0, log_y=True) is None  # below 0 on a log axis
    assert error_bar(1.0, 1e308) is None
