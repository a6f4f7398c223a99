"""``flopwise report``: one self-contained HTML page of one or several runs.

The page is a single file that reads offline -- inline CSS, charts as inline SVG drawn
by ``svg.py``, no JavaScript, no external URL -- so it can be mailed, attached to an
issue or archived beside the run. Several runs are overlaid on the same charts, one
colour per run. When matplotlib is installed the same charts are also written as PNG
files into ``<stem>_figures/`` next to the page.

Sections: a header per run (device, versions, configuration, result), the
plan-vs-preflight-vs-measured table (relative errors first-class; each plan and preflight
figure is labelled measured or assumed, and what preflight could not measure stays n/a; with a
virtual.json, the virtual preflight's predicted column and its candidates beside the preflight's
measured trials), the
optimization ladder of ``preflight --ladder`` when preflight.json holds one (``tune/ladder.py``), the training charts
(loss against tokens, throughput, MFU, memory, learning rate, gradient norm, step-time
breakdown, bits per byte), evaluation tasks against tokens with their random baseline,
per-layer gradient norms, events (loss spikes, non-finite steps), and the configuration
keys in which the runs differ.
"""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

from flopwise.errors import MAX_VALUE_CHARS, shown
from flopwise.fsio import WriteError, is_write_fault, write_error, write_file
from flopwise.measure.sinks import human
from flopwise.report import png as png_out
from flopwise.report.compare import (
    VIRTUAL_SETTINGS,
    compare,
    measured_memory,
    measured_mfu,
    measured_tok_per_s,
    measured_wall_time,
    resumed_text,
    trained_tokens,
    virtual_pairs,
)
from flopwise.report.ladder import ladder_chart, ladder_section, read_ladder
from flopwise.report.runs import ReportError, Run, load_run, number, unique_names
from flopwise.report.svg import (
    PALETTE,
    BarChart,
    Chart,
    Heatmap,
    HLine,
    LineChart,
    Marker,
    Series,
    VLine,
    esc,
    fmt_tick,
    render,
)

__all__ = ["build_report", "ReportError"]

BREAKDOWN = [("time_data_s", "data", "#4C78A8"), ("time_fwd_bwd_s", "forward + backward", "#F58518"),
             ("time_optim_s", "optimizer", "#54A24B"), ("time_log_s", "logging", "#B279A2")]
ACC_METRICS = [("acc", "solid"), ("acc_norm", "dashed"), ("acc_token", "dotted")]
NOT_METRICS = {"n", "random", "truncated", "stderr"}  # numbers in an eval result that are not scores


# --------------------------------------------------------------------------- entry point

def build_report(run_dirs: list[str | Path], out: str | Path | None = None, png: bool = True) -> Path:
    """Write a single self-contained HTML file (default: <first run>/report.html) and return its path.

    ``run_dirs``: run directories written by ``flopwise train``; ``out``: the HTML file (an
    existing directory gets ``report.html`` in it); ``png``: also write the charts as PNG
    files into ``<stem>_figures/`` beside it when matplotlib is installed.
    Raises :class:`ReportError` naming the file for a path that is not a run directory
    or a file of one that cannot be read.
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ReportError("no run directories given")
    runs = [load_run(p) for p in run_dirs]
    for i, (run, name) in enumerate(zip(runs, unique_names([r.path for r in runs]))):
        run.name, run.color = name, PALETTE[i % len(PALETTE)]
        run.prefix = f"{name} · " if len(runs) > 1 else ""

    out = Path(out).expanduser() if out is not None else runs[0].path / "report.html"
    if out.is_dir():
        out = out / "report.html"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if not is_write_fault(e):
            raise
        raise write_error(out.parent, e, "the folder of the report") from e

    sections = build_charts(runs)
    charts = [c for _, group in sections for c in group]
    if not png:
        png_note = "PNG figures not requested."
    elif not png_out.available():
        png_note = "PNG figures not written: matplotlib is not installed (pip install 'flopwise[report]')."
    else:
        folder = out.parent / f"{out.stem}_figures"
        try:
            images = png_out.render_pngs(charts)
        except Exception as e:  # the page is the product: a plotting failure must not cost it
            png_note = f"PNG figures not written: matplotlib failed ({type(e).__name__}: {e})."
        else:  # a full or read-only disk is no plotting failure: it stops here, naming the file
            try:
                written = png_out.write_pngs(images, folder)
            except OSError as e:
                if not is_write_fault(e) or isinstance(e, WriteError):
                    raise
                raise write_error(folder, e, "the report figures in") from e
            png_note = (f"PNG copies of the {len(written)} figure{'s' if len(written) != 1 else ''}: "
                        f"{folder.name}/ (beside this page).")

    page = render_page(runs, sections, png_note)
    write_file(out, page, "the report")  # a browser refreshing never sees half a page; a full disk keeps the old one
    return out


# --------------------------------------------------------------------------- charts

def build_charts(runs: list[Run]) -> list[tuple[str, list[Chart]]]:
    """(section title, charts) in page order; charts without any data are left out."""
    training: list[Chart] = [loss_chart(runs), bpb_chart(runs), throughput_chart(runs), mfu_chart(runs),
                             memory_chart(runs), lr_chart(runs), grad_norm_chart(runs), breakdown_chart(runs),
                             diloco_chart(runs)]
    layers = [c for i, run in enumerate(runs) for c in layer_charts(run, i)]
    sections: list[tuple[str, Sequence[Chart]]] = [
        (LADDER, ladder_charts(runs)), ("Training", training), ("Evaluation", eval_charts(runs)),
        ("Per-layer statistics", layers)]
    return [(title, [c for c in group if c.has_data()]) for title, group in sections]


def _log_if_wide(values: Iterable[float | None], ratio: float) -> bool:
    given = [v for v in values if v is not None]
    return bool(given) and min(given) > 0 and max(given) / min(given) >= ratio


def loss_chart(runs: list[Run]) -> LineChart:
    series, markers = [], []
    uniform: dict[float, float] = {}
    first = runs[0].series("tokens", "val_loss") if len(runs) > 1 else ([], [])
    for i, run in enumerate(runs):
        x, y = run.series("tokens", "loss")
        series.append(Series(f"{run.prefix}train", x, y, run.color, run=run.name))
        vx, vy = run.series("tokens", "val_loss")
        if vx:
            label = f"{run.prefix}val" + (val_gap(vx, vy, first, runs[0].name) if i else "")
            series.append(Series(label, vx, vy, run.color, "dashed", points=True, run=run.name))
        series.extend(_eval_file_series(run, "val_loss"))
        for ev in run.events:
            step = number(ev.get("step"))
            tokens = number(ev.get("tokens")) if number(ev.get("tokens")) is not None else run.tokens_at(step)
            if tokens is not None:
                loss = number(ev.get("loss"))
                what = f"{run.name}: {ev.get('event')} at step {fmt_tick(step or 0)}"
                markers.append(Marker(tokens, loss, what + (f", loss {loss:.4g}" if loss is not None else ""),
                                      run.color))
        u = number(run.result.get("uniform_loss"))
        if u is not None:
            uniform.setdefault(round(u, 4), u)
    ys = [v for s in series for v in s.y]
    hlines = [HLine(u, f"uniform ln V = {u:.3f}", "#888888") for u in uniform.values()]
    note = ("Solid: training loss (mean over each logging window); dashed with dots: validation loss; dotted: "
            "flopwise eval on the same validation windows; dash-dot: flopwise eval on other data or windows.")
    if markers:
        note += " Triangles: events (loss spikes, non-finite steps), listed under Events."
    resumes = resume_lines(runs, "tokens")
    if resumes:
        note += f" {RESUME_NOTE}"
    return LineChart("loss", "Loss vs tokens", "tokens", "loss (nats/token)", series, log_y=_log_if_wide(ys, 2.0),
                     hlines=hlines, markers=markers, note=note, vlines=resumes)


def val_gap(vx: list[float], vy: list[float], first: tuple[list[float], list[float]], name: str) -> str:
    """The legend's comparison of a run's last validation loss with the first run's at the same
    tokens (a DiLoCo run beside its ddp twin): " 3.512, +1.2% vs NAME"; "" when the first run
    has no validation at those tokens (within 1%)."""
    fx, fy = first
    at = [v for t, v in zip(fx, fy) if abs(t - vx[-1]) <= 0.01 * vx[-1]]
    if not at or not at[-1]:
        return ""
    return f" {vy[-1]:.4g}, {vy[-1] / at[-1] - 1:+.2%} vs {name} at {fmt_tick(vx[-1])} tokens"


RESUME_NOTE = "Thin dashed vertical lines: where the run was resumed (a new process start, from its checkpoint)."


def resume_lines(runs: list[Run], x_key: str = "step") -> list[VLine]:
    """A vertical line at each step a run was resumed at (``x_key`` "tokens": at its tokens), in the
    run's colour; none for a run of one start."""
    lines = []
    for run in runs:
        for step in sorted({step for step, _ in run.starts()[1:]}):
            x = step if x_key == "step" else run.tokens_at(step)
            if x is not None:
                lines.append(VLine(x, "resumed", run.color, f"{run.prefix}resumed at step {fmt_count(step)}",
                                   kind="resume"))
    return lines


