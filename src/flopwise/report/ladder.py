"""The optimization ladder of ``flopwise preflight --ladder``, as the report shows it.

A run started from a preflight configuration carries ``preflight.json`` in its directory;
when that file has a ``ladder`` key, the report gets a Ladder section per run: a bar chart
of tokens/s per rung in the order tried (the starting configuration first; kept rungs
filled, rejected ones hollow and grey, a rung that failed or was skipped without a bar and
saying so), a table of every rung, and the last kept rung's tokens/s against the run's
measured steady throughput.

Only the JSON is read (the report sits above ``train`` but never imports it). The schema::

    "ladder": {"device": str, "budget_minutes": float, "spent_minutes": float, "world": int,
               "scaling_efficiency": float,  # world > 1: the N-rank rate over N x one rank's
               "selection_bias": float,  # the last kept rate over its "confirm" re-measurement, - 1
               "start": {"tok_per_s", "mfu", "peak_gb", "loss", "seconds", "settings": {key: value}},
               "rungs": [{"rung", "change", "tok_per_s", "mfu", "peak_gb", "loss", "kept", "why",
                          "numerics", "delta_prev", "delta_start", "hours", "cost", "status",
                          "seconds"}, ...],  # seconds: what the rung's trial took of the budget
               "chosen": {key: value},
               "fell_back": {"to", ...}}  # present when the confirmation measured the climb slower than its start

Any number may be null (a rung that ran out of memory measured nothing): it shows as "-".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flopwise.report.compare import measured_tok_per_s
from flopwise.report.runs import Run, number
from flopwise.report.svg import BarChart, esc

START_COLOR, REJECTED_COLOR = "#6B6B6B", "#9A9A9A"
DASH = "-"  # a value the ladder did not measure


@dataclass
class Rung:
    """One row of the ladder; index 0 is the starting configuration."""

    index: int
    name: str
    change: str
    tok_per_s: float | None
    mfu: float | None = None
    peak_gb: float | None = None
    loss: float | None = None
    kept: bool = False
    why: str = ""
    numerics: str = ""
    delta_prev: float | None = None  # fraction: 0.5 = +50% against the previous kept rung
    delta_start: float | None = None  # fraction, against the starting configuration
    hours: float | None = None  # the full run at this rung's rate
    cost: float | None = None
    status: str = "ok"  # ok | oom | error | skipped
    seconds: float | None = None  # what its trial took of the ladder's budget (compile included)

    @property
    def label(self) -> str:
        change = "" if self.change.strip() in ("", "-") else self.change  # "-": a rung with nothing to change
        return "start" if self.index == 0 else (change or self.name or f"rung {self.index}")


@dataclass
class Ladder:
    start: Rung
    rungs: list[Rung]
    device: str = ""
    budget_minutes: float | None = None
    spent_minutes: float | None = None
    world: int = 1  # ranks the last rungs ran on (preflight --nproc-per-node)
    scaling_efficiency: float | None = None
    start_settings: dict[str, Any] = field(default_factory=dict)
    chosen: dict[str, Any] = field(default_factory=dict)
    fell_back: bool = False  # the confirmation measured the climb slower than its start: it ended there

    @property
    def all(self) -> list[Rung]:
        return [self.start, *self.rungs]

    def last_kept(self) -> Rung:
        """The configuration the ladder ended on: its last kept rung with a rate, else the start;
        after a fallback, the start it fell back to (with N ranks, the **ranks** row's launch)."""
        kept = [r for r in self.rungs if r.kept and r.tok_per_s is not None]
        if self.fell_back:
            kept = [r for r in kept if r.name == "ranks"]
        return kept[-1] if kept else self.start


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def read_ladder(preflight: dict[str, Any] | None) -> Ladder | None:
    """The ladder of a ``preflight.json``, or None when it has none (or nothing usable in it)."""
    raw = (preflight or {}).get("ladder")
    if not isinstance(raw, dict):
        return None
    start = _dict(raw.get("start"))
    ladder = Ladder(start=Rung(0, "start", "", number(start.get("tok_per_s")), number(start.get("mfu")),
                               number(start.get("peak_gb")), number(start.get("loss")), kept=True,
                               seconds=number(start.get("seconds"))),
                    rungs=[], device=_text(raw.get("device")), budget_minutes=number(raw.get("budget_minutes")),
                    spent_minutes=number(raw.get("spent_minutes")), start_settings=_dict(start.get("settings")),
                    world=int(number(raw.get("world")) or 1), scaling_efficiency=number(raw.get("scaling_efficiency")),
                    chosen=_dict(raw.get("chosen")), fell_back=bool(raw.get("fell_back")))
    rungs = raw.get("rungs")
    rungs = rungs if isinstance(rungs, list) else []
    for r in (r for r in rungs if isinstance(r, dict)):
        ladder.rungs.append(Rung(
            len(ladder.rungs) + 1, _text(r.get("rung")), _text(r.get("change")), number(r.get("tok_per_s")),
            number(r.get("mfu")), number(r.get("peak_gb")), number(r.get("loss")), r.get("kept") is True,
            _text(r.get("why")), _text(r.get("numerics")), number(r.get("delta_prev")), number(r.get("delta_start")),
            number(r.get("hours")), number(r.get("cost")), _text(r.get("status")) or "ok", number(r.get("seconds"))))
    if not ladder.rungs and ladder.start.tok_per_s is None:
        return None
    return ladder


# --------------------------------------------------------------------------- chart

def ladder_chart(ladder: Ladder, chart_id: str, title: str, kept_color: str) -> BarChart:
    """Tokens/s per rung, one bar each in rung order: the start, kept rungs (filled, the run's
    colour) and rejected ones (hollow, grey); a rung without a rate has no bar, its status instead."""
    rows = ladder.all
    start = [r.tok_per_s if r.index == 0 else None for r in rows]
    kept = [r.tok_per_s if r.index and r.kept else None for r in rows]
    rejected = [r.tok_per_s if r.index and not r.kept else None for r in rows]
    ends = []
    for r in rows:
        if r.tok_per_s is None:
            ends.append(r.status if r.status != "ok" else "not measured")
        else:
            ends.append(_tps(r.tok_per_s) + ("" if r.status == "ok" else f" ({r.status})"))
    return BarChart(chart_id, title, "tokens/s", [r.label for r in rows],
                    [("start", START_COLOR, start), ("kept", kept_color, kept),
                     ("rejected", REJECTED_COLOR, rejected)],
                    end_labels=ends, hollow=("rejected",), label_share=0.45,
                    note="Tokens/s of each rung, in the order the ladder tried them, from the starting configuration. "
                         "Filled: the start and the rungs kept (each builds on the last kept one); hollow grey: "
                         "rejected. A rung that failed or was skipped has no bar and says why.")


# --------------------------------------------------------------------------- table

def _tps(v: float | None) -> str:
    return DASH if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _pct(v: float | None, signed: bool = False) -> str:
    return DASH if v is None else f"{100 * v:+.1f}%" if signed else f"{100 * v:.1f}%"


def _num(v: float | None, fmt: str) -> str:
    return DASH if v is None else format(v, fmt)


def _cost(v: float | None) -> str:
    return DASH if v is None else f"${v:,.2f}"


def _settings(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def ladder_table(ladder: Ladder, run_name: str) -> str:
    head = ["rung", "change", "tok/s", "MFU", "peak GiB", "Δ vs previous kept", "Δ vs start", "kept?", "why",
            "numerics", "full run (h)", "full run cost", "trial (s)"]
    body = []
    for r in ladder.all:
        kept = "start" if r.index == 0 else ("yes" if r.kept else "no") + ("" if r.status == "ok" else f" ({r.status})")
        cells = [("rung", r.name, None, ""), ("change", r.change or ("starting configuration" if r.index == 0 else ""),
                                              None, ""),
                 ("tok_per_s", _tps(r.tok_per_s), r.tok_per_s, "num"), ("mfu", _pct(r.mfu), r.mfu, "num"),
                 ("peak_gb", _num(r.peak_gb, ".2f"), r.peak_gb, "num"),
                 ("delta_prev", _pct(r.delta_prev, True), r.delta_prev, "num"),
                 ("delta_start", _pct(r.delta_start, True), r.delta_start, "num"),
                 ("kept", kept, None, "kept" if r.kept else "rejected"), ("why", r.why, None, "note"),
                 ("numerics", r.numerics, None, ""), ("hours", _num(r.hours, ".2f"), r.hours, "num"),
                 ("cost", _cost(r.cost), r.cost, "num"), ("seconds", _num(r.seconds, ".0f"), r.seconds, "num")]
        tds = "".join((f'<td class="{klass}" ' if klass else "<td ") + f'data-col="{col}"'
                      + (f' data-value="{"" if value is None else repr(value)}"' if klass == "num" else "")
                      + f">{esc(text)}</td>" for col, text, value, klass in cells)
        body.append(f'<tr data-rung="{r.index}" data-kept="{str(r.kept).lower()}" data-status="{esc(r.status)}">'
                    f"{tds}</tr>")
    return (f'<table class="ladder" data-run="{esc(run_name)}"><tr>{"".join(f"<th>{esc(h)}</th>" for h in head)}'
            f'</tr>{"".join(body)}</table>')


def ladder_vs_actual(ladder: Ladder, run: Run) -> tuple[Rung, float | None, float | None]:
    """(the last kept rung, the run's measured steady tokens/s, measured / ladder)."""
    last = ladder.last_kept()
    actual = measured_tok_per_s(run)
    ratio = actual / last.tok_per_s if actual is not None and last.tok_per_s else None
    return last, actual, ratio


def ladder_section(ladder: Ladder, run: Run, figure: str) -> str:
    """One run's part of the Ladder section: a summary line, the chart (``figure``, already
    rendered), the table and the ladder-vs-actual ratio."""
    spent = ""
    if ladder.spent_minutes is not None:
        spent = f"{ladder.spent_minutes:.1f}" + (f" of {ladder.budget_minutes:g}" if ladder.budget_minutes else "")
        spent += " min spent"
    kept = sum(r.kept for r in ladder.rungs)
    ranks = ""
    if ladder.world > 1:
        ranks = f"scaled out to {ladder.world} ranks" + (f" at {ladder.scaling_efficiency:.0%} scaling efficiency"
                                                         if ladder.scaling_efficiency is not None else "")
    summary = " · ".join(x for x in (f"device {ladder.device}" if ladder.device else "", spent,
                                     f"{len(ladder.rungs)} rungs tried, {kept} kept", ranks) if x)
    chosen = (f'<p class="note">chosen: <code>{esc(_settings(ladder.chosen))}</code></p>' if ladder.chosen else "")
    start = (f"<details><summary>starting configuration</summary><p><code>{esc(_settings(ladder.start_settings))}"
             "</code></p></details>" if ladder.start_settings else "")

    last, actual, ratio = ladder_vs_actual(ladder, run)
    where = "the start (no rung kept)" if last.index == 0 else f"rung {last.index} ({last.label})"
    if last.tok_per_s is None:
        vs = "the ladder measured no tokens/s to compare with"
    elif actual is None:
        vs = f"ladder {_tps(last.tok_per_s)} tok/s at {where}; the run has no measured throughput yet"
    else:
        vs = (f"ladder {_tps(last.tok_per_s)} tok/s at {where} · run {_tps(actual)} tok/s (steady, after warm-up) · "
              f"run / ladder = {ratio:.2f}×")
    def value(v: float | None) -> str:
        return "" if v is None else repr(v)

    attrs = (f'data-run="{esc(run.name)}" data-ladder="{value(last.tok_per_s)}" data-actual="{value(actual)}" '
             f'data-ratio="{value(ratio)}"')
    return (f'<section class="ladder" data-run="{esc(run.name)}"><h3><span class="swatch" '
            f'style="background:{esc(run.color)}"></span>{esc(run.name)}</h3><p class="note">{esc(summary)}</p>'
            f"{chosen}{start}{figure}{ladder_table(ladder, run.name)}"
            f'<p class="ladder-vs-actual" {attrs}><b>ladder vs actual:</b> {esc(vs)}</p>'
            '<p class="note">Δ: the change in tokens/s against the previous kept rung (what the ladder decided '
            "on) and against the starting configuration. Numerics: whether the change left the training numerics "
            "the same, as preflight judged it from the rung's loss. Full run: hours and cost of the whole run at "
            "that rung's rate. Trial: the seconds its measurement took of the ladder's budget, compile included. "
            "Ladder vs actual: the run's measured steady tokens/s over the last kept rung's; below 1 the run was "
            "slower than the ladder measured.</p></section>")
