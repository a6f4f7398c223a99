"""Small charts as inline SVG, in pure Python: line charts, stacked bars and heatmaps.

Why our own: the report must be a single HTML file that reads offline, with no
JavaScript, no CDN and no plotting dependency. The chart *specs* below (``LineChart``,
``BarChart``, ``Heatmap``) hold only data and styling; this module draws them as SVG and
``png.py`` draws the same specs with matplotlib, so both outputs show the same thing.

Drawing rules: "nice" ticks (1, 2, 5 x 10^k) on linear axes and decades, 1-2-5 or
linear ticks on log axes; a missing or non-finite value breaks a line rather than
joining its neighbours; very long series are thinned to the min and max of each bucket,
so spikes survive; every label is escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, Union

# Colour-blind-friendly run colours (Okabe-Ito, then Tableau), one per run, cycled after that.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#8C564B",
           "#7F7F7F", "#BCBD22"]
DASHES = {"solid": "", "dashed": "7 4", "dotted": "2 3", "dashdot": "8 3 2 3"}
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', Arial, sans-serif"
MAX_POINTS = 2000  # per drawn line; longer series are thinned (min/max per bucket)

Num = Union[float, None]


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


# --------------------------------------------------------------------------- specs

@dataclass
class Series:
    label: str
    x: Sequence[Num]  # Sequence: a list[float] is one too (a list is invariant)
    y: Sequence[Num]
    color: str
    dash: str = "solid"  # a key of DASHES
    points: bool = False  # a dot at every point: sparse series (validation, evaluation)
    err: Sequence[Num] | None = None  # symmetric error bars, e.g. a standard error
    run: str = ""  # which run it belongs to (a data attribute, for tests and readers of the DOM)


@dataclass
class HLine:
    y: float
    label: str
    color: str = "#555555"
    dash: str = "dashed"


@dataclass
class VLine:
    """A thin dashed vertical line across the plot at ``x``, with a short ``label`` at its top
    (e.g. where a run was resumed) and a longer ``title`` as its tooltip."""

    x: float
    label: str
    color: str = "#555555"
    title: str = ""
    kind: str = "vline"  # its SVG class: what it marks ("resume")


@dataclass
class Marker:
    x: float
    y: float | None  # None: at the top edge (e.g. a non-finite loss)
    label: str
    color: str = "#C00000"


@dataclass
class LineChart:
    id: str
    title: str
    x_label: str
    y_label: str
    series: list[Series]
    log_y: bool = False
    percent: bool = False  # y values are fractions shown as percentages (MFU, accuracy)
    hlines: list[HLine] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    note: str = ""  # a sentence under the chart in the page
    vlines: list[VLine] = field(default_factory=list)  # e.g. the steps (or tokens) a run was resumed at

    def has_data(self) -> bool:
        return any(x is not None and y is not None for s in self.series for x, y in zip(s.x, s.y))


@dataclass
class BarChart:
    """Horizontal stacked bars: one bar per category, one segment per component."""

    id: str
    title: str
    x_label: str
    categories: list[str]
    components: list[tuple[str, str, list[Num]]]  # (label, colour, value per category)
    note: str = ""
    end_labels: list[str] | None = None  # text after each bar instead of its total ("oom" for a bar with none)
    hollow: tuple[str, ...] = ()  # components drawn as outlines, not filled (e.g. rejected candidates)
    label_share: float = 0.35  # the most of the width the category labels may take

    def has_data(self) -> bool:
        return any(v for _, _, values in self.components for v in values)


@dataclass
class Heatmap:
    """A matrix of values (rows x columns) on a colour scale; empty cells for missing values."""

    id: str
    title: str
    x_label: str
    rows: list[str]
    cols: list[float]
    values: list[list[Num]]
    log: bool = True
    note: str = ""

    def has_data(self) -> bool:
        return any(v is not None for row in self.values for v in row)


Chart = Union[LineChart, BarChart, Heatmap]


# --------------------------------------------------------------------------- ticks and numbers

def nice_step(span: float, target: int = 5) -> float:
    """A 1, 2 or 5 x 10^k step giving about ``target`` intervals over ``span``."""
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    f = raw / mag
    return (1 if f < 1.5 else 2 if f < 3 else 5 if f < 7 else 10) * mag


def linear_ticks(lo: float, hi: float, target: int = 5) -> tuple[float, float, list[float]]:
    """(domain low, domain high, ticks): the domain widened to whole steps."""
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, target)
    start, stop = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    n = int(round((stop - start) / step))
    ticks = [_clean(start + i * step) for i in range(n + 1)]
    return ticks[0], ticks[-1], ticks


def log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Ticks of a log axis over positive [lo, hi]: decades over a wide range, 1-2-5 over a
    decade or two, plain linear steps within less than a decade (a loss from 6 to 3)."""
    if hi <= lo:
        lo, hi = lo / 1.5, hi * 1.5
    decades = math.log10(hi) - math.log10(lo)
    if decades >= 2.5:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        every = max(1, math.ceil((b - a) / 8))
        ticks = [10.0 ** k for k in range(a, b + 1, every)]
        return 10.0 ** a, 10.0 ** b, ticks
    if decades >= 0.8:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        cands = [_clean(m * 10.0 ** k) for k in range(a, b + 1) for m in (1, 2, 5)]
        below = [c for c in cands if c <= lo * (1 + 1e-9)]
        above = [c for c in cands if c >= hi * (1 - 1e-9)]
        d_lo, d_hi = (below[-1] if below else lo), (above[0] if above else hi)
        return d_lo, d_hi, [c for c in cands if d_lo <= c <= d_hi]
    step = nice_step(hi - lo, 5)
    d_lo = math.floor(lo / step + 1e-9) * step
    d_lo = _clean(d_lo) if d_lo > 0 else lo
    d_hi = _clean(math.ceil(hi / step - 1e-9) * step)
    n = int(round((d_hi - d_lo) / step))
    ticks = [t for t in (_clean(d_lo + i * step) for i in range(n + 1)) if t > 0]
    return d_lo, d_hi, ticks