def _with_resumes(chart: LineChart, runs: list[Run]) -> LineChart:
    """``chart`` (of steps) with its runs' resume points marked, and its note saying so."""
    lines = resume_lines(runs)
    if not lines:
        return chart
    return replace(chart, vlines=lines, note=f"{chart.note} {RESUME_NOTE}".strip())


def _eval_file_series(run: Run, key: str) -> list[Series]:
    """The evals.jsonl rows (``flopwise eval``) of ``key`` as series against tokens (interpolated
    when a row has none), like with like: rows on the run's own validation data and windows
    (``val_set`` "run") are one series, beside the trainer's validation curve; each other data
    directory or window set is a series of its own, labelled with both, so a loss on other data
    is never read as the run's. A row from before eval recorded its data (no ``val_data``)
    could be of any data (``--other-data``): its own series too, labelled so, never on the curve."""
    groups: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for r in run.eval_rows:
        y = number(r.get(key))
        x = number(r.get("tokens"))
        x = x if x is not None else run.tokens_at(number(r.get("step")))
        if x is None or y is None:
            continue
        data = r.get("val_data")
        if r.get("val_set") == "run" and isinstance(data, dict):
            group: tuple[Any, ...] = ("run",)
        else:
            what = "data not recorded" if not isinstance(data, dict) else \
                "the run's data" if data.get("runs") is True else _data_name(data)
            group = (what, r.get("val_windows"), r.get("val_seq_len"))
        groups.setdefault(group, []).append((x, y))
    series = []
    for group, pts in sorted(groups.items(), key=lambda g: (g[0] != ("run",), str(g[0]))):
        pts.sort()
        if group == ("run",):
            label, dash = f"{run.prefix}val (flopwise eval)", "dotted"
        else:
            what, n, T = group
            label, dash = f"{run.prefix}flopwise eval on {what}, {_text(n)} windows x {_text(T)} tokens", "dashdot"
        series.append(Series(label, [p[0] for p in pts], [p[1] for p in pts], run.color, dash, points=True,
                             run=run.name))
    return series


def _data_name(data: dict[str, Any]) -> str:
    """A data directory of an evals.jsonl row: its folder's name and the start of its fingerprint."""
    name = Path(str(data.get("path") or "?")).name
    fp = data.get("fingerprint")
    return _text(name) + (f" ({fp[:8]})" if isinstance(fp, str) else "")


def bpb_chart(runs: list[Run]) -> LineChart:
    series = []
    for run in runs:
        x, y = run.series("tokens", "val_bpb")
        series.append(Series(f"{run.prefix}val", x, y, run.color, "dashed", points=True, run=run.name))
        series.extend(_eval_file_series(run, "val_bpb"))
    return LineChart("bpb", "Validation bits per byte vs tokens", "tokens", "bits per byte", series,
                     note="Bits per byte do not depend on the tokenizer: runs with different vocabularies compare.")


# Predictions closer than this share of each other are one line: drawn apart they hide each other
SAME_LINE = 0.02


