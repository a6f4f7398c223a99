"""The plan as a readable table: each number next to the inputs of its formula.

:func:`format_plan` lays out :data:`SECTIONS`, the plan's sections as data. A section is a
title and its items, each shown where its ``when`` holds: a :class:`Row` (a label, a value,
and how the value came about: its formula and inputs), a free :class:`Line`, a
:class:`Table` of columns, or :class:`Each`, a row for every item of a list. A field that is
a function is called with the plan (a :class:`PlanView`); anything else is shown as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from flopwise.plan import accuracy, hardware
from flopwise.plan.budget import epochs_text


def _n(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "n/a"
    for threshold, suffix in ((1e24, "Y"), (1e21, "Z"), (1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"),
                              (1e6, "M"), (1e3, "K")):
        if abs(x) >= threshold:
            return f"{x / threshold:.{digits}g} {suffix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


def _count(x: float | None) -> str:
    """Parameters and tokens: 361.8M, 7.2B."""
    if x is None:
        return "n/a"
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= threshold:
            return f"{x / threshold:.4g}{suffix}"
    return f"{x:.0f}"


def hours_text(h: float | None) -> str:
    if h is None:
        return "n/a"
    if h < 1:
        return f"{h * 60:.1f} min"
    if h < 48:
        return f"{h:.1f} h"
    return f"{h:.0f} h ({h / 24:.1f} days)"


def hours_range(low: float, high: float) -> str:
    """A range of wall times in the unit :func:`hours_text` gives the longer: ``27.6-32.9 h``."""
    if high < 1:
        return f"{low * 60:.1f}-{high * 60:.1f} min"
    if high < 48:
        return f"{low:.1f}-{high:.1f} h"
    return f"{low:.0f}-{high:.0f} h ({low / 24:.1f}-{high / 24:.1f} days)"


def gpu_hours_text(h: float) -> str:
    """GPU-hours to a tenth, or to a hundredth below one (``0.13``, not ``0.1``)."""
    return f"{h:,.{2 if h < 1 else 1}f}"


def gpu_hours_range(low: float, high: float) -> str:
    """A range of GPU-hours, to the digits of :func:`gpu_hours_text`'s larger end: ``0.12-0.14``."""
    digits = 2 if high < 1 else 1
    return f"{low:,.{digits}f}-{high:,.{digits}f}"


def network_text(facts: dict[str, Any]) -> str:
    """How a multi-node figure names the network it assumed (:func:`hardware.network_facts`):
    ``network ib-ndr, 400 Gb/s per GPU between nodes (default; --network to change)``."""
    how = "default; --network to change" if facts["default"] else "from --network"
    nic = "shared by a node's GPUs" if facts.get("nic") == "shared by the node" else "per GPU"
    return f"network {facts['name']}, {facts['gbit_per_s']:g} Gb/s {nic} between nodes ({how})"


def _gb(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} GiB"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _pct(share: float | None, digits: int = 1) -> str:
    return "n/a" if share is None else f"{100 * share:.{digits}f}%"


# ---------------------------------------------------------------- the layout's vocabulary
class PlanView:
    """The plan (:func:`~flopwise.plan.budget.build_plan`) with the parts its rows read at hand."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.breakdown: dict[str, Any] = plan["params_breakdown"] or {}  # empty with --params
        self.moe = bool(self.breakdown.get("router"))  # FLOPs and Chinchilla count active parameters
        self.gpu: dict[str, Any] = plan["gpu"]
        self.memory: dict[str, Any] = plan["memory"]
        self.settings: dict[str, Any] = self.memory["settings"]
        self.defaults: dict[str, str] = plan.get("defaults") or {}  # flopwise plan's: what each auto became
        self.batch: dict[str, Any] = plan["batch"]
        self.scaling: dict[str, Any] = plan["scaling"]
        self.diloco: dict[str, Any] = plan.get("diloco") or {}
        self.seq_len: int = plan["seq_len"]
        # said after each time and cost when the set-up as asked does not fit
        self.not_runnable = ("  NOT runnable: does not fit in memory (see the top)"
                             if plan.get("runnable") is False else "")


Text = str | Callable[[PlanView], str]  # what is shown, or how to make it from the plan
When = Callable[[PlanView], Any]  # shown where truthy


def _always(v: PlanView) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """``  label  value  how``: ``value`` (the plan's number, or a function of the plan that
    gives it) shown by ``fmt``; ``how`` says which formula and inputs gave it."""

    label: Text
    value: Any
    fmt: Callable[[Any], str] = str
    how: Text = ""
    when: When = field(default=_always, kw_only=True)


@dataclass(frozen=True)
class Line:
    """A line of prose in a section, indented like its rows."""

    text: Text
    when: When = field(default=_always, kw_only=True)


@dataclass(frozen=True)
class Column:
    """A column of a :class:`Table`."""

    header: str
    align: str  # the format spec of its cells and header: "<9", ">10"
    gap: str = " "  # before it (none before the first column)


@dataclass(frozen=True)
class Table:
    """A header of ``columns``, then one line per tuple of ``rows`` (its cells, formatted)."""

    columns: tuple[Column, ...]
    rows: Callable[[PlanView], Iterable[tuple[str, ...]]]
    when: When = field(default=_always, kw_only=True)


@dataclass(frozen=True)
class Each:
    """The row ``row`` makes of each of ``items``."""

    items: Callable[[PlanView], Iterable[Any]]
    row: Callable[[Any], Row]


@dataclass(frozen=True)
class Section:
    """A title, then its items' lines; the whole section only where ``when`` holds."""

    title: Text
    items: tuple[Row | Line | Table | Each, ...]
    when: When = field(default=_always, kw_only=True)