def _clean(v: float) -> float:
    """Drop float noise (0.30000000000000004 -> 0.3)."""
    return 0.0 if v == 0 else float(f"{v:.12g}")


def fmt_tick(v: float, step: float | None = None, percent: bool = False) -> str:
    """A tick label: 1.5K/2M for large numbers, 3e-4 for small ones, just enough decimals."""
    if percent:
        return fmt_tick(v * 100, step * 100 if step else None) + "%"
    if v == 0:
        return "0"
    a = abs(v)
    for unit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if a >= unit:
            return f"{v / unit:.3f}".rstrip("0").rstrip(".") + suffix
    if a < 1e-2:
        mantissa, exp = f"{v:.2e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
    decimals = 3 if step is None else max(0, min(6, -math.floor(math.log10(step) + 1e-9)))
    text = f"{v:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


# --------------------------------------------------------------------------- drawing helpers

def _text_width(text: str, size: float) -> float:
    return 0.58 * size * len(text)


def _thin(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most ~``limit`` points: the lowest and highest of each bucket, in x order."""
    if len(points) <= limit:
        return points
    per = math.ceil(len(points) / (limit // 2))
    out: list[tuple[float, float]] = []
    for i in range(0, len(points), per):
        bucket = points[i:i + per]
        lo, hi = min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out


def _finite(v: Num) -> TypeGuard[float]:
    """A value a chart can place: not missing, not NaN, not infinite."""
    return v is not None and math.isfinite(v)


def _positive(v: Num) -> TypeGuard[float]:
    """A value a log-scale chart can place: finite and above 0."""
    return _finite(v) and v > 0


def error_bar(y: Num, e: Num, log_y: bool = False) -> tuple[float, float] | None:
    """The ends ``(y - e, y + e)`` of an error bar a chart can draw, or None: the value and the
    error finite, the error not negative (a standard error never is: a file that says so is
    wrong), both ends placeable on the axis (above 0 on a log scale) and the span between them a
    float (a bar of 1e308 either side would stretch the axis past infinity). A NaN value with a
    finite error, a diverged step's, draws no bar: the point is a gap in its line."""
    if not (_finite(y) and _finite(e)) or e < 0:
        return None
    lo, hi = y - e, y + e
    ok = _positive if log_y else _finite
    return (lo, hi) if ok(lo) and ok(hi) and math.isfinite(hi - lo) else None


def _segments(xs: Sequence[Num], ys: Sequence[Num],
              ok: Callable[[Num], TypeGuard[float]]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive points whose y passes ``ok``; a point that does not ends a segment."""
    segs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys):
        if not _finite(x) or not ok(y):
            if segs[-1]:
                segs.append([])
            continue
        segs[-1].append((x, y))
    return [s for s in segs if s]


def _legend(entries: list[tuple[str, str, str, bool]], x0: float, y0: float, width: float,
            size: float = 12) -> tuple[list[str], float]:
    """Legend entries (label, colour, dash, points) wrapped into rows; returns (svg parts, height)."""
    parts, x, y, row_h = [], x0, y0, size + 7
    for label, color, dash, points in entries:
        w = 26 + _text_width(label, size) + 14
        if x + w > x0 + width and x > x0:
            x, y = x0, y + row_h
        cy = y + row_h / 2
        dash_attr = f' stroke-dasharray="{DASHES.get(dash, "")}"' if DASHES.get(dash) else ""
        parts.append(f'<line x1="{x:.1f}" y1="{cy:.1f}" x2="{x + 20:.1f}" y2="{cy:.1f}" stroke="{esc(color)}" '
                     f'stroke-width="2.2"{dash_attr}/>')
        if points:
            parts.append(f'<circle cx="{x + 10:.1f}" cy="{cy:.1f}" r="2.6" fill="{esc(color)}"/>')
        parts.append(f'<text x="{x + 25:.1f}" y="{cy + size * 0.36:.1f}" font-size="{size}">{esc(label)}</text>')
        x += w
    return parts, (y - y0 + row_h if entries else 0.0)


def _open(chart_id: str, kind: str, title: str, width: float, height: float) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-figure="{esc(chart_id)}" '
            f'data-kind="{kind}" viewBox="0 0 {width:.0f} {height:.0f}" width="100%" role="img" '
            f'aria-label="{esc(title)}" font-family="{esc(FONT)}" fill="#222">'
            f'<title>{esc(title)}</title>'
            f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>')


# --------------------------------------------------------------------------- line chart

@dataclass
class _Plot:
    """A line chart's plot area in the SVG, and where a data point lands in it."""

    left: float
    top: float
    width: float
    height: float
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    log_y: bool

    def sx(self, x: float) -> float:
        return self.left + (x - self.x_lo) / (self.x_hi - self.x_lo) * self.width

    def sy(self, y: float) -> float:
        if self.log_y:
            f = (math.log10(y) - math.log10(self.y_lo)) / (math.log10(self.y_hi) - math.log10(self.y_lo))
        else:
            f = (y - self.y_lo) / (self.y_hi - self.y_lo)
        return self.top + self.height - f * self.height


def line_chart_svg(c: LineChart, width: float = 600, plot_height: float = 270) -> str:
    # what a y must be to be drawn (NaN and infinities, e.g. a diverged loss, never reach a coordinate)
    ok = _positive if c.log_y else _finite
    segs_by_series = [_segments(s.x, s.y, ok) for s in c.series]
    xs_all, ys_all = _line_extent(c, segs_by_series, ok)
    if not xs_all or not ys_all:
        return _empty_svg(c.id, c.title, width)

    x_lo, x_hi, x_ticks = linear_ticks(min(xs_all), max(xs_all))
    if x_hi > max(xs_all) > min(xs_all) and len(x_ticks) > 2:  # end at the data, not a round number
        x_hi = max(xs_all)
        x_ticks = [t for t in x_ticks if t <= x_hi]
    if c.log_y:
        y_lo, y_hi, y_ticks = log_ticks(min(ys_all), max(ys_all))
    else:
        y_lo, y_hi, y_ticks = linear_ticks(min(ys_all), max(ys_all))
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else None
    y_step = _tick_step(y_ticks)
    y_labels = [fmt_tick(t, y_step, c.percent) for t in y_ticks]
    x_labels = [fmt_tick(t, x_step) for t in x_ticks]

    size = 12
    left = 14 + 16 + max(_text_width(t, size) for t in y_labels) + 6
    right, top = 18, 14
    plot = _Plot(left, top, width - left - right, plot_height, x_lo, x_hi, y_lo, y_hi, c.log_y)

    entries = [(s.label, s.color, s.dash, s.points) for s, segs in zip(c.series, segs_by_series) if segs]
    entries += [(h.label, h.color, h.dash, False) for h in c.hlines]
    legend_y = top + plot.height + 40
    legend, legend_h = _legend(entries, left, legend_y, plot.width, size)
    height = legend_y + legend_h + 8

    clip = f"clip-{_safe_id(c.id)}"
    out = [_open(c.id, "line", c.title, width, height),
           f'<defs><clipPath id="{clip}"><rect x="{left:.1f}" y="{top - 2:.1f}" width="{plot.width:.1f}" '
           f'height="{plot.height + 4:.1f}"/></clipPath></defs>']
    out += _line_axes(c, plot, list(zip(x_ticks, x_labels)), list(zip(y_ticks, y_labels)), size)
    # reference lines, series, error bars, markers (clipped to the plot area)
    out.append(f'<g clip-path="url(#{clip})">')
    out += _line_data(c, plot, segs_by_series, ok)
    out.append("</g>")
    out.extend(legend)
    out.append("</svg>")
    return "".join(out)


def _line_extent(c: LineChart, segs_by_series: list[list[list[tuple[float, float]]]],
                 ok: Callable[[float], bool]) -> tuple[list[float], list[float]]:
    """Every x and every y the chart must show: the series' points (and error bars), the
    reference lines and the markers' x."""
    xs_all: list[float] = []
    ys_all: list[float] = []
    for s, segs in zip(c.series, segs_by_series):
        for seg in segs:
            xs_all.extend(p[0] for p in seg)
            ys_all.extend(p[1] for p in seg)
        if s.err:
            ys_all.extend(v for x, y, e in zip(s.x, s.y, s.err) if _finite(x) for v in error_bar(y, e, c.log_y) or ())
    ys_all += [h.y for h in c.hlines if ok(h.y)]
    # markers above the data sit on the top edge rather than squash it
    xs_all += [m.x for m in c.markers if _finite(m.x)]
    xs_all += [v.x for v in c.vlines if _finite(v.x)]
    return xs_all, ys_all


def _line_axes(c: LineChart, plot: _Plot, x_ticks: list[tuple[float, str]], y_ticks: list[tuple[float, str]],
               size: float) -> list[str]:
    """The grid, the axes, their ticks (value, label) and the axis labels."""
    left, top, pw, ph, sx, sy = plot.left, plot.top, plot.width, plot.height, plot.sx, plot.sy
    out = ['<g class="grid" stroke="#e3e3e3" stroke-width="1">']
    for t, _ in y_ticks:
        out.append(f'<line x1="{left:.1f}" y1="{sy(t):.1f}" x2="{left + pw:.1f}" y2="{sy(t):.1f}"/>')
    for t, _ in x_ticks:
        out.append(f'<line x1="{sx(t):.1f}" y1="{top:.1f}" x2="{sx(t):.1f}" y2="{top + ph:.1f}"/>')
    out.append("</g>")
    out.append(f'<g class="axes" stroke="#444" stroke-width="1"><line x1="{left:.1f}" y1="{top + ph:.1f}" '
               f'x2="{left + pw:.1f}" y2="{top + ph:.1f}"/><line x1="{left:.1f}" y1="{top:.1f}" '
               f'x2="{left:.1f}" y2="{top + ph:.1f}"/></g>')
    out.append(f'<g class="ticks" font-size="{size}">')
    for t, label in y_ticks:
        out.append(f'<text x="{left - 6:.1f}" y="{sy(t) + 4:.1f}" text-anchor="end">{esc(label)}</text>')
    for t, label in x_ticks:
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16:.1f}" text-anchor="middle">{esc(label)}</text>')
    out.append("</g>")
    out.append(f'<text class="xlabel" x="{left + pw / 2:.1f}" y="{top + ph + 33:.1f}" text-anchor="middle" '
               f'font-size="{size + 1}">{esc(c.x_label)}</text>')
    ylab = c.y_label + (" (log scale)" if c.log_y else "")
    out.append(f'<text class="ylabel" x="14" y="{top + ph / 2:.1f}" text-anchor="middle" font-size="{size + 1}" '
               f'transform="rotate(-90 14 {top + ph / 2:.1f})">{esc(ylab)}</text>')
    return out


def _line_data(c: LineChart, plot: _Plot, segs_by_series: list[list[list[tuple[float, float]]]],
               ok: Callable[[float], bool]) -> list[str]:
    """The reference lines, the series (thinned; their points where asked or alone), the error
    bars and the markers."""
    left, top, pw, sx, sy = plot.left, plot.top, plot.width, plot.sx, plot.sy
    out = []
    for h in c.hlines:
        if ok(h.y):
            out.append(f'<line class="hline" x1="{left:.1f}" y1="{sy(h.y):.1f}" x2="{left + pw:.1f}" '
                       f'y2="{sy(h.y):.1f}" stroke="{esc(h.color)}" stroke-width="1.3" '
                       f'stroke-dasharray="{DASHES.get(h.dash, "")}"><title>{esc(h.label)}</title></line>')
    for s, segs in zip(c.series, segs_by_series):
        if not segs:
            continue
        dash = DASHES.get(s.dash, "")
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        d = " ".join("M" + " L".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in _thin(seg)) for seg in segs)
        out.append(f'<path class="series" data-series="{esc(s.label)}" data-run="{esc(s.run)}" d="{d}" '
                   f'fill="none" stroke="{esc(s.color)}" stroke-width="1.8" stroke-linejoin="round"{dash_attr}>'
                   f'<title>{esc(s.label)}</title></path>')
        lone = [seg[0] for seg in segs if len(seg) == 1]  # a single point draws no line: show it
        pts = [p for seg in segs for p in seg] if s.points else lone
        for x, y in pts[:MAX_POINTS]:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{esc(s.color)}">'
                       f'<title>{esc(s.label)}: {esc(fmt_tick(y, None, c.percent))} at {esc(fmt_tick(x))}</title>'
                       f'</circle>')
        if s.err:
            for xi, yi, e in zip(s.x, s.y, s.err):
                ends = error_bar(yi, e, c.log_y)
                if ends is None or not _finite(xi):
                    continue
                px, y0, y1 = sx(xi), sy(ends[0]), sy(ends[1])
                out.append(f'<path class="errorbar" d="M{px:.1f},{y0:.1f} L{px:.1f},{y1:.1f} M{px - 3:.1f},{y0:.1f} '
                           f'L{px + 3:.1f},{y0:.1f} M{px - 3:.1f},{y1:.1f} L{px + 3:.1f},{y1:.1f}" '
                           f'stroke="{esc(s.color)}" stroke-width="1" fill="none"/>')
    out += _vlines(c.vlines, plot)
    for m in c.markers:
        if not _finite(m.x):
            continue
        px = sx(m.x)
        py = top + 8 if m.y is None or not ok(m.y) or m.y > plot.y_hi else max(top + 8, sy(m.y) - 6)
        out.append(f'<path class="marker" d="M{px - 5:.1f},{py - 7:.1f} L{px + 5:.1f},{py - 7:.1f} '
                   f'L{px:.1f},{py + 1:.1f} Z" fill="{esc(m.color)}" stroke="#fff" stroke-width="0.8">'
                   f'<title>{esc(m.label)}</title></path>')
    return out