def _prediction_lines(runs: list[Run], key: str) -> list[HLine]:
    """Each run's plan and preflight predictions of ``key`` as horizontal lines; those of a run
    within :data:`SAME_LINE` of each other as one line whose label names each, with its value."""
    lines = []
    for run in runs:
        row = next(c for c in compare(run) if c.key == key)
        mine = []
        if row.plan is not None:
            mine.append(HLine(row.plan, "plan", run.color, "dotted"))
        if row.preflight is not None:
            assumed = " (assumed)" if row.preflight_basis == "assumed" else ""
            mine.append(HLine(row.preflight, f"preflight{assumed}", run.color, "dashdot"))
        if row.trace is not None:
            mine.append(HLine(row.trace, f"virtual preflight ({row.trace_basis})", run.color, "dashed"))
        lines += [replace(h, label=run.prefix + h.label) for h in _merged(mine)]
    return lines


def _merged(lines: list[HLine]) -> list[HLine]:
    """``lines`` with those within :data:`SAME_LINE` of another drawn once, labelled with each
    name and value ("plan 1.21 = preflight 1.22")."""
    out: list[list[HLine]] = []
    for h in sorted(lines, key=lambda h: h.y):
        if out and abs(h.y - out[-1][0].y) <= SAME_LINE * max(abs(h.y), abs(out[-1][0].y), 1e-12):
            out[-1].append(h)
        else:
            out.append([h])
    return [group[0] if len(group) == 1 else
            replace(group[0], label=" = ".join(f"{h.label} {h.y:.3g}" for h in group)) for group in out]


def throughput_chart(runs: list[Run]) -> LineChart:
    series = [Series(run.name, *run.series("step", "tok_per_s"), run.color, run=run.name) for run in runs]
    return _with_resumes(LineChart("throughput", "Throughput vs step", "step", "tokens/s", series,
                                   hlines=_prediction_lines(runs, "tok_per_s"),
                                   note="Measured over each logging window, validation and checkpoint time excluded; "
                                        "horizontal lines: the plan's and the preflight's predictions."), runs)


def mfu_chart(runs: list[Run]) -> LineChart:
    series = []
    for run in runs:
        series.append(Series(run.name, *run.series("step", "mfu"), run.color, run=run.name))
        if run.has("mfu_6n"):
            series.append(Series(f"{run.prefix}6N", *run.series("step", "mfu_6n"), run.color, "dashed",
                                 run=run.name))
    return _with_resumes(LineChart("mfu", "Model FLOPs utilisation vs step", "step", "MFU", series, percent=True,
                                   hlines=_prediction_lines(runs, "mfu"),
                                   note="MFU counts the model's FLOPs (6·N_matmul + attention) against the device's "
                                        "dense peak; dashed: with 6 × parameters."), runs)


def memory_chart(runs: list[Run]) -> LineChart:
    keys = [("mem_alloc_gb", "allocated", "solid"), ("mem_peak_gb", "peak", "dashed"),
            ("mem_reserved_gb", "reserved", "dotted"), ("mem_rss_gb", "RSS", "solid"),
            ("mem_rss_peak_gb", "RSS peak", "dashed")]
    series = []
    for run in runs:
        for key, label, dash in keys:
            if run.has(key):
                series.append(Series(f"{run.prefix}{label}", *run.series("step", key), run.color, dash,
                                     run=run.name))
    return _with_resumes(LineChart("memory", "Memory vs step", "step", "GiB", series,
                                   hlines=_prediction_lines(runs, "memory_gb"),
                                   note="CUDA: allocated, peak allocated and reserved by the caching allocator; CPU: "
                                        "the process's resident set. Horizontal lines: predicted peaks."), runs)


def lr_chart(runs: list[Run]) -> LineChart:
    series = [Series(run.name, *run.series("step", "lr"), run.color, run=run.name) for run in runs]
    return _with_resumes(LineChart("lr", "Learning rate vs step", "step", "learning rate", series), runs)


def grad_norm_chart(runs: list[Run]) -> LineChart:
    series = [Series(run.name, *run.series("step", "grad_norm"), run.color, run=run.name) for run in runs]
    ys = [v for s in series for v in s.y]
    return _with_resumes(LineChart("grad_norm", "Gradient norm vs step", "step",
                                   "global gradient norm (before clipping)", series, log_y=_log_if_wide(ys, 20.0)),
                         runs)


def diloco_chart(runs: list[Run]) -> LineChart:
    """A DiLoCo run's outer steps: the mean pseudo-gradient's norm and the groups' drift (no data otherwise)."""
    series = []
    for run in runs:
        if run.has("drift"):
            series.append(Series(f"{run.prefix}pseudo-gradient", *_outer_series(run, "pseudo_grad_norm"), run.color,
                                 run=run.name))
            series.append(Series(f"{run.prefix}drift", *_outer_series(run, "drift"), run.color, "dashed",
                                 run=run.name))
    return LineChart("diloco", "DiLoCo: pseudo-gradient norm and drift vs step", "step", "L2 norm", series,
                     note="At each outer step: the norm of the groups' mean pseudo-gradient (anchor minus parameters) "
                          "and, dashed, how far the groups' parameters were apart (RMS distance to their mean).")