def _resolve(x: Any, v: PlanView) -> Any:
    """A field's content: a function is called with the plan, anything else is as it is."""
    return x(v) if callable(x) else x


def _lines(item: Row | Line | Table | Each, v: PlanView) -> list[str]:
    """The one renderer: an item's lines (none where its ``when`` does not hold)."""
    if isinstance(item, Each):
        return [line for x in item.items(v) for line in _lines(item.row(x), v)]
    if not item.when(v):
        return []
    if isinstance(item, Row):
        label, value, how = _resolve(item.label, v), item.fmt(_resolve(item.value, v)), _resolve(item.how, v)
        return [f"  {label:<26} {value:<18} {how}".rstrip()]
    if isinstance(item, Line):
        return [f"  {_resolve(item.text, v)}"]
    columns = item.columns
    return [_table_line(columns, [c.header for c in columns]), *(_table_line(columns, r) for r in item.rows(v))]


def _table_line(columns: tuple[Column, ...], cells: Sequence[str]) -> str:
    return ("  " + "".join((c.gap if i else "") + f"{cell:{c.align}}"
                           for i, (c, cell) in enumerate(zip(columns, cells)))).rstrip()


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text: its title, what does not fit (:func:`_fit_banner`), then :data:`SECTIONS`."""
    v = PlanView(plan)
    data = plan.get("data") or {}
    out = [f"flopwise plan · {plan['model']}", *_fit_banner(plan),
           *([f"  ! {data['warning']}"] if data.get("warning") else [])]
    for section in SECTIONS:
        if section.when(v):
            out += ["", _resolve(section.title, v)]
            for item in section.items:
                out += _lines(item, v)
    return "\n".join(out)


# ---------------------------------------------------------------- what the rows read
def _plan(key: str) -> Callable[[PlanView], Any]:
    return lambda v: v.plan[key]


def _part(key: str) -> Callable[[PlanView], Any]:
    """A part of the parameter count."""
    return lambda v: v.breakdown[key]


def _memory(key: str) -> Callable[[PlanView], Any]:
    """A term of the memory per GPU, in GiB (None where the plan has none)."""
    return lambda v: v.memory.get(key)


def _budgeted(v: PlanView) -> bool:
    """Whether the plan has a token budget (--tokens, --hours or --chinchilla)."""
    return v.plan["tokens"] is not None


def _predicted(v: PlanView) -> bool:
    """Whether the time and cost are at a predicted MFU (plan --trace), not an assumed one."""
    return v.plan.get("mfu_source", "assumed") != "assumed"


def _likely(key: str, text: Callable[[float, float], str]) -> Callable[[PlanView], str]:
    """``; likely LOW-HIGH`` of the plan's ``band`` range of ``key`` (plan --trace), else nothing."""
    def likely(v: PlanView) -> str:
        span = (v.plan.get("band") or {}).get(key)
        return f"; likely {text(*span)}" if span else ""
    return likely


def _hours_budget(v: PlanView) -> str:
    """The budget the wall time is (--hours, or a run's train.max_hours when it binds or is its only
    limit), or "" when the wall time is the tokens' time."""
    return v.plan.get("hours_budget") or ("--hours" if v.plan.get("hours_given") else "")


def _tokens_predicted(v: PlanView) -> bool:
    """Whether the tokens are what a time budget affords at a predicted MFU (plan --trace)."""
    return _predicted(v) and bool(_hours_budget(v))


def _tokens_how(v: PlanView) -> str:
    """The tokens' row: the limit that set them (a configured run's first-reached limit), and,
    under a time budget with a predicted MFU, that they are what the prediction affords."""
    limit = v.plan.get("limit") or ""
    how = f"set by {limit}" if limit.startswith("train.") else ""
    if not _tokens_predicted(v):
        return how
    predicted = (f"predicted: what {_hours_budget(v)} affords at the traced step's predicted MFU"
                 + _likely("tokens", lambda lo, hi: f"{_count(lo)}-{_count(hi)}")(v))
    return f"{how}; {predicted}" if how else predicted


# ---------------------------------------------------------------- Parameters
def _has_breakdown(v: PlanView) -> bool:
    return bool(v.breakdown)


def _share(key: str) -> Callable[[PlanView], str]:
    return lambda v: f"{100 * v.breakdown[key] / v.plan['params']:.1f}% of total"


def _mlp_how(v: PlanView) -> str:
    b = v.breakdown
    return _share("mlp")(v) + (f"; active per token {_count(b['mlp_active'])} (router {_count(b['router'])})"
                               if v.moe else "")


def _total_how(v: PlanView) -> str:
    if not v.breakdown:
        return "given with --params"
    return f"active {v.breakdown['active']:,}" if v.breakdown["active"] != v.plan["params"] else ""


PARAMETERS = Section("Parameters", (
    Row("embedding", _part("embedding"), _count, _share("embedding"), when=_has_breakdown),
    Row("positions (learned)", _part("position"), _count, _share("position"),
        when=lambda v: v.breakdown.get("position")),
    Row("attention", _part("attention"), _count, _share("attention"), when=_has_breakdown),
    Row(lambda v: "MLP (all experts)" if v.moe else "MLP", _part("mlp"), _count, _mlp_how, when=_has_breakdown),
    Row("norms", _part("norm"), _count, _share("norm"), when=_has_breakdown),
    Row("LM head", _part("lm_head"), lambda n: _count(n) if n else "tied",
        lambda v: _share("lm_head")(v) if v.breakdown["lm_head"] else "shares the embedding matrix",
        when=_has_breakdown),
    Row("total", _plan("params"), lambda n: f"{n:,}", _total_how),
    Row("N_matmul", _part("matmul"), _count, "weights in matmuls, head once (lookups, norms and biases excluded)",
        when=_has_breakdown),
))


