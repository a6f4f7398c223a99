"""The report's charts as PNG files, drawn with matplotlib when it is installed.

The same chart specs as the SVG (``svg.py``), so slides and notes can carry the same
figures as the page. matplotlib is optional (``pip install 'flopwise[report]'``); its
object-oriented API is used without pyplot, so no global backend is switched and no
window is ever opened.
"""

from __future__ import annotations

import importlib.util
import io
import math
from pathlib import Path

from flopwise.fsio import write_file
from flopwise.report.svg import BarChart, Chart, Heatmap, LineChart, error_bar

_LINESTYLES = {"solid": "-", "dashed": "--", "dotted": ":", "dashdot": "-."}


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _nan(values):
    return [math.nan if v is None else v for v in values]


def _line(ax, c: LineChart) -> None:
    from matplotlib.ticker import FuncFormatter, PercentFormatter  # lazy: matplotlib is optional ([report])

    for s in c.series:
        ys = _nan(s.y)
        if c.log_y:
            ys = [y if y > 0 else math.nan for y in ys]
        style = dict(color=s.color, linestyle=_LINESTYLES.get(s.dash, "-"), linewidth=1.6, label=s.label)
        if s.points:
            style.update(marker="o", markersize=3)
        if s.err:  # the bars the SVG draws, no other (matplotlib refuses a negative one outright)
            yerr = [e if error_bar(y, e, c.log_y) is not None else math.nan for y, e in zip(s.y, s.err)]
            ax.errorbar(_nan(s.x), ys, yerr=yerr, capsize=2, elinewidth=0.8, **style)
        else:
            ax.plot(_nan(s.x), ys, **style)
    for h in c.hlines:
        ax.axhline(h.y, color=h.color, linestyle=_LINESTYLES.get(h.dash, "--"), linewidth=1.1, label=h.label)
    for v in c.vlines:  # e.g. a resume: a thin dashed line, its label at the top
        ax.axvline(v.x, color=v.color, linestyle="--", linewidth=0.9)
        ax.annotate(v.label, xy=(v.x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                    textcoords="offset points", color=v.color, fontsize=7, ha="left", va="top")
    top = ax.get_ylim()[1]
    for i, color in enumerate(dict.fromkeys(m.color for m in c.markers)):
        mine = [m for m in c.markers if m.color == color]
        ax.plot([m.x for m in mine], [top if m.y is None or m.y > top else m.y for m in mine], "v", color=color,
                markersize=6, linestyle="none", label="events" if i == 0 else None)
    # a log axis with no value above 0 to place (a diverged run's NaN losses) is an error in matplotlib
    if c.log_y and any(isinstance(y, (int, float)) and 0 < y < math.inf for s in c.series for y in s.y):
        ax.set_yscale("log")
        # plain numbers, as the SVG's ticks: matplotlib's log axis writes "6 x 10^0"
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    if c.percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(c.x_label)
    ax.set_ylabel(c.y_label)
    ax.grid(True, color="#e3e3e3")
    ax.legend(fontsize=8)


def _bars(ax, c: BarChart) -> None:
    left = [0.0] * len(c.categories)
    ys = list(range(len(c.categories)))
    for label, color, values in c.components:
        widths = [v or 0.0 for v in values]
        drawn = [i for i, w in enumerate(widths) if w > 0]  # a zero-width outline would still draw a line
        paint = (dict(facecolor="white", edgecolor=color, linewidth=1.3, linestyle="--") if label in c.hollow
                 else dict(color=color))
        ax.barh([ys[i] for i in drawn], [widths[i] for i in drawn], left=[left[i] for i in drawn], label=label,
                **paint)
        left = [a + b for a, b in zip(left, widths)]
    if c.end_labels is not None:
        for y, total, text in zip(ys, left, c.end_labels):
            ax.text(total, y, f" {text}", va="center", fontsize=8)
        ax.set_xlim(0, max(left, default=0) * 1.18 or 1)
    ax.set_yticks(ys, c.categories)
    ax.invert_yaxis()
    ax.set_xlabel(c.x_label)
    ax.legend(fontsize=8)


def _heatmap(fig, ax, c: Heatmap) -> None:
    from matplotlib.colors import LogNorm  # lazy: matplotlib is optional ([report])

    grid = [[math.nan if v is None or (c.log and v <= 0) else v for v in row] for row in c.values]
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                      norm=LogNorm() if c.log else None)
    every = max(1, math.ceil(len(c.rows) / 40))
    ax.set_yticks(range(0, len(c.rows), every), c.rows[::every], fontsize=6)
    col_every = max(1, math.ceil(len(c.cols) / 6))
    ax.set_xticks(range(0, len(c.cols), col_every), [f"{x:g}" for x in c.cols[::col_every]])
    ax.set_xlabel(c.x_label)
    fig.colorbar(image, ax=ax)


def render_png(chart: Chart) -> bytes:
    """The chart as PNG bytes (drawn in memory: nothing is written)."""
    # lazy: matplotlib is optional ([report])
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tall = isinstance(chart, Heatmap) and len(chart.rows) > 20
    fig = Figure(figsize=(8, 7 if tall else 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if isinstance(chart, LineChart):
        _line(ax, chart)
    elif isinstance(chart, BarChart):
        _bars(ax, chart)
    else:
        _heatmap(fig, ax, chart)
    ax.set_title(chart.title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_pngs(charts: list[Chart]) -> dict[str, bytes]:
    """``{"<chart id>.png": PNG bytes}`` for every chart, drawn before any is written."""
    return {f"{c.id}.png": render_png(c) for c in charts}


def write_pngs(images: dict[str, bytes], folder: Path) -> list[Path]:
    """Each of :func:`render_pngs`' images into ``folder``, each replaced whole (a full disk
    leaves an earlier report's figure as it was, never half a PNG: a WriteError naming it);
    PNGs of an earlier report that no longer has that chart are removed (the folder belongs to
    the report)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in images.items():
        write_file(folder / name, data, "the report figure")
        written.append(folder / name)
    keep = set(written)
    for old in folder.glob("*.png"):
        if old not in keep:
            old.unlink()
    return written