def _outer_series(run: Run, key: str) -> tuple[list[float], list[float]]:
    """``key`` at every outer step (its ``outer_sync`` rows), or at the log rows of a run that
    recorded only those."""
    syncs = sorted((number(e.get("step")), number(e.get(key))) for e in run.outer_syncs)
    pairs = [(x, y) for x, y in syncs if x is not None and y is not None]
    if not pairs:
        return run.series("step", key)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def diloco_text(run: Run) -> str:
    """Outer steps, the bytes sent across worker groups and the time waited for them; "" otherwise."""
    rows = [r for r in run.rows if number(r.get("outer_steps")) is not None]
    if not rows:
        return ""
    last = rows[-1]
    total, per_token = number(last.get("outer_bytes_total")), number(last.get("outer_bytes_per_token"))
    waited = sum(v for v in (number(r.get("outer_s")) for r in rows) if v is not None)
    text = f"{fmt_count(number(last['outer_steps']))} outer steps"
    if total is not None:
        text += f" · {total / 2**20:,.1f} MiB across groups"
        text += f" ({per_token:,.1f} B/token)" if per_token is not None else ""
    return text + f" · {waited:.2f} s waiting on them"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def breakdown_chart(runs: list[Run]) -> BarChart:
    """Mean time per step by phase, one bar per run; 'other' is what the phases do not cover."""
    names = []
    per_component: dict[str, list[float | None]] = {key: [] for key, _, _ in BREAKDOWN}
    other = []
    for run in runs:
        rows = [r for r in run.training_rows() if any(number(r.get(k)) is not None for k, _, _ in BREAKDOWN)]
        if len(rows) > 1:
            rows = rows[1:]  # the first window holds compilation and warm-up
        if not rows:
            continue
        names.append(run.name)
        means = {key: _mean([v for v in (number(r.get(key)) for r in rows) if v is not None])
                 for key, _, _ in BREAKDOWN}
        for key in per_component:
            mean = means[key]
            per_component[key].append(1000 * mean if mean is not None else None)
        total = _mean([v for v in (number(r.get("step_time_s")) for r in rows) if v is not None])
        covered = sum(v for v in means.values() if v is not None)
        other.append(1000 * (total - covered) if total is not None and total > covered else None)
    components = [(label, color, per_component[key]) for key, label, color in BREAKDOWN
                  if any(v is not None for v in per_component[key])]
    if any(v is not None for v in other):
        components.append(("other", "#BAB0AC", other))
    return BarChart("step_time", "Step-time breakdown (mean per step)", "milliseconds per step", names, components,
                    note="Means over the logged windows after the first; 'other' is the step time the phases "
                         "do not account for.")


def _stderr(result: dict[str, Any], metric: str) -> float | None:
    se = result.get("stderr")
    if isinstance(se, dict) and number(se.get(metric)) is not None:
        return number(se.get(metric))
    return number(result.get(f"{metric}_stderr"))


def eval_tasks(runs: list[Run]) -> list[str]:
    tasks: list[str] = []
    for run in runs:
        for _, _, results in run.evals():
            tasks.extend(t for t in results if t not in tasks)
    return tasks


def eval_charts(runs: list[Run]) -> list[LineChart]:
    charts = []
    for i, task in enumerate(eval_tasks(runs)):
        series, random = [], None
        for run in runs:
            points = [(tokens, res[task]) for _, tokens, res in run.evals() if task in res and tokens is not None]
            for metric, dash in ACC_METRICS:
                pts = [(t, number(r.get(metric)), _stderr(r, metric)) for t, r in points]
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    series.append(Series(f"{run.prefix}{metric}", [p[0] for p in pts], [p[1] for p in pts],
                                         run.color, dash, points=True, err=[p[2] for p in pts], run=run.name))
            for _, r in points:
                random = random if random is not None else number(r.get("random"))
        hlines = [HLine(random, f"random {100 * random:.1f}%", "#888888")] if random is not None else []
        charts.append(LineChart(f"eval-{i}-{_slug(task)}", f"{task}: accuracy vs tokens", "tokens", "accuracy",
                                series, percent=True, hlines=hlines,
                                note="Bars: ± one standard error. Grey line: the random-guess baseline."))
    return charts


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text)[:60]


LADDER = "Ladder"


def _ladder_chart_id(run: Run, index: int) -> str:
    return f"ladder-{index}-{_slug(run.name)}"


def ladder_charts(runs: list[Run]) -> list[BarChart]:
    """Tokens/s per rung of each run's optimization ladder (preflight.json ``ladder``); none without one."""
    charts = []
    for i, run in enumerate(runs):
        ladder = read_ladder(run.preflight)
        if ladder is not None:
            charts.append(ladder_chart(ladder, _ladder_chart_id(run, i), f"{run.name}: optimization ladder, "
                                       "tokens/s per rung", run.color))
    return charts


def ladder_html(runs: list[Run], charts: list[Chart]) -> str:
    """The Ladder section's body: per run with a ladder, its chart, table and ladder vs actual."""
    by_id = {c.id: c for c in charts}
    parts = []
    for i, run in enumerate(runs):
        ladder = read_ladder(run.preflight)
        if ladder is not None:
            chart = by_id.get(_ladder_chart_id(run, i))  # absent when no rung measured a rate
            parts.append(ladder_section(ladder, run, _figure(chart) if chart is not None else ""))
    return "".join(parts)


def layer_charts(run: Run, index: int) -> list[Heatmap]:
    charts = []
    for key, title in (("grad_norms", "gradient norm"), ("update_ratios", "update / weight")):
        stats = run.layer_stats(key)
        if not stats:
            continue
        names = list(dict.fromkeys(n for _, norms in stats for n in norms))  # first seen: the model's order
        values = [[number(norms.get(n)) for _, norms in stats] for n in names]
        charts.append(Heatmap(f"layers-{index}-{_slug(run.name)}-{key}", f"{run.name}: per-parameter {title} by step",
                              "step", names, [s for s, _ in stats], values, log=True,
                              note="One row per parameter tensor, in the model's order; colour on a log scale."))
    return charts


# --------------------------------------------------------------------------- numbers for tables

def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def fmt_count(n: float | None) -> str:
    """Steps and tokens: exact up to 100,000 (12,288), then 1.23M."""
    if n is None:
        return "n/a"
    return f"{n:,.0f}" if abs(n) < 1e5 and float(n).is_integer() else human(n)


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "GiB":
        return f"{value:.2f} GiB" if value >= 0.1 else f"{value * 1024:.1f} MiB"
    if unit == "s":
        return fmt_duration(value)
    if unit == "tok/s":
        return f"{fmt_tick(value, 1.0) if value < 1000 else fmt_tick(round(value, -1))} tok/s"
    return f"{value:.4g}"


def fmt_error(err: float | None) -> str:
    return "n/a" if err is None else f"{100 * err:+.1f}%"


def _error_class(err: float | None) -> str:
    if err is None:
        return "err-na"
    return "err-good" if abs(err) <= 0.10 else "err-fair" if abs(err) <= 0.30 else "err-bad"