# ---------------------------------------------------------------- FLOPs
FLOPS = Section("FLOPs", (
    Row("per token (PaLM)", _plan("flops_per_token_palm"), _n,
        lambda v: f"6·N_matmul + 12·L·d_attn·T at T={v.seq_len}",
        when=lambda v: v.plan["flops_per_token_palm"] is not None),
    Row("per token (6N)", _plan("flops_per_token_6n"), _n,
        lambda v: "6 × parameters" + (" (active)" if v.moe else "")),
    Row("per token (hardware)", _plan("flops_per_token_hardware"), _n,
        lambda v: f"+ recomputed forward of {100 * v.plan['recomputed_fraction']:.0f}% of the blocks (HFU's numerator)",
        when=lambda v: v.plan.get("flops_per_token_hardware")),
    Row("formula used", _plan("flops_formula")),
    Row("tokens", _plan("tokens"), _count, _tokens_how, when=_budgeted),
    Row("total", _plan("total_flops"), lambda x: _n(x, "FLOP"),
        lambda v: "FLOPs/token × tokens" + (" (predicted tokens)" if _tokens_predicted(v) else ""), when=_budgeted),
))


# ---------------------------------------------------------------- Time and cost
def _peak_how(v: PlanView) -> str:
    g = v.gpu
    if not g["peak_tflops"]:
        return "no peak: give --gpu or --peak-tflops"
    return f"dense {g['dtype']} peak {g['peak_tflops']:g} TFLOP/s ({g['peak_source']})"


def _timed(v: PlanView) -> bool:
    return v.plan["hours"] is not None


def _communicating(v: PlanView) -> bool:
    """Whether the plan estimates communication inside its wall time (several GPUs, a peak, tokens)."""
    return v.plan["gpus"] > 1 and v.plan.get("comm_hours") is not None


def _comm_how(v: PlanView) -> str:
    """The communication row's reading: a part of the wall time (the MFU holds it), and a flag when
    the estimate alone exceeds what the MFU leaves off the peak."""
    at, mfu = v.scaling["at_gpus"], v.plan["mfu"]
    how = f"of the wall time: {100 * at['comm_share']:.1f}% of each step if not overlapped (see Scaling)"
    if at.get("comm_exceeds_mfu"):
        how += (f" -- MORE than the {100 * (1 - mfu):.0f}% of the step an MFU of {100 * mfu:.0f}% leaves off the peak: "
                "expect a lower MFU at this GPU count")
    return how


def _wall_how(v: PlanView) -> str:
    given = _hours_budget(v)
    budget = f"{given}; " if given else ""
    if v.plan.get("compute_hours") is None:
        return f"{given or '--hours'} (no peak: no tokens)"
    if _predicted(v) and budget:
        return f"{given} (the tokens it affords are predicted)"
    if _predicted(v):
        return ("predicted: total FLOPs ÷ effective FLOP/s at the traced step's predicted MFU"
                + _likely("hours", hours_range)(v))
    return f"{budget}total FLOPs ÷ effective FLOP/s"


def _priced_on_prediction(v: PlanView) -> bool:
    """The GPU-hours and cost come from a predicted wall time (not a time budget)."""
    return _predicted(v) and not _hours_budget(v)


def _gpu_hours_how(v: PlanView) -> str:
    how = f"{hours_text(v.plan['hours'])} × {v.plan['gpus']}"
    if not _priced_on_prediction(v):
        return how
    return f"predicted: {how}" + _likely("gpu_hours", gpu_hours_range)(v)


def _cost_how(v: PlanView) -> str:
    how = f"GPU-hours × ${v.plan['price_per_gpu_hour']:g}/GPU-hour"
    if _priced_on_prediction(v):
        how = f"predicted: {how}" + _likely("cost", lambda lo, hi: f"${lo:,.2f}-${hi:,.2f}")(v)
    return how + v.not_runnable


def _band_line(v: PlanView) -> str:
    """Where the plan's "likely" ranges come from (plan/accuracy.py)."""
    return f"likely ranges: {accuracy.band_text(v.plan['band'])}"


def _across_nodes(v: PlanView) -> bool:
    """The GPUs planned are more than a node: the time and cost hold the network's communication."""
    network = v.scaling.get("network")
    return network is not None and v.plan["gpus"] > network["gpus_per_node"]


def _mfu_how(v: PlanView) -> str:
    source = v.plan.get("mfu_source", "assumed")
    if source == "assumed":
        return "assumed model FLOPs utilisation (--mfu); flopwise plan --trace predicts it from the traced step"
    return f"predicted: {source} (communication included; not measured)"


