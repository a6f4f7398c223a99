"""Predicted against measured: the plan (``plan.json``), the preflight (``preflight.json``)
and the run itself, for tokens/s, MFU, peak memory and wall time.

The relative error ``(measured - predicted) / predicted`` is the number this exists for:
it says how far the planner can be trusted before the next run is paid for.

What is read (every value optional; a missing one shows as n/a):
- plan.json: ``effective_flops / flops_per_token`` (tokens/s), ``mfu`` (assumed),
  ``memory_gb``; the wall time of the tokens trained at that same rate
  (:func:`flopwise.plan.budget.wall_hours`), else ``hours`` (for ``tokens`` planned).
- preflight.json, at any depth (the shallowest match wins): ``tok_per_s`` |
  ``tokens_per_s``, ``mfu``, ``memory_gb`` | ``peak_memory_gb`` | ``mem_peak_gb``,
  ``wall_time_s`` | ``hours`` (for ``tokens``, if given, else for the run's tokens).
  Never under a ``planner`` / ``plan`` / ``assumed`` key: those hold assumptions (the planner's
  nominal 40% MFU), and a measured null (MFU on a device with no known peak) stays n/a rather
  than falling through to them; nor under ``ladder`` (measured, but on the configurations the
  ladder tried, the starting one first: the report's Ladder section shows them). Each preflight
  value carries its basis: ``measured``, or
  ``assumed`` where preflight.json says so (``memory_basis``) or where the chosen trial
  measured no peak memory (a CPU: the memory is the planner's estimate).
- measured: run.json ``result.tok_per_s`` and ``result.mfu`` (post-warm-up averages), else
  the metrics rows. A resumed run's ``result`` is its last start's alone: its figures are every
  start's steady state pooled (run.json ``starts``, each closed with its own averages, else each
  start's windows in metrics.jsonl; :func:`whole_run_rates`), as its wall time is. Peak memory =
  max ``mem_peak_gb`` (CUDA) or max ``mem_rss_peak_gb`` / ``mem_rss_gb`` (CPU); wall time = the
  last ``elapsed_s`` of each process start, summed (a resumed run restarts the clock), else
  run.json ``result.wall_time_s``.
Predicted wall times are scaled to the tokens actually trained, so a stopped run
compares like with like.
- virtual.json (``preflight --dry-run --rank``, copied by train from beside preflight.json or put
  there by hand): its ``virtual`` object's candidate traced with the run's settings (config.yaml;
  ``auto`` there matches any), else its ``choice``. Its ``prediction.tokens_per_s_per_gpu`` times
  the run's ranks (run.json ``parallel.world_size``: measured tokens/s count every rank's) and
  ``prediction.mfu`` are predicted; its ``peak_gib`` is traced. Nothing of it was measured.
  Its candidates are also paired with preflight.json's measured ``trials`` of the same micro-batch
  and activation checkpointing (:func:`virtual_pairs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flopwise.plan.budget import wall_hours
from flopwise.report.runs import Run, flatten, number


@dataclass
class Comparison:
    key: str  # tok_per_s | mfu | memory_gb | wall_time_s
    label: str
    unit: str
    plan: float | None
    preflight: float | None
    actual: float | None
    note: str = ""
    comparable: bool = True  # False: the measurement is not what was predicted (CPU RSS vs tensors)
    plan_basis: str = ""  # "assumed" where the plan's figure is an assumption, not a model of this run
    preflight_basis: str = ""  # measured | assumed ("" when there is no value)
    trace: float | None = None  # the virtual preflight's (virtual.json): never measured
    trace_basis: str = ""  # predicted | traced (peak memory) ("" when there is no value)

    @staticmethod
    def error(predicted: float | None, actual: float | None) -> float | None:
        """(actual - predicted) / predicted, or None when either is unknown."""
        if predicted is None or actual is None or predicted == 0:
            return None
        return (actual - predicted) / predicted

    @property
    def plan_error(self) -> float | None:
        return self.error(self.plan, self.actual)

    @property
    def preflight_error(self) -> float | None:
        return self.error(self.preflight, self.actual)

    @property
    def trace_error(self) -> float | None:
        return self.error(self.trace, self.actual)


ASSUMPTIONS = frozenset({"planner", "plan", "assumed"})  # preflight.json subtrees that hold no measurement
# preflight.json subtrees measured on other configurations than the one that ran: the optimization
# ladder (``preflight --ladder``) starts from the configuration before its rungs; the report shows it apart
OTHER_CONFIGS = frozenset({"ladder"})


def find(tree: dict[str, Any] | None, *names: str) -> float | None:
    """The first finite number under one of ``names`` at any depth of ``tree``, shallowest first,
    outside the ``ASSUMPTIONS`` subtrees."""
    if not tree:
        return None
    skip = ASSUMPTIONS | OTHER_CONFIGS
    flat = {k: v for k, v in flatten(tree).items() if not skip & set(k.split(".")[:-1])}
    for depth in range(1, 1 + max((k.count(".") + 1 for k in flat), default=1)):
        for name in names:
            for key, value in flat.items():
                if key.count(".") + 1 == depth and key.rsplit(".", 1)[-1] == name and number(value) is not None:
                    return number(value)
    return None


def preflight_memory_basis(pre: dict[str, Any] | None) -> str:
    """``assumed`` when preflight's memory figure is the planner's estimate, else ``measured``."""
    pre = pre or {}
    said = next((v for k, v in flatten(pre).items() if k.rsplit(".", 1)[-1] == "memory_basis"), None)
    if isinstance(said, str):
        return "assumed" if said == "assumed" else "measured"
    chosen, trials = pre.get("chosen"), pre.get("trials")
    if isinstance(chosen, dict) and isinstance(trials, list):  # a preflight.json from before memory_basis
        for t in trials:
            if (isinstance(t, dict) and t.get("micro_batch") == chosen.get("micro_batch_size")
                    and t.get("checkpointing") == chosen.get("activation_checkpointing")):
                return "measured" if number(t.get("peak_gb")) is not None else "assumed"
    return "measured"


def trained_tokens(run: Run) -> float | None:
    res = number(run.result.get("tokens"))
    if res is not None:
        return res
    tokens = run.values("tokens")
    return max(tokens) if tokens else None


@dataclass
class Start:
    """One process start of a run, measured after its own warm-up (its steady state): the step it
    began at, the tokens trained in its steady windows and their seconds, and the tokens the
    device's dense peak would have trained in those seconds (tokens / MFU; None without a peak)."""

    at_step: float
    tokens: float = 0.0
    seconds: float = 0.0
    peak_tokens: float | None = 0.0