# --------------------------------------------------------------------------- HTML

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',Arial,sans-serif;margin:0;
color:#222;background:#f6f7f9;line-height:1.4}
main{max-width:1240px;margin:0 auto;padding:20px 24px 48px}
h1{font-size:1.6em;margin:.2em 0}h2{font-size:1.25em;margin:1.6em 0 .5em;border-bottom:2px solid #dde1e6;
padding-bottom:.2em}h3{font-size:1.02em;margin:.2em 0 .4em}
.sub{color:#555;font-size:.92em}
.swatch{display:inline-block;width:.9em;height:.9em;border-radius:2px;vertical-align:-.1em;margin-right:.35em}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(360px,1fr));gap:14px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:12px 14px;border-top-width:4px}
.card dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:0;font-size:.9em}
.card dt{color:#666}.card dd{margin:0;overflow-wrap:anywhere}
.figs{display:grid;grid-template-columns:repeat(auto-fit,minmax(540px,1fr));gap:14px}
figure{background:#fff;border:1px solid #dde1e6;border-radius:6px;margin:0;padding:10px 12px}
figure svg{display:block;width:100%;height:auto}
figcaption{color:#555;font-size:.85em;margin-top:4px}
table{border-collapse:collapse;background:#fff;font-size:.9em;margin:.3em 0 .8em}
th,td{border:1px solid #dde1e6;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f4}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.err-good{color:#17692d;font-weight:600}td.err-fair{color:#8a5a00;font-weight:600}
td.err-bad{color:#b00020;font-weight:700}td.err-na{color:#888}
.note{color:#555;font-size:.88em}pre{background:#fff;border:1px solid #dde1e6;padding:8px;white-space:pre-wrap;
font-size:.85em;max-height:16em;overflow:auto}
nav a{margin-right:1em}
section.ladder{margin:.4em 0 1.4em}section.ladder figure{max-width:760px;margin:.4em 0}
table.ladder td.kept{color:#17692d;font-weight:600}table.ladder tr[data-kept="false"] td{color:#777}
"""


def _swatch(run: Run) -> str:
    return f'<span class="swatch" style="background:{esc(run.color)}"></span>'


def _dl(items: list[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items if v not in (None, "")) + "</dl>"


def config_summary(run: Run) -> list[tuple[str, str]]:
    flat = run.flat_config()
    if not flat:
        return [("config", "no config.yaml")]

    def g(key: str, default: Any = "?") -> Any:
        value = flat.get(key, default)
        return value if isinstance(value, (float, bool)) or _small_int(value) else _text(value)

    params = number((run.plan or {}).get("params"))
    model = (f"{g('model.arch')} · {g('model.n_layers')} layers · d_model {g('model.d_model')} · heads "
             f"{g('model.n_heads')} q / {g('model.n_kv_heads')} kv · {g('model.mlp')} {g('model.ffn_hidden')} · "
             f"vocab {g('model.vocab_size')}")
    if number(g("model.n_experts", 0)):
        model += f" · {g('model.n_experts')} experts top-{g('model.moe_top_k')}"
    seq, gb, mb = g("train.seq_len"), g("train.global_batch_size"), g("train.micro_batch_size")
    tps = f" = {int(seq) * int(gb):,} tokens/step" if isinstance(seq, int) and isinstance(gb, int) else ""
    length = []
    if number(g("train.max_steps", 0)):
        length.append(f"max_steps {g('train.max_steps'):,}")
    if number(g("train.max_tokens", 0)):
        length.append(f"max_tokens {fmt_count(g('train.max_tokens'))}")
    return [
        ("preset", str(g("preset", ""))),
        ("model", model),
        ("parameters", fmt_count(params) if params is not None else ""),
        ("batch", f"seq {seq} × global batch {gb}{tps} (micro-batch {mb})"),
        ("length", " · ".join(length)),
        ("optimizer", f"AdamW lr {g('optim.lr')} · warmup {g('optim.warmup_steps')} · {g('optim.schedule')} · "
                      f"weight decay {g('optim.weight_decay')}"),
        ("attention", str(g("model.attention", ""))),
        ("data", str(g("data.path", "")) or "embedded corpus"),
    ]


def run_card(run: Run) -> str:
    rec, res = run.record or {}, run.result
    code = rec.get("code")
    code = code if isinstance(code, dict) else {}
    versions = " · ".join(f"{k} {rec[k]}" for k in ("flopwise", "torch", "python", "cuda", "tokenizers")
                          if rec.get(k))
    if code.get("git_commit"):
        versions += f" · git {str(code['git_commit'])[:10]}{' (uncommitted changes)' if code.get('git_dirty') else ''}"
    train_rows = run.training_rows()
    last = train_rows[-1] if train_rows else {}
    if res:
        stopped = res.get("stopped")
        status = f"stopped: {stopped}" if stopped else "completed"
    else:
        status = "in progress or interrupted (run.json has no result)"
    mem, mem_what = measured_memory(run)
    result = [
        ("status", status),
        ("steps", fmt_count(number(res.get("steps", last.get("step"))))),
        ("tokens", fmt_count(trained_tokens(run))),
        ("final train loss", f"{number(last.get('loss')):.4f}" if last else "n/a"),
        ("validation loss", validation_text(run)),
        ("throughput", fmt_value(measured_tok_per_s(run), "tok/s")),
        ("MFU", fmt_value(measured_mfu(run), "%")),
        ("peak memory", f"{fmt_value(mem, 'GiB')} ({mem_what})" if mem is not None else "n/a"),
        ("wall time", wall_time_text(run)),
    ]
    if diloco_text(run):
        result.append(("DiLoCo", diloco_text(run)))
    starts = run.starts()
    head = [
        ("directory", str(run.path)),
        ("device", f"{rec.get('device', 'unknown')} · precision {rec.get('precision', '?')}"
                   + _parallel_text(rec.get("parallel"))),
        ("versions", versions),
        ("started", str(starts[0][1].get("started") or rec.get("started", "")) if len(starts) > 1
         else str(rec.get("started", ""))),
        ("command", " ".join(map(str, rec.get("argv", []))) if isinstance(rec.get("argv"), list) else ""),
    ]
    if len(starts) > 1:  # run.json's top is the last start's: its versions, device and command line
        head.append(("starts", f"{len(starts)} · {resumed_text(run)} (the figures below are over all of them; "
                               "the device, versions and command above are the last start's)"))
    return (f'<section class="card" data-run="{esc(run.name)}" style="border-top-color:{esc(run.color)}">'
            f"<h3>{_swatch(run)}{esc(run.name)}</h3>{_dl(head)}<h3>configuration</h3>{_dl(config_summary(run))}"
            f"<h3>result</h3>{_dl(result)}{samples_html(run)}</section>")


def validation_text(run: Run) -> str:
    """The run card's validation loss: the start's, then the latest measured after step 0 --
    the trainer's (metrics.jsonl) or ``flopwise eval``'s on the run's own validation set
    (evals.jsonl), whichever is of the later step, the trainer's on a tie -- with its step when
    it is not the run's last, or "not measured". Never the start's figure again as the end's
    (a run.json of a stop before flopwise measured one gave that)."""
    res = run.result
    start = number(res.get("val_loss_start"))
    trainer = [(s, v) for s, v in zip(*run.series("step", "val_loss")) if s > 0]
    if start is None:
        start = next((v for s, v in zip(*run.series("step", "val_loss")) if s == 0), None)
    own = [(number(r.get("step")), number(r.get("val_loss"))) for r in run.eval_rows if r.get("val_set") == "run"]
    evals = sorted((s, v) for s, v in own if s is not None and v is not None)
    text = "n/a" if start is None else f"{start:.4f}"
    if trainer and (not evals or trainer[-1][0] >= evals[-1][0]):
        (step, end), by = trainer[-1], ""
    elif evals:
        (step, end), by = evals[-1], "flopwise eval, "
    else:
        return f"{text} → not measured"
    last = number(res.get("steps"))
    at = f" ({by}step {fmt_count(step)})" if by or step != last else ""
    return f"{text} → {end:.4f}{at}"


SAMPLES_SHOWN = 8  # the latest entries of samples.txt on a run card
SAMPLE_CHARS = 2000  # of each


def samples_html(run: Run) -> str:
    """samples.txt on the run card: its latest entries, each under the step it was sampled at
    (an entry written before flopwise recorded the step: under its prompt line alone)."""
    if not run.samples:
        return ""
    entries: list[tuple[str, list[str]]] = []
    for line in run.samples.splitlines():
        if line.startswith("--- prompt ") or not entries:
            entries.append((line, []))
        else:
            entries[-1][1].append(line)
    parts = []
    for head, body in entries[-SAMPLES_SHOWN:]:
        m = re.search(r" · step (\d+) · ", head)
        title = f"sample at step {fmt_count(int(m.group(1)))}" if m else "sample"
        parts.append(f"<h4>{esc(title)}</h4><p class=\"note\">{esc(head[:300])}</p>"
                     f"<pre>{esc(chr(10).join(body)[:SAMPLE_CHARS])}</pre>")
    count = f"the latest {SAMPLES_SHOWN} of {len(entries)}" if len(entries) > SAMPLES_SHOWN else str(len(entries))
    return f"<details><summary>samples (samples.txt: {count})</summary>{''.join(parts)}</details>"


def _parallel_text(par: Any) -> str:
    """`` · 8 GPUs, fsdp2`` for a data-parallel run (run.json ``parallel``); nothing for one process."""
    if not isinstance(par, dict) or (int(par.get("world_size") or 1) <= 1 and par.get("strategy") in (None, "single")):
        return ""
    return f" × {par.get('world_size')} ranks · {par.get('strategy')} ({par.get('backend')})"


def wall_time_text(run: Run) -> str:
    """The measured wall time (to the last logged step, over every start of the process), and
    run.json's own figure when it differs (it also counts the final save and sample): of every
    start where run.json holds each one's, else of the last start, said so."""
    starts = run.starts()
    logged, whole, of = measured_wall_time(run), number(run.result.get("wall_time_s")), "with final save"
    if len(starts) > 1:
        each = [number(entry.get("wall_time_s")) for _, entry in starts]
        whole, of = ((sum(v for v in each if v is not None), f"all {len(starts)} starts, with final saves")
                     if None not in each else (whole, "last start, with final save"))
    text = fmt_duration(logged)
    if logged is not None and whole is not None and abs(whole - logged) > 0.05 * max(logged, 1e-9):
        text += f" to the last logged step · {fmt_duration(whole)} in run.json ({of})"
    return text


def _value_cell(col: str, value: float | None, unit: str, basis: str = "") -> str:
    """A figure of a table: it says whether it was measured, assumed, predicted or traced; n/a stays n/a."""
    label = f' <span class="note basis">{esc(basis)}</span>' if basis and value is not None else ""
    return (f'<td class="num" data-col="{col}" data-value="{"" if value is None else repr(value)}"'
            f' data-basis="{esc(basis) if value is not None else ""}">{esc(fmt_value(value, unit))}{label}</td>')


def _error_cell(col: str, err: float | None, comparable: bool = True, text: str = "") -> str:
    klass = _error_class(err) if comparable else "err-na"
    return (f'<td class="num {klass}" data-col="{col}" data-value="{"" if err is None else repr(err)}"'
            f'>{esc(text or fmt_error(err))}{"" if comparable or err is None else " *"}</td>')


def comparison_table(runs: list[Run]) -> str:
    # the virtual preflight's column only where a run has virtual.json: the table of others reads as before
    traced = any(run.virtual is not None for run in runs)
    trace_head = ("<th>virtual preflight (predicted)</th>", "<th>virtual preflight error</th>") if traced else ("", "")
    head = (f"<tr><th>run</th><th>quantity</th><th>plan</th><th>preflight</th>{trace_head[0]}<th>measured</th>"
            f"<th>plan error</th><th>preflight error</th>{trace_head[1]}<th>notes</th></tr>")
    body = []
    for run in runs:
        rows = compare(run)
        for i, c in enumerate(rows):
            cells = [f'<tr data-run="{esc(run.name)}" data-key="{c.key}">']
            if i == 0:
                files = [f for f, d in (("plan.json", run.plan), ("preflight.json", run.preflight)) if d is None]
                missing = f'<br><span class="note">no {" or ".join(files)}</span>' if files else ""
                if resumed_text(run):  # its measured figures are over every start: say which there were
                    missing += (f'<br><span class="note">{len(run.starts())} starts · '
                                f"{esc(resumed_text(run))}</span>")
                cells.append(f'<td rowspan="{len(rows)}">{_swatch(run)}{esc(run.name)}{missing}</td>')
            cells.append(f"<td>{esc(c.label)}</td>")
            values = [("plan", c.plan, c.plan_basis), ("preflight", c.preflight, c.preflight_basis)]
            values += [("trace", c.trace, c.trace_basis)] if traced else []
            cells += [_value_cell(col, v, c.unit, basis) for col, v, basis in values + [("actual", c.actual, "")]]
            errors = [("plan_error", c.plan_error), ("preflight_error", c.preflight_error)]
            errors += [("trace_error", c.trace_error)] if traced else []
            cells += [_error_cell(col, err, c.comparable) for col, err in errors]
            cells.append(f'<td class="note">{esc(c.note)}</td></tr>')
            body.append("".join(cells))
    trace_note = (" The virtual preflight (preflight --dry-run --rank, virtual.json) measured nothing: its "
                  "tokens/s and MFU are predicted from the traced step, its peak memory traced on fake tensors."
                  if traced else "")
    return (f'<table class="comparison" id="plan-vs-actual">{head}{"".join(body)}</table>'
            '<p class="note">Error = (measured − predicted) / predicted: positive means faster, more MFU, more '
            "memory or longer than predicted. Green within 10%, amber within 30%, red beyond; * not like for "
            f"like (see the note).{trace_note}</p>{virtual_vs_preflight(runs)}")


def virtual_vs_preflight(runs: list[Run]) -> str:
    """Per run with both files: the virtual preflight's candidates beside the preflight's measured
    trials of the same micro-batch and activation checkpointing; "" when no run has a pair."""
    body = []
    for run in runs:
        for p in virtual_pairs(run):
            s = p.settings
            others = ", ".join(f"{k.split('.')[-1]} {_text(s.get(k))}" for k in VIRTUAL_SETTINGS[2:] if k in s)
            predicted = _value_cell("predicted", p.predicted, "tok/s", "predicted") if p.fits else \
                '<td class="num" data-col="predicted" data-value="">does not fit (traced)</td>'
            measured = _value_cell("measured", p.measured, "tok/s", "measured") if p.status == "ok" else \
                f'<td class="num" data-col="measured" data-value="">{esc(_text(p.status))}</td>'
            ratio = _error_cell("ratio", None if p.ratio is None else p.ratio - 1,
                                text="n/a" if p.ratio is None else f"{p.ratio:.2f}×")
            body.append(f'<tr data-run="{esc(run.name)}"><td>{_swatch(run)}{esc(run.name)}</td>'
                        f'<td class="num">{esc(_text(s.get("train.micro_batch_size")))}</td>'
                        f'<td>{esc(_text(s.get("train.activation_checkpointing")))}</td><td>{esc(others)}</td>'
                        f"{predicted}{measured}{ratio}</tr>")
    if not body:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("run", "micro-batch", "checkpointing", "other settings",
                                              "virtual preflight tok/s per GPU (predicted)",
                                              "preflight tok/s (measured)", "measured / predicted"))
    return ('<h3 id="virtual-vs-preflight">virtual preflight (predicted) vs preflight (measured)</h3>'
            f'<table class="comparison virtual-pairs"><tr>{head}</tr>{"".join(body)}</table>'
            '<p class="note">Each candidate the virtual preflight traced beside the trial the preflight measured '
            "with the same micro-batch and activation checkpointing (a preflight times its trials on one GPU). "
            "Below 1× the GPU was slower than predicted; coloured as the errors above.</p>")


def eval_table(runs: list[Run]) -> str:
    head = ["task", "run", "step", "tokens"]
    metrics: list[str] = []
    latest: list[tuple[str, Run, float | None, float | None, dict[str, Any]]] = []
    for task in eval_tasks(runs):
        for run in runs:
            found = [(s, t, res[task]) for s, t, res in run.evals() if task in res]
            if found:
                step, tokens, res = found[-1]
                latest.append((task, run, step, tokens, res))
                metrics.extend(k for k, v in res.items() if k not in NOT_METRICS and not k.endswith("_stderr")
                               and number(v) is not None and k not in metrics)
    if not latest:
        return ""
    cols = head + metrics + ["random", "n", "best − random"]
    rows = []
    for task, run, step, tokens, res in latest:
        cells = [esc(task), _swatch(run) + esc(run.name), esc(fmt_count(step)), esc(fmt_count(tokens))]
        scores = []
        for m in metrics:
            v, se = number(res.get(m)), _stderr(res, m)
            if v is not None:
                scores.append((v, se))
            cells.append("n/a" if v is None else f"{100 * v:.1f}%" + (f" ± {100 * se:.1f}" if se is not None else ""))
        random = number(res.get("random"))
        cells.append("n/a" if random is None else f"{100 * random:.1f}%")
        cells.append(fmt_count(number(res.get("n"))))
        if random is not None and scores:
            best, se = max(scores, key=lambda p: p[0])
            sigma = f" ({(best - random) / se:.1f} σ)" if se else ""
            cells.append(f"{100 * (best - random):+.1f} pts{sigma}")
        else:
            cells.append("n/a")
        rows.append("<tr>" + "".join(f'<td class="num">{c}</td>' if i >= 2 else f"<td>{c}</td>"
                                     for i, c in enumerate(cells)) + "</tr>")
    return (f'<table class="evals"><tr>{"".join(f"<th>{esc(c)}</th>" for c in cols)}</tr>{"".join(rows)}</table>'
            '<p class="note">The latest evaluation of each run; ± one standard error, in percentage points.</p>')


def events_table(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        for ev in sorted(run.events, key=lambda e: number(e.get("step")) or 0):
            step = number(ev.get("step"))
            tokens = number(ev.get("tokens")) if number(ev.get("tokens")) is not None else run.tokens_at(step)
            loss = number(ev.get("loss"))
            details = " · ".join(f"{k} {v:.4g}" if number(v) is not None else f"{k} {'non-finite' if v is None else v}"
                                 for k, v in ev.items() if k not in ("step", "tokens", "event", "loss"))
            rows.append(f'<tr data-run="{esc(run.name)}"><td>{_swatch(run)}{esc(run.name)}</td>'
                        f'<td class="num">{esc(fmt_count(step))}</td><td class="num">{esc(fmt_count(tokens))}</td>'
                        f"<td>{esc(ev.get('event'))}</td>"
                        f'<td class="num">{"non-finite" if loss is None else f"{loss:.4f}"}</td>'
                        f"<td>{esc(details)}</td></tr>")
    if not rows:
        return '<p class="note">No events: no loss spikes and no non-finite steps.</p>'
    return ('<table class="events"><tr><th>run</th><th>step</th><th>tokens</th><th>event</th><th>loss</th>'
            f'<th>details</th></tr>{"".join(rows)}</table>')


IGNORED_IN_DIFF = {"train.run_dir"}


def _small_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**18


def _text(value: Any) -> str:
    """A config value as the page shows it: text as written, anything else as Python writes it,
    at most ``MAX_VALUE_CHARS`` characters either way (its length said when cut). A config.yaml
    is the user's file: a value of megabytes would otherwise be copied into every cell."""
    if isinstance(value, str):
        return value if len(value) <= MAX_VALUE_CHARS else f"{value[:MAX_VALUE_CHARS]}... ({len(value):,} characters)"
    return shown(value)


def config_diff(runs: list[Run]) -> str:
    if len(runs) < 2:
        return ""
    missing = [run.name for run in runs if not run.flat_config()]
    runs = [run for run in runs if run.flat_config()]
    flats = [run.flat_config() for run in runs]
    keys = sorted({k for f in flats for k in f} - IGNORED_IN_DIFF)
    differ = [k for k in keys if len({repr(f.get(k, "<absent>")) for f in flats}) > 1]
    note = f'<p class="note">No config.yaml in: {esc(", ".join(missing))}.</p>' if missing else ""
    if len(runs) < 2:
        return note
    if not differ:
        return note + '<p class="note">The configurations are identical (apart from train.run_dir).</p>'
    head = "<tr><th>key</th>" + "".join(f"<th>{_swatch(r)}{esc(r.name)}</th>" for r in runs) + "</tr>"
    rows = []
    for k in differ:
        cells = "".join(f"<td>{esc(_text(f[k])) if k in f else '<i>absent</i>'}</td>" for f in flats)
        rows.append(f'<tr data-key="{esc(k)}"><td><code>{esc(k)}</code></td>{cells}</tr>')
    return note + f'<table class="config-diff">{head}{"".join(rows)}</table>'


def _figure(chart: Chart) -> str:
    caption = f"<figcaption>{esc(chart.note)}</figcaption>" if chart.note else ""
    return f'<figure id="fig-{esc(chart.id)}"><h3>{esc(chart.title)}</h3>{render(chart)}{caption}</figure>'


EXPECTED = {"loss": "loss", "throughput": "tokens/s",
            "mfu": "MFU (null in metrics.jsonl when the device's peak is unknown: set train.peak_tflops)",
            "memory": "memory", "lr": "learning rate", "grad_norm": "gradient norm",
            "step_time": "step-time breakdown (no time_*_s keys in metrics.jsonl)",
            "bpb": "bits per byte (no val_bpb)"}


def render_page(runs: list[Run], sections: list[tuple[str, list[Chart]]], png_note: str) -> str:
    shown = {c.id for _, group in sections for c in group}
    missing = [why for key, why in EXPECTED.items() if key not in shown]
    title = "flopwise report: " + ", ".join(r.name for r in runs)
    parts = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
             f'<meta name="viewport" content="width=device-width, initial-scale=1">'
             f"<title>{esc(title)}</title><style>{CSS}</style></head><body><main>"]
    parts.append(f"<h1>flopwise report</h1><p class=\"sub\">{len(runs)} run(s) · generated "
                 f"{esc(datetime.now().isoformat(timespec='seconds'))} · "
                 + " ".join(f"{_swatch(r)}{esc(r.name)}" for r in runs) + "</p>")
    nav = ["<a href=\"#runs\">runs</a>", "<a href=\"#plan\">plan vs measured</a>"]
    ladders = ladder_html(runs, next((g for t, g in sections if t == LADDER), []))
    nav += [f'<a href="#{_slug(t)}">{esc(t.lower())}</a>' for t, group in sections
            if group or (t == LADDER and ladders)]
    nav += ['<a href="#events">events</a>'] + (['<a href="#config">config diff</a>'] if len(runs) > 1 else [])
    parts.append(f"<nav>{''.join(nav)}</nav>")
    parts.append(f'<h2 id="runs">Runs</h2><div class="cards">{"".join(run_card(r) for r in runs)}</div>')
    parts.append(f'<h2 id="plan">Plan vs preflight vs measured</h2>{comparison_table(runs)}')
    for section, group in sections:
        if section == LADDER:  # charts and tables per run; a ladder with no rate measured still has its table
            if ladders:
                parts.append(f'<h2 id="{_slug(section)}">Optimization ladder</h2>{ladders}')
            continue
        if not group:
            continue
        parts.append(f'<h2 id="{_slug(section)}">{esc(section)}</h2>')
        if section == "Evaluation":
            parts.append(eval_table(runs))
        parts.append(f'<div class="figs">{"".join(_figure(c) for c in group)}</div>')
    parts.append(f'<h2 id="events">Events</h2>{events_table(runs)}')
    if len(runs) > 1:
        parts.append(f'<h2 id="config">Configuration differences</h2>{config_diff(runs)}')
    notes = [w for run in runs for w in run.warnings] + [png_note]
    if missing:
        notes.append("Not shown, no data: " + "; ".join(missing) + ".")
    parts.append('<h2 id="notes">Notes</h2>' + "".join(f'<p class="note">{esc(n)}</p>' for n in notes))
    parts.append("</main></body></html>\n")
    return "".join(parts)