TIME_AND_COST = Section("Time and cost", (
    Row("GPU", lambda v: f"{v.gpu['name'] or 'unspecified'} × {v.plan['gpus']}", how=_peak_how),
    Row("GPU memory", lambda v: v.gpu["memory_gb"], lambda gb: f"{gb:g} GiB",
        lambda v: f"per GPU ({v.gpu.get('memory_source') or 'hardware table'})",
        when=lambda v: v.gpu.get("memory_gb")),
    Row("MFU", _plan("mfu"), lambda mfu: f"{100 * mfu:.1f}%", _mfu_how),
    Row("effective", _plan("effective_flops"), lambda x: _n(x, "FLOP/s"),
        lambda v: f"{v.gpu['peak_tflops']:g}T × {v.plan['gpus']} GPUs × {v.plan['mfu']:g}"
                  + (" (predicted MFU)" if v.plan.get("mfu_source", "assumed") != "assumed" else ""),
        when=_plan("effective_flops")),
    Row("communication", _plan("comm_hours"), hours_text, _comm_how,
        when=lambda v: _communicating(v) and not _predicted(v)),
    Row("network", lambda v: v.scaling["network"]["name"],
        how=lambda v: network_text(v.scaling["network"]).split(", ", 1)[1], when=_across_nodes),
    Row("wall time", _plan("hours"), hours_text, lambda v: _wall_how(v) + v.not_runnable, when=_timed),
    Row("GPU-hours", _plan("gpu_hours"), gpu_hours_text, _gpu_hours_how, when=_timed),
    Row("cost", _plan("cost"), lambda usd: f"${usd:,.2f}", _cost_how,
        when=lambda v: _timed(v) and v.plan["cost"] is not None),
    Line(_band_line, when=lambda v: _timed(v) and v.plan.get("band")),
    Line("(no --tokens, --hours or --chinchilla: no time estimate)",
         when=lambda v: not _timed(v) and not _budgeted(v)),
))


# ---------------------------------------------------------------- Chinchilla
CHINCHILLA = Section("Chinchilla", (
    Row("optimal tokens", _plan("chinchilla_tokens"), _count,
        lambda v: "20 × parameters" + (" (active)" if v.moe else "")),
    Row("planned", lambda v: f"{_count(v.plan['tokens'])} ({v.plan['tokens_per_param']:.1f}/param)",
        how=lambda v: f"{v.plan['chinchilla_ratio']:.2f}× Chinchilla"
                      + (" (predicted tokens)" if _tokens_predicted(v) else ""),
        when=_budgeted),
    Line(lambda v: f"verdict: {v.plan['verdict']}", when=_budgeted),
))


# ---------------------------------------------------------------- Data
def _data(key: str) -> Callable[[PlanView], Any]:
    return lambda v: v.plan["data"][key]


DATA = Section("Data", (
    Row("train tokens", _data("train_tokens"), lambda n: f"{n:,}", lambda v: f"data.path {v.plan['data']['path']}"),
    Row("epochs", _data("epochs"), epochs_text, "planned tokens ÷ train tokens (approximately: the loader packs "
        "windows and drops a partial step per epoch)", when=lambda v: v.plan["data"]["epochs"] is not None),
    Line(lambda v: f"WARNING: {v.plan['data']['warning']}", when=lambda v: v.plan["data"]["warning"]),
), when=lambda v: v.plan.get("data"))


# ---------------------------------------------------------------- Memory per GPU
def _settings_line(v: PlanView) -> str:
    s = v.settings
    ckpt = s["activation_checkpointing"]
    if ckpt == "selective":
        k = s["activation_checkpointing_every"]
        ckpt += f" (blocks 0, {k}, {2 * k}, ...)"
    weights = {"bf16-pure": " (fp32 master weights)" if s["master_weights"] else " (no master weights)",
               "bf16": " (autocast, fp32 weights)", "fp16": " (autocast, fp32 weights)"}.get(s["precision"], "")
    strategy = s["strategy"]
    if strategy == "diloco":
        strategy += f" ({s['inner_strategy']} in groups of {s['group_size']})"
    if strategy == "hsdp":
        groups = s["n_gpus"] // s["group_size"]
        strategy += f" (sharded in groups of {s['group_size']}, {groups} replica{'s' if groups > 1 else ''})"
    return (f"settings: precision {s['precision']}{weights} · compile {_compile_mode(v)} · attention {s['attention']}"
            f" · checkpointing {ckpt} · loss {s['loss']} · {strategy} on {s['n_gpus']} GPU(s)")


def _compile_mode(v: PlanView) -> str:
    """``train.compile`` as planned: the mode ``flopwise plan`` resolved (its ``defaults``), else
    whether the memory model counts the step compiled."""
    mode = v.defaults.get("compile", "").removeprefix("auto -> ").split(" ")[0]
    return mode or ("on" if v.settings.get("compiled") else "off")


def _defaults_line(v: PlanView) -> str:
    """What each ``auto`` of the planned step became, as a default ``train`` resolves it on a GPU."""
    return "as a default train on a GPU: " + " · ".join(f"{k} {x}" for k, x in v.defaults.items() if "auto" in x)


def _logits_how(v: PlanView) -> str:
    if v.settings["loss"] != "plain":
        return "chunked: head-input and head-weight gradients computed in forward"
    if v.settings.get("loss_in_graph"):
        return "in the compiled graph: int64 targets and a float32 log-sum-exp a row; no logits saved"
    return "LM-head output and float32 log-softmax"


def _counted(v: PlanView) -> bool:
    """Whether activations are counted (not with --params: no model shape)."""
    return v.memory.get("activations") is not None


def _shown(key: str) -> When:
    return lambda v: bool(v.memory.get(key)) and v.memory[key] >= 0.005  # hide terms that round to 0.00 GiB