def _vlines(vlines: list[VLine], plot: _Plot) -> list[str]:
    """Each vertical line, dashed, its label at the top beside it (on its left near the right
    edge); a label that would overlap the one before is left to the tooltip."""
    out, labelled = [], -math.inf
    for v in sorted((v for v in vlines if _finite(v.x)), key=lambda v: v.x):
        px, size = plot.sx(v.x), 10
        width = _text_width(v.label, size)
        right = px + 3 + width <= plot.left + plot.width
        text = ""
        if px - labelled >= width + 8:
            tx = px + 3 if right else px - 3
            text = (f'<text x="{tx:.1f}" y="{plot.top + size:.1f}" font-size="{size}" fill="{esc(v.color)}" '
                    f'text-anchor="{"start" if right else "end"}">{esc(v.label)}</text>')
            labelled = px
        out.append(f'<g class="{esc(v.kind)}" data-x="{v.x!r}"><title>{esc(v.title or v.label)}</title>'
                   f'<line x1="{px:.1f}" y1="{plot.top:.1f}" x2="{px:.1f}" y2="{plot.top + plot.height:.1f}" '
                   f'stroke="{esc(v.color)}" stroke-width="1" stroke-dasharray="{DASHES["dashed"]}"/>{text}</g>')
    return out


def _tick_step(ticks: list[float]) -> float | None:
    steps = [b - a for a, b in zip(ticks, ticks[1:]) if b > a]
    return min(steps) if steps else None