def _warmup_steps(run: Run) -> int:
    given = number(run.flat_config().get("train.warmup_log_steps"))
    return int(given) if given is not None and given >= 0 else 3  # config.py's default


def _start_from_rows(run: Run, at: float, end: float) -> Start:
    """A start's steady state from its metrics.jsonl windows (rows after ``at``, up to ``end``),
    as the trainer's meter counts it: a window counts when all its steps come
    ``train.warmup_log_steps`` or more after the start's first."""
    warm, out = _warmup_steps(run), Start(at)
    prev_step, prev_tokens = at, run.tokens_at(at) if at else 0.0
    for r in (r for r in run.training_rows() if at < r["step"] <= end):
        tokens, rate, mfu = number(r.get("tokens")), number(r.get("tok_per_s")), number(r.get("mfu"))
        if prev_step - at >= warm and tokens is not None and prev_tokens is not None and tokens > prev_tokens \
                and rate:
            n = tokens - prev_tokens
            out.tokens, out.seconds = out.tokens + n, out.seconds + n / rate
            out.peak_tokens = out.peak_tokens + n / mfu if out.peak_tokens is not None and mfu else None
        prev_step, prev_tokens = r["step"], tokens
    return out


def start_figures(run: Run) -> list[Start]:
    """Each process start's steady state: its run.json entry's averages (train records them when
    the start ends), else its metrics.jsonl windows (a start that crashed, or a run.json from
    before train recorded them)."""
    starts = run.starts()
    out = []
    for i, (at, entry) in enumerate(starts):
        tps, secs, mfu = (number(entry.get(k)) for k in ("tok_per_s", "steady_time_s", "mfu"))
        if tps is not None and secs:
            out.append(Start(at, tps * secs, secs, tps * secs / mfu if mfu else None))
        else:
            out.append(_start_from_rows(run, at, starts[i + 1][0] if i + 1 < len(starts) else math.inf))
    return out