def _memory_verdict(v: PlanView) -> str:
    plan = v.plan
    verdict = ""
    if plan["fits"] is not None:
        under = f"under {100 * plan['headroom']:.0f}% of {v.gpu['memory_gb']:g} GiB"
        verdict = f"fits {under}" if plan["fits"] else f"does NOT fit {under}"
    if not _counted(v):
        verdict = "states only, activations NOT counted" + (f"; {verdict} before activations" if verdict else "")
    return verdict


def _variant_row(variant: tuple[str, dict[str, Any]]) -> Row:
    """A row of ``plan["memory_variants"]``: the memory with another attention or checkpointing."""
    label, memory = variant
    largest = memory["max_micro_batch"]
    return Row(f"  with {label}", memory["total_gb"], _gb,
               f"largest micro-batch {largest}" if largest is not None else "")


# the terms shown only where they hold something: (key, label, how)
MEMORY_EXTRAS = (("weight_copies", "autocast weight copies", "2-byte copies of the matmul weights"),
                 ("transient", "backward transients", "peak temporaries of the loss/attention backward"),
                 ("fsdp_buffers", "FSDP gather buffers", "unsharded params/grads in flight"),
                 ("buffers", "buffers", "RoPE tables"),
                 ("overhead", "overhead", "CUDA context etc. (--headroom covers it by default)"))

MEMORY = Section("Memory per GPU", (
    Line(_settings_line),
    Line(_defaults_line, when=lambda v: any("auto" in x for x in v.defaults.values())),
    Row("parameters", _memory("params"), _gb),
    Row("gradients", _memory("grads"), _gb),
    Row("optimizer (AdamW)", _memory("optimizer"), _gb, "exp_avg + exp_avg_sq, fp32"),
    Row("master weights", _memory("master"), _gb, "fp32 copy", when=_memory("master")),
    Row("DiLoCo outer state", _memory("outer"), _gb,
        lambda v: "anchor + outer momentum (fp32), and a sync's pseudo-gradient beyond the step's freed activations"
                  + (f", sharded over {v.settings['group_size']}" if v.settings["inner_strategy"] == "fsdp2" else ""),
        when=_memory("outer")),
    Row("activations", _memory("activations"), _gb,
        lambda v: f"saved for backward, micro-batch {v.batch['micro_batch']} × seq {v.seq_len}", when=_counted),
    Row("logits + loss", _memory("logits"), _gb, _logits_how, when=_counted),
    Row("activations", "NOT counted", how="--params gives no model shape: activations, logits and FSDP buffers "
        "are left out (give --model or --config to count them)", when=lambda v: not _counted(v)),
    *(Row(label, _memory(key), _gb, how, when=_shown(key)) for key, label, how in MEMORY_EXTRAS),
    Row("total", _plan("memory_gb"), _gb, _memory_verdict),
    Row("largest micro-batch", _plan("max_micro_batch"),
        how=lambda v: f"at seq {v.seq_len} under the headroom",
        when=lambda v: v.plan["max_micro_batch"] is not None),
    Each(lambda v: (v.plan["memory_variants"] or {}).items(), _variant_row),
))


# ---------------------------------------------------------------- Batch
BATCH = Section("Batch", (
    Row("micro-batch", lambda v: v.batch["micro_batch"], how=lambda v: v.batch["micro_batch_source"]),
    Row("accumulation", lambda v: v.batch["grad_accum"]),
    Row("global batch", lambda v: f"{v.batch['global_batch']} seq",
        how=lambda v: f"micro × accumulation × {v.plan['gpus']} GPU(s)"),
    Row("tokens per step", lambda v: v.batch["tokens_per_step"], lambda n: f"{n:,}",
        lambda v: f"target {v.batch['target_tokens_per_step']:,}"),
    Row("optimizer steps", lambda v: v.batch.get("steps"), lambda n: f"{n:,}",
        lambda v: "of the predicted tokens" if _tokens_predicted(v) else "", when=lambda v: "steps" in v.batch),
))


# ---------------------------------------------------------------- Scaling
def _scaling_title(v: PlanView) -> str:
    strategy = v.scaling["strategy"]
    return (f"Scaling ({'ddp' if strategy == 'single' else strategy} at n GPUs, same global batch; "
            f"{v.scaling['assumption']}" + ("; compute/step predicted from the traced step" if _predicted(v) else "")
            + ")" + (" -- NOT runnable: does not fit" if v.not_runnable else ""))


def _scaling_rows(v: PlanView) -> Iterator[tuple[str, ...]]:
    for r in v.scaling["table"]:
        step = r["compute_s"] if r.get("compute_s") is not None else r.get("step_s")
        last = (_pct(r["efficiency"]) if r.get("efficiency") is not None else
                "n/a" if r.get("comm_exceeds_mfu") is None else "NO" if r["comm_exceeds_mfu"] else "yes")
        yield (str(r["gpus"]), r["link"], _ms(r["comm_s"]), "n/a" if step is None else _ms(step),
               _pct(r["comm_share"]), last)


def _compute_apart(v: PlanView) -> bool:
    """Under an assumed MFU the step is at the MFU and holds its communication (the table's last
    column: whether the estimate fits what the MFU leaves off the peak). Under a predicted step, or
    DiLoCo's (its outer sync priced on top), the compute is apart and the last column is the
    scaling efficiency."""
    return v.scaling["at_gpus"].get("efficiency") is not None


_SCALING_HEAD = (Column("GPUs", ">5"), Column("link", "<9"), Column("comm/step", ">10"))