def _safe_id(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)


def _empty_svg(chart_id: str, title: str, width: float) -> str:
    return (_open(chart_id, "empty", title, width, 60)
            + f'<text x="{width / 2:.0f}" y="34" text-anchor="middle" font-size="12" fill="#777">no data</text></svg>')


# --------------------------------------------------------------------------- stacked bars

def bar_chart_svg(c: BarChart, width: float = 600) -> str:
    totals = [sum(v[i] or 0.0 for _, _, v in c.components) for i in range(len(c.categories))]
    if not c.categories or max(totals, default=0) <= 0:
        return _empty_svg(c.id, c.title, width)
    size = 12
    _, x_hi, ticks = linear_ticks(0.0, max(totals))
    step = _tick_step(ticks)
    left = 14 + max(_text_width(name, size) for name in c.categories)
    left = min(left, width * c.label_share)
    right, top, bar_h, gap = 70, 10, 24, 12
    pw = width - left - right
    ph = len(c.categories) * (bar_h + gap) + gap

    def sx(v: float) -> float:
        return left + v / x_hi * pw

    legend_y = top + ph + 40
    legend, legend_h = _legend([(label, color, "solid", False) for label, color, _ in c.components],
                               left, legend_y, pw, size)
    height = legend_y + legend_h + 8
    out = [_open(c.id, "bar", c.title, width, height), '<g stroke="#e3e3e3">']
    for t in ticks:
        out.append(f'<line x1="{sx(t):.1f}" y1="{top:.1f}" x2="{sx(t):.1f}" y2="{top + ph:.1f}"/>')
    out.append(f'</g><line x1="{left:.1f}" y1="{top + ph:.1f}" x2="{left + pw:.1f}" y2="{top + ph:.1f}" '
               f'stroke="#444"/><g font-size="{size}">')
    for t in ticks:
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16:.1f}" text-anchor="middle">'
                   f'{esc(fmt_tick(t, step))}</text>')
    out.append("</g>")
    out.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 33:.1f}" text-anchor="middle" '
               f'font-size="{size + 1}">{esc(c.x_label)}</text>')
    for i, name in enumerate(c.categories):
        y = top + gap + i * (bar_h + gap)
        shown = name if _text_width(name, size) <= left - 10 else name[: int((left - 10) / (0.58 * size)) - 1] + "…"
        out.append(f'<text x="{left - 6:.1f}" y="{y + bar_h / 2 + 4:.1f}" text-anchor="end" font-size="{size}">'
                   f'{esc(shown)}<title>{esc(name)}</title></text>')
        x = 0.0
        for label, color, values in c.components:
            v = values[i] or 0.0
            if v <= 0:
                continue
            w = sx(x + v) - sx(x)
            hollow = label in c.hollow
            paint = (f'fill="#ffffff" stroke="{esc(color)}" stroke-width="1.5" stroke-dasharray="4 2"' if hollow
                     else f'fill="{esc(color)}"')
            out.append(f'<rect class="segment" data-series="{esc(label)}" data-run="{esc(name)}" '
                       f'x="{sx(x):.1f}" y="{y:.1f}" width="{w:.1f}" height="{bar_h}" {paint}>'
                       f'<title>{esc(name)} · {esc(label)}: {esc(fmt_tick(v, step / 100 if step else None))} '
                       f'{esc(c.x_label)}</title></rect>')
            text = fmt_tick(v, step / 10 if step else None)
            if w > _text_width(text, size - 1) + 6:
                out.append(f'<text x="{sx(x) + w / 2:.1f}" y="{y + bar_h / 2 + 4:.1f}" text-anchor="middle" '
                           f'font-size="{size - 1}" fill="{esc(color) if hollow else "#fff"}">{esc(text)}</text>')
            x += v
        end = c.end_labels[i] if c.end_labels is not None else fmt_tick(totals[i], step / 10 if step else None)
        out.append(f'<text class="bar-end" x="{sx(totals[i]) + 5:.1f}" y="{y + bar_h / 2 + 4:.1f}" '
                   f'font-size="{size}">{esc(end)}</text>')
    out.extend(legend)
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------- heatmap