def whole_run_rates(run: Run) -> tuple[float, float | None] | None:
    """(tokens/s, MFU) of a run of several process starts, over all of them: every start's
    steady-state tokens over their seconds (each start's own warm-up left out, as one start's
    figure leaves out its), and those tokens over the tokens the device's peak would have trained
    in the same seconds (None where a start had no peak). None for a run of one start, or of no
    steady window in any."""
    starts = start_figures(run)
    timed = [s for s in starts if s.seconds > 0]
    if len(starts) < 2 or not timed:
        return None
    tokens, seconds = sum(s.tokens for s in timed), sum(s.seconds for s in timed)
    peaks = [s.peak_tokens for s in timed]
    at_peak = sum(p for p in peaks if p is not None)
    return tokens / seconds, tokens / at_peak if None not in peaks and at_peak > 0 else None


def measured_tok_per_s(run: Run) -> float | None:
    """run.json's steady-state average (a run of several starts: every start's, pooled,
    :func:`whole_run_rates`); else tokens over time across the logged windows, leaving out the
    first window (compilation, warm-up) when there are others."""
    whole = whole_run_rates(run)
    if whole is not None:
        return whole[0]
    res = number(run.result.get("tok_per_s")) if len(run.starts()) < 2 else None  # else the last start's
    if res is not None:
        return res
    rows = [r for r in run.training_rows() if number(r.get("tok_per_s"))]
    tokens, seconds, prev = 0.0, 0.0, None
    for r in rows:
        t = number(r.get("tokens"))
        rate = number(r["tok_per_s"])  # never None nor 0: rows keeps only those
        if prev is not None and t is not None and t > prev and rate:
            tokens += t - prev
            seconds += (t - prev) / rate
        prev = t
    if seconds > 0:
        return tokens / seconds
    return rows[-1]["tok_per_s"] if rows else None


def measured_mfu(run: Run) -> float | None:
    """As :func:`measured_tok_per_s`: the whole run's, over all its starts."""
    whole = whole_run_rates(run)
    if whole is not None:
        return whole[1]
    res = number(run.result.get("mfu")) if len(run.starts()) < 2 else None  # else the last start's
    if res is not None:
        return res
    given = [number(r.get("mfu")) for r in run.training_rows()[1:] or run.training_rows()]
    values = [v for v in given if v is not None]
    return sum(values) / len(values) if values else None


def measured_memory(run: Run) -> tuple[float | None, str]:
    """Peak memory in GiB and what it is (CUDA peak allocated, or the CPU process's RSS)."""
    for key, what in (("mem_peak_gb", "CUDA peak allocated"), ("mem_alloc_gb", "CUDA allocated"),
                      ("mem_rss_peak_gb", "process RSS peak"), ("mem_rss_gb", "process RSS")):
        values = run.values(key)
        if values:
            return max(values), what
    return None, ""


def measured_wall_time(run: Run) -> float | None:
    total, last = 0.0, None
    timed = [r for r in run.rows if number(r.get("elapsed_s")) is not None]
    for r in sorted(timed, key=lambda r: number(r.get("step")) or 0.0):
        e = number(r["elapsed_s"])
        assert e is not None  # timed keeps only the rows with a number here
        if last is not None and e < last:  # the clock restarted: a resumed run
            total += last
        last = e
    if last is not None:
        return total + last
    return number(run.result.get("wall_time_s"))


VIRTUAL_SETTINGS = ("train.micro_batch_size", "train.activation_checkpointing", "train.compile", "train.loss",
                    "parallel.strategy")  # what a virtual preflight's candidates differ in


def run_world(run: Run) -> int:
    """The ranks the run trained on (run.json ``parallel``); 1 when it does not say."""
    par = (run.record or {}).get("parallel")
    ranks = number(par.get("world_size")) if isinstance(par, dict) else None
    return int(ranks) if ranks and ranks >= 1 else 1


def _candidates(virtual: dict[str, Any] | None) -> list[dict[str, Any]]:
    given = (virtual or {}).get("candidates")
    return [c for c in given if isinstance(c, dict) and isinstance(c.get("settings"), dict)] \
        if isinstance(given, list) else []