def _traffic(v: PlanView) -> str:
    """What the strategy sends per step, the formula of the table's comm/step."""
    strategy, at = v.scaling["strategy"], v.scaling["at_gpus"]
    if strategy == "diloco":
        return (f"diloco: {at['inner_strategy']} inside groups of up to {at['group_size']} GPUs every step, the "
                f"outer all-reduce across groups once every {at['inner_steps']} steps (see DiLoCo below)")
    if strategy == "fsdp2":
        return ("fsdp2: all-gather the parameters for forward and backward on every micro-batch, reduce-scatter "
                "fp32 gradients once per step: (n-1)/n × params × (2 × gather bytes × micro-batches + 4) "
                "÷ link GB/s")
    if strategy == "hsdp":
        return (f"hsdp: fsdp2 inside each shard group of up to {at['group_size']} GPUs, then the fp32 gradient "
                "shards all-reduced across the groups, every step (the two parts below); link: the one between "
                "the groups")
    return (f"all-reduce: 2(n-1)/n × {_n(at['grad_bytes'], 'B')} gradients ÷ link GB/s, once per optimizer step"
            + ("; zero1 adds (n-1)/n × the parameters, broadcast after each rank's update"
               if strategy == "zero1" else ""))


def _network_line(v: PlanView) -> str:
    n = v.scaling["network"]
    return f"above {n['gpus_per_node']} GPUs (a node) the rows cross nodes: {network_text(n)}"


def _hsdp(v: PlanView) -> bool:
    return v.scaling["strategy"] == "hsdp"


def _where(part: dict[str, Any]) -> str:
    return "between nodes" if part["between_nodes"] else "within a node"


def _in_group_how(v: PlanView) -> str:
    """HSDP's in-group part at the GPUs planned: fsdp2's collectives over a group's link."""
    at = v.scaling["at_gpus"]
    p = at["in_group"]
    micro = f"{p['micro_batches']} micro-batch{'es' if p['micro_batches'] > 1 else ''}"
    return (f"fsdp2's all-gathers and fp32 reduce-scatter in a group of S = {p['gpus']}: (S-1)/S × params × (2 × "
            f"{p['gather_bytes_per_param']} B × {micro} + 4 B) = {_n(p['bytes'], 'B')} ÷ {p['link_gb_per_s']:g} GB/s "
            f"({p['link']}, {_where(p)})")


def _across_how(v: PlanView) -> str:
    """HSDP's part across the groups at the GPUs planned: each GPU's gradient shard all-reduced."""
    at = v.scaling["at_gpus"]
    p = at["across_groups"]
    if p["groups"] < 2:
        return "one group: nothing to all-reduce across groups"
    return (f"all-reduce of each GPU's fp32 gradient shard, {p['reduce_bytes_per_param']} B × params ÷ S = "
            f"{_n(p['shard_bytes'], 'B')}, over G = {p['groups']} groups: 2(G-1)/G × shard = {_n(p['bytes'], 'B')}"
            f"{_nic(p['sharing_the_nic'])} ÷ {p['link_gb_per_s']:g} GB/s ({p['link']}, {_where(p)})")


SCALING = Section(_scaling_title, (
    Table((*_SCALING_HEAD, Column("compute/step", ">13"), Column("comm share", ">11"), Column("efficiency", ">11")),
          _scaling_rows, when=_compute_apart),
    Table((*_SCALING_HEAD, Column("step at MFU", ">13"), Column("comm share", ">11"), Column("fits MFU", ">11")),
          _scaling_rows, when=lambda v: not _compute_apart(v)),
    Line(_traffic),
    Row(lambda v: f"in-group, {v.plan['gpus']} GPUs", lambda v: v.scaling["at_gpus"]["in_group"]["s"], _ms,
        _in_group_how, when=_hsdp),
    Row(lambda v: f"across groups, {v.plan['gpus']} GPUs", lambda v: v.scaling["at_gpus"]["across_groups"]["s"], _ms,
        _across_how, when=_hsdp),
    Line(_network_line, when=lambda v: "network" in v.scaling),
))


# ---------------------------------------------------------------- DiLoCo
def _diloco_title(v: PlanView) -> str:
    d = v.diloco
    return (f"DiLoCo: {d['groups']} group{'s' if d['groups'] > 1 else ''} of {d['group_size']} GPUs "
            f"({d['inner_strategy']} inside a group), the pseudo-gradient all-reduced across groups every "
            f"H = {d['inner_steps']} inner steps; not overlapped with compute")


def _pseudo_gradient(v: PlanView) -> str:
    return _n(v.diloco["pseudo_gradient_bytes"], "B")


def _groups(v: PlanView) -> bool:
    return v.diloco["groups"] > 1


def _nic(sharing: int) -> str:
    """How the GPUs of a node put their shards through the network (``sharing_the_nic``)."""
    return f" × {sharing} GPUs of a node on the NIC they share" if sharing > 1 else ""


def _outer_allreduce_how(v: PlanView) -> str:
    """Each GPU all-reduces its 1/S slice of the pseudo-gradient with its peers in the other groups."""
    d = v.diloco
    c = d["outer_allreduce"]
    return (f"2(G-1)/G × {_n(c['slice_bytes'], 'B')} (a GPU's slice, the pseudo-gradient ÷ S)"
            f"{_nic(c['sharing_the_nic'])} ÷ {c['link_gb_per_s']:g} GB/s ({c['link']}), G = {d['groups']}; "
            "once per H steps")