# Viridis at seven stops: dark blue (low) to yellow (high).
_VIRIDIS = [(68, 1, 84), (68, 57, 131), (49, 104, 142), (33, 145, 140), (53, 183, 121), (143, 215, 68),
            (253, 231, 37)]


def colormap(f: float) -> str:
    f = min(1.0, max(0.0, f)) * (len(_VIRIDIS) - 1)
    i = min(int(f), len(_VIRIDIS) - 2)
    t = f - i
    rgb = [round(a + (b - a) * t) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1])]
    return "#" + "".join(f"{v:02x}" for v in rgb)


def heatmap_svg(c: Heatmap, width: float = 600) -> str:
    vals = [v for row in c.values for v in row if v is not None and (v > 0 or not c.log)]
    if not vals or not c.rows or not c.cols:
        return _empty_svg(c.id, c.title, width)
    tr = (lambda v: math.log10(v)) if c.log else (lambda v: v)
    lo, hi = tr(min(vals)), tr(max(vals))
    span = (hi - lo) or 1.0
    size = 10
    cell_h = max(3.0, min(14.0, 420 / len(c.rows)))
    label_every = max(1, math.ceil(11 / cell_h))
    left = min(14 + max(_text_width(r, size) for r in c.rows), width * 0.42)
    right, top = 78, 10
    pw = width - left - right
    ph = cell_h * len(c.rows)
    cell_w = pw / len(c.cols)
    height = top + ph + 44
    out = [_open(c.id, "heatmap", c.title, width, height)]
    for i, (name, row) in enumerate(zip(c.rows, c.values)):
        y = top + i * cell_h
        if i % label_every == 0:
            max_chars = int((left - 8) / (0.58 * size))
            shown = name if len(name) <= max_chars else "…" + name[-(max_chars - 1):]
            out.append(f'<text x="{left - 4:.1f}" y="{y + min(cell_h, 11) - 2:.1f}" text-anchor="end" '
                       f'font-size="{size}">{esc(shown)}<title>{esc(name)}</title></text>')
        for j, v in enumerate(row):
            if v is None or (c.log and v <= 0):
                continue
            out.append(f'<rect x="{left + j * cell_w:.2f}" y="{y:.2f}" width="{cell_w + 0.3:.2f}" '
                       f'height="{cell_h + 0.3:.2f}" fill="{colormap((tr(v) - lo) / span)}">'
                       f'<title>{esc(name)} · step {esc(fmt_tick(c.cols[j]))}: {v:.4g}</title></rect>')
    # x ticks: about six column labels
    every = max(1, math.ceil(len(c.cols) / 6))
    for j in range(0, len(c.cols), every):
        out.append(f'<text x="{left + (j + 0.5) * cell_w:.1f}" y="{top + ph + 14:.1f}" text-anchor="middle" '
                   f'font-size="{size}">{esc(fmt_tick(c.cols[j]))}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 32:.1f}" text-anchor="middle" '
               f'font-size="{size + 1}">{esc(c.x_label)}</text>')
    # colour bar
    bx, bh = width - right + 14, min(ph, 200)
    for k in range(40):
        out.append(f'<rect x="{bx:.1f}" y="{top + bh * (1 - (k + 1) / 40):.2f}" width="12" '
                   f'height="{bh / 40 + 0.3:.2f}" fill="{colormap((k + 0.5) / 40)}"/>')
    for f, v in ((1.0, hi), (0.0, lo)):
        value = 10 ** v if c.log else v
        out.append(f'<text x="{bx + 16:.1f}" y="{top + bh * (1 - f) + 4:.1f}" font-size="{size}">'
                   f'{esc(f"{value:.3g}")}</text>')
    if c.log:
        out.append(f'<text x="{bx:.1f}" y="{top + bh + 14:.1f}" font-size="{size - 1}" fill="#555">log scale</text>')
    out.append("</svg>")
    return "".join(out)


def render(chart: Chart) -> str:
    """The chart as an ``<svg>`` element string."""
    if isinstance(chart, LineChart):
        return line_chart_svg(chart)
    if isinstance(chart, BarChart):
        return bar_chart_svg(chart)
    return heatmap_svg(chart)