def virtual_candidate(run: Run) -> tuple[dict[str, Any] | None, str]:
    """(the virtual preflight's candidate to hold against the run, what it is): the one traced with
    the run's settings, else the virtual preflight's choice; (None, "") without virtual.json."""
    flat = run.flat_config()
    if flat:
        auto = [k.split(".")[-1] for k in VIRTUAL_SETTINGS if flat.get(k) in (None, "auto")]
        for c in _candidates(run.virtual):
            if all(flat.get(k) in (None, "auto") or c["settings"].get(k) == flat.get(k) for k in VIRTUAL_SETTINGS):
                # config.yaml keeps an `auto` as asked (decided again on resume): it matches any candidate's
                return c, "the candidate with the run's settings" + (f" ({', '.join(auto)} auto in config.yaml: "
                                                                     "taken as any)" if auto else "")
    choice = (run.virtual or {}).get("choice")
    if isinstance(choice, dict):
        return choice, "its choice (the run's settings were not among its candidates)"
    return None, ""


def trace_figures(run: Run) -> tuple[float | None, float | None, float | None, str]:
    """(predicted tokens/s of the run's ranks together, predicted MFU, traced peak GiB, a note)."""
    c, which = virtual_candidate(run)
    if c is None:
        return None, None, None, ""
    pred = c.get("prediction")
    pred = pred if isinstance(pred, dict) and pred.get("predicted") is not False else {}
    per_gpu, world = number(pred.get("tokens_per_s_per_gpu")), run_world(run)
    v = run.virtual or {}
    ranks = number(v.get("world"))
    on = f"{int(ranks) if ranks else '?'} × {str(v.get('gpu') or '?')[:60]}"  # a hand-written file: bounded
    note = f"virtual preflight: predicted for {on}, {which}" + (f"; per GPU × the run's {world} ranks"
                                                                 if world > 1 else "")
    return (per_gpu * world if per_gpu is not None else None, number(pred.get("mfu")), number(c.get("peak_gib")),
            note)


def _scaled_time(seconds: float | None, for_tokens: float | None, tokens: float | None) -> float | None:
    if seconds is None:
        return None
    if for_tokens and tokens:
        return seconds * tokens / for_tokens
    return seconds


def _step_text(step: float) -> str:
    return f"{step:,.0f}" if float(step).is_integer() else f"{step:g}"


def resumed_text(run: Run) -> str:
    """``resumed at steps 400, 900`` for a resumed run; "" for a run of one start."""
    resumed = [step for step, _ in run.starts()[1:]]
    if not resumed:
        return ""
    return f"resumed at step{'s' if len(resumed) > 1 else ''} " + ", ".join(_step_text(s) for s in resumed)


def measured_notes(run: Run) -> tuple[str, str, str]:
    """What the measured tokens/s, MFU and wall time are of: the whole run, over all its starts."""
    n = len(run.starts())
    if n < 2:
        return "measured: average after warm-up", "", ""
    over = f"all {n} starts"
    tps = (f"measured: average after warm-up over {over} (each start's own warm-up left out)"
           if whole_run_rates(run) is not None else f"measured: over the logged windows of {over}, after the first")
    return tps, f"measured: over {over}", f"measured: {over}' times summed (each restarts the clock)"