def _outer_how(key: str, formula: str, n: str, n_key: str) -> Callable[[PlanView], str]:
    """The formula of one of the outer sync's collectives (``key``): ``formula`` × the
    pseudo-gradient over its link, with ``n`` (``n_key`` of the plan's DiLoCo) given."""
    def how(v: PlanView) -> str:
        c = v.diloco[key]
        return (f"{formula} × {_pseudo_gradient(v)} ÷ {c['link_gb_per_s']:g} GB/s ({c['link']}), "
                f"{n} = {v.diloco[n_key]}; once per H steps")
    return how


def _comm_rows(v: PlanView) -> Iterator[tuple[str, ...]]:
    """Communication per step: ddp's and fsdp2's at the same GPUs, then DiLoCo's."""
    d = v.diloco
    what = {"ddp": "gradient all-reduce", "fsdp2": "all-gathers and reduce-scatter"}
    for name, r in d["compare"].items():
        yield (f"  {name}, {r['gpus']} GPUs", _ms(r["comm_s"]), _pct(r["comm_share"]),
               f"{what[name]} over {r['link']}, every step")
    yield (f"  diloco, H = {d['inner_steps']}", _ms(d["comm_s"]), _pct(d["comm_share"]),
           f"{_ms(d['inner']['comm_s'])} in-group + {_ms(d['outer_s'])} outer ÷ {d['inner_steps']}")


def _target(v: PlanView) -> str:
    return f"under {100 * v.diloco['target_comm_share']:g}% of step time"


def _min_h_how(v: PlanView) -> str:
    """DiLoCo at the smallest H, and at H - 1 with enough digits to tell the two apart."""
    d = v.diloco
    at, below = d["at_min_inner_steps"], d["below_min_inner_steps"]
    digits = 2
    while below and digits < 6 and _pct(at["comm_share"], digits) == _pct(below["comm_share"], digits):
        digits += 1
    how = f"diloco at H = {d['min_inner_steps']}: {_ms(at['comm_s'])}, {_pct(at['comm_share'], digits)} of the step"
    if below:
        how += f" (H = {below['inner_steps']}: {_pct(below['comm_share'], digits)})"
    return how


# The loss DiLoCo costs against tuned data parallelism, from the literature: Charles et al. 2025,
# "Scaling Laws for DiLoCo", Table 4 -- H = 30, compute-optimal tokens, evaluation loss relative
# to the data-parallel baseline, by replicas M, at 35M and 90M parameters. The gap grows with M
# and shrinks with model size. flopwise has not measured it at these sizes.
DILOCO_LOSS_COST = {35e6: {1: -0.001, 2: 0.007, 4: 0.020, 8: 0.039}, 90e6: {2: 0.005, 4: 0.015}}
DILOCO_LOSS_SOURCE = "Charles et al. 2025, Scaling Laws for DiLoCo, Table 4 (H = 30, compute-optimal tokens)"


def _loss_costs(m: int) -> list[tuple[float, float, int]]:
    """(model size, loss cost, the M it was measured at) for ``m`` groups: the nearest M the
    table has at or above ``m`` (its largest when ``m`` is beyond it)."""
    out = []
    for size, row in DILOCO_LOSS_COST.items():
        at = min((k for k in row if k >= m), default=max(row))
        out.append((size, row[at], at))
    return out


def _loss_cost(v: PlanView) -> str:
    m = v.diloco["groups"]
    found = _loss_costs(m)
    costs = [c for _, c, _ in found]
    lo, hi = min(costs), max(costs)
    text = f"{100 * lo:+.1f}%" if lo == hi else f"{100 * lo:+.1f}% to {100 * hi:+.1f}%"
    return ("over " if any(at < m for *_, at in found) else "") + text  # the table stops below m groups


def _loss_cost_how(v: PlanView) -> str:
    m = v.diloco["groups"]
    cells = [f"{100 * c:+.1f}% at {size / 1e6:.0f}M parameters" + ("" if at == m else f" (M = {at})")
             for size, c, at in _loss_costs(m)]
    beyond = "; more groups than the table's cost more" if any(at < m for *_, at in _loss_costs(m)) else ""
    return (f"validation loss against tuned ddp at M = {m} groups: {', '.join(cells)} ({DILOCO_LOSS_SOURCE})"
            f"{beyond}; smaller for larger models; not measured by flopwise at these sizes")


DILOCO = Section(_diloco_title, (
    Row("pseudo-gradient", _pseudo_gradient,
        how=lambda v: f"{_count(v.diloco['pseudo_gradient_bytes'] / v.diloco['outer_bytes_per_param'])} parameters "
                      f"× {v.diloco['outer_bytes_per_param']} B ({v.diloco['outer_dtype']})"),
    Row("outer all-reduce", lambda v: v.diloco["outer_allreduce"]["s"], _ms,
        _outer_allreduce_how, when=_groups),
    Row("in-group all-gather", lambda v: v.diloco["outer_allgather"]["s"], _ms,
        _outer_how("outer_allgather", "(S-1)/S", "S", "group_size"), when=_groups),
    Row("outer all-reduce", 0.0, _ms, "one group: nothing to reduce across groups", when=lambda v: not _groups(v)),
    Row("in-group per step", lambda v: v.diloco["inner"]["comm_s"], _ms,
        lambda v: f"{v.diloco['inner_strategy']} over {v.diloco['group_size']} GPUs ({v.diloco['inner']['link']}), "
                  "every step"),
    Row("compute per step", lambda v: v.diloco["compute_s"], lambda s: "n/a" if s is None else _ms(s),
        lambda v: f"at {100 * v.plan['mfu']:.1f}% MFU"),
    Table((Column("communication per step", "<26"), Column("comm/step", ">10"), Column("share", ">7"),
           Column("", "", gap="  ")), _comm_rows),
    Row(_target, lambda v: f"H >= {v.diloco['min_inner_steps']}", how=_min_h_how,
        when=lambda v: v.diloco["min_inner_steps"] is not None),
    Row(_target, "no H", how=lambda v: v.diloco["none_reason"], when=lambda v: v.diloco["min_inner_steps"] is None),
    Row("loss cost (literature)", _loss_cost, how=_loss_cost_how),
), when=lambda v: v.diloco)