def compare(run: Run) -> list[Comparison]:
    """The four predicted-against-measured rows of one run."""
    plan, pre = run.plan or {}, run.preflight
    tokens = trained_tokens(run)

    eff, fpt = number(plan.get("effective_flops")), number(plan.get("flops_per_token"))
    plan_tps = eff / fpt if eff and fpt else None
    plan_mfu = number(plan.get("mfu"))
    plan_hours = number(plan.get("hours"))
    # the plan's wall time for the tokens trained, by the plan's one definition (an end-to-end MFU):
    # the same rate as its tokens/s above, at any GPU count
    plan_time = (3600 * wall_hours(tokens * fpt, eff) if eff and fpt and tokens else
                 _scaled_time(3600 * plan_hours if plan_hours else None, number(plan.get("tokens")), tokens))

    pre_tps = find(pre, "tok_per_s", "tokens_per_s", "tokens_per_second")
    pre_mfu = find(pre, "mfu")
    pre_mem = find(pre, "memory_gb", "peak_memory_gb", "mem_peak_gb", "peak_mem_gb")
    pre_time = find(pre, "wall_time_s")
    pre_hours = find(pre, "hours")
    if pre_time is None and pre_hours is not None:
        pre_time = 3600 * pre_hours
    pre_time = _scaled_time(pre_time, find(pre, "tokens"), tokens)
    if pre_time is None and pre_tps and tokens:
        pre_time = tokens / pre_tps

    mem, mem_what = measured_memory(run)
    mem_note = mem_what
    if mem_what.startswith("process RSS"):
        mem_note += " (includes the Python and torch runtime, which the plan's model of tensors leaves out)"
    mem_basis = preflight_memory_basis(pre)
    if pre_mem is not None and mem_basis == "assumed":
        mem_note += ("; " if mem_note else "") + "preflight: the planner's estimate (no peak measured on its device)"
    tps_note, mfu_measured, time_measured = measured_notes(run)
    time_note = "; ".join(x for x in (time_measured, "predictions scaled to the tokens trained" if tokens else "")
                          if x)
    if plan_tps is None and plan:
        plan_note = "no device peak in the plan: no time prediction"
        time_note = "; ".join(x for x in (time_note, plan_note) if x)

    def basis(value: float | None, what: str = "measured") -> str:
        return "" if value is None else what

    mfu_note = "plan: the MFU it assumes" if plan_tps is not None else "no device peak: MFU n/a in the plan"
    if pre is not None and pre_mfu is None:
        mfu_note += "; preflight: n/a (no device peak)"
    mfu_note = "; ".join(x for x in (mfu_note, mfu_measured) if x)
    trace_tps, trace_mfu, trace_mem, trace_note = trace_figures(run)
    return [
        Comparison("tok_per_s", "tokens/s", "tok/s", plan_tps, pre_tps, measured_tok_per_s(run),
                   "; ".join(x for x in (tps_note, trace_note) if x),
                   preflight_basis=basis(pre_tps), trace=trace_tps, trace_basis=basis(trace_tps, "predicted")),
        Comparison("mfu", "MFU", "%", plan_mfu if plan_tps is not None else None, pre_mfu, measured_mfu(run),
                   mfu_note, plan_basis=basis(plan_mfu if plan_tps is not None else None, "assumed"),
                   preflight_basis=basis(pre_mfu), trace=trace_mfu, trace_basis=basis(trace_mfu, "predicted")),
        Comparison("memory_gb", "peak memory", "GiB", number(plan.get("memory_gb")), pre_mem, mem, mem_note,
                   comparable=not mem_what.startswith("process RSS"), preflight_basis=basis(pre_mem, mem_basis),
                   trace=trace_mem, trace_basis=basis(trace_mem, "traced")),
        Comparison("wall_time_s", "wall time", "s", plan_time, pre_time, measured_wall_time(run), time_note,
                   preflight_basis=basis(pre_time)),
    ]


@dataclass
class Pair:
    """A virtual preflight candidate beside the preflight trial of its micro-batch and checkpointing."""

    settings: dict[str, Any]  # the candidate's (VIRTUAL_SETTINGS keys)
    predicted: float | None  # tokens/s per GPU, predicted (None: it did not fit by trace, or no prediction)
    measured: float | None  # the trial's tokens/s (a preflight's trials run on one GPU)
    status: str  # the trial's: ok | oom | no-fit | error
    fits: bool = True

    @property
    def ratio(self) -> float | None:
        """measured / predicted."""
        return self.measured / self.predicted if self.measured is not None and self.predicted else None


def virtual_pairs(run: Run) -> list[Pair]:
    """Each preflight.json trial with each virtual candidate of the same micro-batch and activation
    checkpointing, in the trials' order; empty without both files."""
    trials = (run.preflight or {}).get("trials")
    pairs = []
    for t in trials if isinstance(trials, list) and run.virtual else []:
        if not isinstance(t, dict):
            continue
        for c in _candidates(run.virtual):
            s = c["settings"]
            if s.get("train.micro_batch_size") == t.get("micro_batch") and \
                    s.get("train.activation_checkpointing") == t.get("checkpointing"):
                given = c.get("prediction")
                pred: dict[str, Any] = given if isinstance(given, dict) else {}
                predicted = number(pred.get("tokens_per_s_per_gpu")) if pred.get("predicted") is not False else None
                pairs.append(Pair(s, predicted, number(t.get("tok_per_s")), str(t.get("status") or "ok"),
                                  c.get("fits") is not False))
    return pairs