SECTIONS = (PARAMETERS, FLOPS, TIME_AND_COST, CHINCHILLA, DATA, MEMORY, BATCH, SCALING, DILOCO)


def _fit_banner(plan: dict[str, Any]) -> list[str]:
    """The lines under the title when the set-up as asked does not fit in memory."""
    fit = plan.get("fit")
    if not fit or fit["asked_fits"] is not False:
        return []
    mem_gb, headroom = plan["gpu"]["memory_gb"], 100 * plan["headroom"]
    states = ", states only: activations not counted" if fit["states_only"] else ""
    asked = fit["asked"]
    over = "already over" if states else "over"
    lines = [f"  ! {asked} does NOT fit: {_gb(fit['asked_memory_gb'])} per GPU ({over} {headroom:.0f}% of "
             f"{mem_gb:g} GiB{states})."]
    if fit["per_strategy"]:
        lines.append("  ! per GPU: " + " · ".join(
            f"{s} {_gb(v['memory_gb'])} ({'fits' if v['fits'] else 'does not fit'})"
            for s, v in fit["per_strategy"].items()))
    proposed = fit["proposed"]
    alt = fit.get("inner_alternative")
    if alt:  # diloco is planned only as asked: its fsdp2 inner strategy is the way out
        if alt["fits"]:
            lines.append(f"  ! diloco with --inner-strategy fsdp2 fits ({_gb(alt['memory_gb'])} per GPU): rerun with "
                         "it. The time, cost and scaling below are NOT runnable as set up.")
            return lines
        lines.append(f"  ! diloco with --inner-strategy fsdp2 does not fit either ({_gb(alt['memory_gb'])} per GPU).")
    if fit["switched"]:
        lines.append(f"  ! planned with {proposed} instead ({_gb(plan['memory_gb'])} per GPU{states}): the memory, "
                     f"time, cost and scaling below are for {proposed}; --strategy {asked} to see it as asked.")
    elif proposed:
        lines.append(f"  ! {proposed} fits ({_gb(fit['per_strategy'][proposed]['memory_gb'])} per GPU{states}): "
                     f"rerun with --strategy {proposed}. The time, cost and scaling below are NOT runnable as set up "
                     f"({asked}).")
    if fit.get("offered"):
        lines.append(_offered_line(fit["offered"]))
    if not proposed:
        lines.append("  ! no strategy fits as set up: the time, cost and scaling below are NOT runnable.")
        ways = fit.get("suggestions") or []
        for way in ways:
            lines.append(f"  ! fits with {way['flags']}: {_gb(way['memory_gb'])} per GPU")
        if not ways:
            lines.append("  ! nothing up to 1,024 GPUs fits: a shorter --seq-len (or a smaller model) is needed")
    return lines


def _offered_line(offered: dict[str, Any]) -> str:
    """hsdp, which fits too across nodes: its memory and communication beside the strategy proposed."""
    o = offered
    return (f"  ! hsdp fits too ({_gb(o['memory_gb'])} per GPU, sharded within groups of {o['group_size']} GPUs): "
            f"{_ms(o['comm_s'])} of communication a step ({_ms(o['across_groups_s'])} of it across groups over "
            f"{o['across_groups_link']}) against {o['beside']}'s {_ms(o['beside_comm_s'])}; --strategy hsdp")


def format_gpu_table() -> str:
    w = max(24, *(len(d.name) for d in hardware.DEVICES))  # "RTX PRO 6000 Blackwell Workstation"
    lines = [f"{'GPU':<{w}} {'bf16':>8} {'fp16':>8} {'fp8':>8} {'tf32':>8} {'fp32':>7} {'memory':>8} {'TB/s':>6}",
             "  (dense TFLOP/s: sparse datasheet figures halved)"]
    for d in hardware.DEVICES:
        def f(v):
            return "-" if v is None else f"{v:g}"
        lines.append(f"{d.name:<{w}} {f(d.bf16):>8} {f(d.fp16):>8} {f(d.fp8):>8} {f(d.tf32):>8} {f(d.fp32):>7}"
                     f" {d.memory_gb:>5g} GB {d.bandwidth_tbs:>6g}")
    lines.append("")
    lines.append("Names --gpu accepts (exact; case, spaces, dashes and 'GB' do not matter; a bare family name is "
                 "the SXM part):")
    for d in hardware.DEVICES:
        lines.append(f"  {d.name:<{w}} {', '.join(hardware.accepted_names(d)[1:]) or '-'}")
    lines.append("")
    lines.append("Links (--interconnect within a node, --network between nodes), GB/s per GPU one way:")
    for link in hardware.LINKS.values():
        also = f" (also {', '.join(link.aliases)})" if link.aliases else ""
        lines.append(f"  {link.name:<9} {link.gb_per_s:>6g}  {link.description}{also}")
    lines.append(f"  {'<N>gbit':<9} {'N/8':>6}  any other network rate: N Gbit/s, e.g. 10gbit")
    return "\n".join(lines)
