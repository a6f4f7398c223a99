"""``flopwise preflight --dry-run --rank``: the virtual preflight, before a GPU is rented.

A real preflight (``tune/preflight.py``) times the settings it tries on the GPU. This one traces
the same kind of candidates on fake tensors (``tune/dryrun.py``) and ranks those that fit by the
step time predicted from their traced kernels (``plan/steptime.py``): nothing runs on a GPU, and
every figure but the traced peak memory is **predicted**.

The candidates, a bounded number of traces:

1. the configured settings, with the dry run's search for the largest micro-batch that fits;
2. the micro-batch sweep at those settings: powers of two up to that largest, and the largest,
   at the configured global batch (the accumulation adjusts; a size the batch does not split
   into is skipped), each traced in one tracing process (the worker's batch mode);
3. each other setting, one change at a time, at the sweep's best micro-batch: activation
   checkpointing none / selective / full (also at the smallest size that did not fit: what
   checkpointing is for), the loss path plain / chunked, compile model / blocks (off too when the
   config is off), at N ranks the strategy ddp / zero1 / fsdp2 (and hsdp across nodes), and fp8 where the GPU has it
   (marked as changing numerics: shown, never chosen unless the config asks for fp8);
4. a setting that does not fit at that size, once more at the next smaller size.

A candidate fits when its traced peak (the step as the run takes it, compiled when compile is
on) is within headroom x the GPU's memory; one that does not is listed, never ranked.
"""

from __future__ import annotations

import copy
import importlib.util
import shlex
import time
from typing import Any, Callable

from flopwise.config import RunConfig, batch_split_problems, step_identity
from flopwise.measure.sinks import human
from flopwise.plan import accuracy, hardware, steptime
from flopwise.plan.budget import PlanError, PlanInputs, predicted_range, tokens_time_cost
from flopwise.plan.flops import flops_per_token, param_counts
from flopwise.plan.memory import numerics_change
from flopwise.plan.render import gpu_hours_range, gpu_hours_text, hours_range, hours_text, network_text
from flopwise.tune.dryrun import WRAPPERS, dry_run, dry_run_batch, gpu_spec, network_problem

Log = Callable[[str], None]
MB, AC, COMPILE, LOSS, STRATEGY = ("train.micro_batch_size", "train.activation_checkpointing", "train.compile",
                                   "train.loss", "parallel.strategy")
FP8 = "train.fp8"
SETTINGS = (MB, AC, COMPILE, LOSS, STRATEGY, FP8)
CHECKPOINTING = ("none", "selective", "full")
LOSSES = ("plain", "chunked")  # fused (Liger's Triton kernel) cannot be traced on fake tensors
COMPILES = ("model", "blocks")
STRATEGIES = ("ddp", "zero1", "fsdp2")
# Predictions closer than this are reported as a tie: compile model and blocks trace to the same
# kernels (the time model fuses elementwise regions under either), and differences this small are
# below what the model resolves (its error on public measurements is ~10%, shared by candidates).
TIE = 0.01
SECONDS_PER_TRACE = (10.0, 50.0)  # rough, on 2 shared cores: s + s per billion parameters (tiny ~9 s, 1B ~60 s)


def settings_of(result: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """The settings a traced step ran with (``auto`` resolved by the trace), as override keys."""
    return {MB: result["micro_batch"], AC: cfg.train.activation_checkpointing, COMPILE: result["compile"],
            LOSS: result["loss"], STRATEGY: result["strategy"], FP8: bool(result.get("fp8"))}


def with_settings(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """``cfg`` with ``settings`` (override keys) set; its global batch kept."""
    out = copy.deepcopy(cfg)
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        setattr(getattr(out, section), key, value)
    return out


def label(s: dict[str, Any]) -> str:
    return (f"micro-batch {s[MB]} · ckpt {s[AC]} · compile {s[COMPILE]} · loss {s[LOSS]}"
            + (f" · {s[STRATEGY]}" if s[STRATEGY] != "single" else "") + (" · fp8" if s.get(FP8) else ""))


def fp8_available(spec: hardware.DeviceSpec) -> bool:
    """Whether an fp8 row is worth tracing on ``spec``: fp8 tensor cores (sm89+, an fp8 peak) and
    torchao here to trace torchao's float8 linears with."""
    return (hardware.CAPABILITY.get(spec.name, (0, 0)) >= (8, 9) and spec.fp8 is not None
            and importlib.util.find_spec("torchao") is not None)


def splits(cfg: RunConfig, world: int, b: int) -> bool:
    """Whether the configured global batch splits into micro-batches of ``b`` on ``world`` ranks."""
    t = copy.copy(cfg.train)
    t.micro_batch_size = b
    return not batch_split_problems(t, world)


def sweep_sizes(cfg: RunConfig, world: int, largest: int | None) -> list[int]:
    """Micro-batches a preflight tries: powers of two up to ``largest`` (the largest that fits
    by trace) and ``largest``, those the global batch splits into on ``world`` ranks."""
    return [b for b in sizes_of(cfg, world, largest) if largest and b <= largest]


def sizes_of(cfg: RunConfig, world: int, largest: int | None = None) -> list[int]:
    """Every micro-batch a preflight may try: the powers of two and ``largest`` that the global
    batch splits into on ``world`` ranks (none above the batch a rank takes)."""
    per_rank = cfg.train.global_batch_size // world
    sizes, b = {largest} if largest and largest <= per_rank else set(), 1
    while b <= per_rank:
        sizes.add(b)
        b *= 2
    return sorted(b for b in sizes if splits(cfg, world, b))


def variations(base: dict[str, Any], world: int, configured_compile: str, fp8: bool = False,
               nodes: int = 1) -> list[dict[str, Any]]:
    """The other settings, one change each from ``base``: checkpointing, loss, compile (off only
    when configured off), at N ranks under a data-parallel strategy the strategy (hsdp too across
    ``nodes`` > 1: sharded within a node, replicated across), and fp8 on or off where the GPU has
    it (``fp8``)."""
    out: list[dict[str, Any]] = [{AC: a} for a in CHECKPOINTING if a != base[AC]]
    if fp8 or base.get(FP8):
        out.append({FP8: not base.get(FP8)})
    out += [{LOSS: x} for x in LOSSES if x != base[LOSS]]
    compiles = COMPILES + (("off",) if configured_compile == "off" else ())
    out += [{COMPILE: c} for c in compiles if c != base[COMPILE]]
    strategies = STRATEGIES + (("hsdp",) if nodes > 1 else ())
    if world > 1 and base[STRATEGY] in strategies:  # DiLoCo is another algorithm, not a setting to rank
        out += [{STRATEGY: s} for s in strategies if s != base[STRATEGY]]
    return out


def candidate(settings: dict[str, Any], result: dict[str, Any], cap_gib: float) -> dict[str, Any]:
    """One ranked row from a trace: its settings, whether it fits (its traced peak within
    ``cap_gib``), the peak and the prediction; or the error of a step that fails."""
    if "error" in result:
        return {"settings": settings, "fits": False, "peak_gib": None, "cap_gib": cap_gib, "prediction": None,
                "error": f"{result['error']}" + (f" at {result['where']}" if result.get("where") else "")}
    peak = result["trace"]["memory"]["peak_gib"]
    return {"settings": settings, "fits": peak <= cap_gib, "peak_gib": round(peak, 3), "cap_gib": cap_gib,
            "prediction": result.get("prediction")}


def _rate(c: dict[str, Any]) -> float:
    return float(c["prediction"]["tokens_per_s_per_gpu"])


def ranked(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates that fit and have a prediction, fastest predicted first."""
    ok = [c for c in candidates if c["fits"] and (c.get("prediction") or {}).get("predicted")]
    return sorted(ok, key=_rate, reverse=True)


def mark_numerics(candidates: list[dict[str, Any]], configured: str, precision: str, fp8: bool = False) -> None:
    """Each candidate's ``numerics``: why it trains other numbers than the configured run --
    a strategy whose residual stream differs from the ``configured`` one's at ``precision``
    (``plan.memory.numerics_change``), fp8 matmuls where the run's are bf16 or the other way
    (``fp8``: the configured train.fp8) -- or "" when it does not. Such a row is ranked and shown,
    never chosen by itself: the configuration set to it makes it the configured numerics."""
    for c in candidates:
        s = c["settings"]
        why = [numerics_change(s[STRATEGY], configured, precision)]
        if bool(s.get(FP8)) != fp8:
            why.append("changes numerics: fp8 matmuls where the configured run's are bf16" if s.get(FP8)
                       else "changes numerics: bf16 matmuls where the configured run's are fp8")
        c["numerics"] = "; ".join(w for w in why if w)


def choose(candidates: list[dict[str, Any]], tie: float = TIE,
           configured: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The candidate to run with: the fastest predicted among those that fit; among those within
    ``tie`` of it, compile blocks before model under a data-parallel wrapper (model breaks the
    graph there), no activation checkpointing first, then the larger micro-batch, then the fewest
    changes from the ``configured`` settings. With its
    margin over the runner-up (the fastest other that fits): ``rate / runner's - 1``. None when
    nothing fits."""
    order = [c for c in ranked(candidates) if not c.get("numerics")]  # another numerics is never chosen by itself
    if not order:
        return None
    fastest = order[0]
    group = [c for c in order if _rate(c) >= (1 - tie) * _rate(fastest)]

    def preference(c: dict[str, Any]) -> tuple:
        s = c["settings"]
        changes = sum(s[k] != v for k, v in (configured or {}).items())
        return (s[STRATEGY] in WRAPPERS and s[COMPILE] == "model", s[AC] != "none", -s[MB], changes, -_rate(c))

    best = min(group, key=preference)
    others = [c for c in order if c is not best]
    runner = others[0] if others else None
    margin = _rate(best) / _rate(runner) - 1 if runner else None
    tied = [c["settings"] for c in group if c is not best]
    if runner is None:
        why = "the only candidate that fits"
    elif tied:
        why = (f"tied within {100 * tie:.0f}% with {len(tied)} other(s) (predicted); a tie goes to compile blocks "
               "under a data-parallel wrapper, then no activation checkpointing, then the larger micro-batch, then the "
               "configured settings")
    else:
        why = "the fastest predicted"
    return {"settings": best["settings"], "prediction": best["prediction"], "peak_gib": best["peak_gib"],
            "runner_up": runner["settings"] if runner else None, "margin": margin, "tied": tied, "why": why}


def budget(choice: dict[str, Any], cfg: RunConfig, world: int, tokens: int = 0, hours: float = 0.0,
           price_per_gpu_hour: float = 0.0) -> dict[str, Any]:
    """The predicted wall time, GPU-hours and cost of the token budget (``tokens``, else what
    ``hours`` affords, else the config's) at the choice's predicted tokens/s, as flopwise plan
    prices them (plan/budget.py): the prediction's exposed communication is already in its step.
    With the prediction's error band, ``band``: the range of each predicted figure
    (:func:`~flopwise.plan.budget.predicted_range`, as ``plan --trace``'s)."""
    p = choice["prediction"]
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    config_hours = cfg.train.max_hours if cfg.time_only and not (tokens or hours) else 0.0  # time its only limit
    hours = hours or config_hours
    inp = PlanInputs(gpus=world, tokens=tokens or (0 if hours else cfg.total_steps() * cfg.tokens_per_step),
                     hours=hours, price_per_gpu_hour=price_per_gpu_hour)
    out = tokens_time_cost(inp, fpt, param_counts(cfg.model)["active"], p["tokens_per_s"] * fpt)
    keep = ("tokens", "hours", "hours_given", "gpu_hours", "price_per_gpu_hour", "cost")
    band = {"band": predicted_range(p["band"], out)} if p.get("band") else {}
    source = "--tokens" if tokens else "train.max_hours" if config_hours else "--hours" if hours else "the config"
    return {k: out[k] for k in keep} | {"source": source} | band


# --------------------------------------------------------------------------- the traces

class _Tracer:
    """The dry runs of one virtual preflight (the GPU, the ranks, the headroom), counting traces
    and printing a line as each finishes."""

    def __init__(self, cfg: RunConfig, gpu: str | None, nproc_per_node: int, nnodes: int, memory_gb: float,
                 headroom: float, log: Log, network: str | None = None):
        self.cfg, self.log, self.done = cfg, log, 0
        self.args: dict[str, Any] = dict(gpu=gpu, nproc_per_node=nproc_per_node, nnodes=nnodes,
                                         memory_gb=memory_gb, headroom=headroom, network=network)
        spec = gpu_spec(gpu)
        bad = network_problem(network)
        if bad:  # before the first trace, as a bad --gpu
            raise PlanError(bad)
        try:  # the ranking is by predicted step time: a GPU with no prediction has nothing to rank by
            steptime.gpu(spec.name, None, network, per_node=nproc_per_node)
        except steptime.Unpredictable as e:
            raise PlanError(f"--rank ranks the candidates by their predicted step time, and {e}; "
                            f"`flopwise preflight --dry-run --gpu {gpu}` (without --rank) still traces the step "
                            "and its memory") from None
        # the network every candidate's prediction crosses between nodes (one node: none)
        self.network = hardware.network_facts(network) if nnodes > 1 else None
        self.spec, self.world = spec, nproc_per_node * nnodes
        self.cap_gib = headroom * (memory_gb or spec.memory_gb)

    def first(self) -> dict[str, Any]:
        """The configured settings, with the largest-fit search."""
        return dry_run(self.cfg, log=self.log, **self.args)

    def batch(self, settings: list[dict[str, Any]], total: int) -> list[dict[str, Any]]:
        """Candidates for each of ``settings``, traced in one process, a line printed per trace."""
        out: list[dict[str, Any]] = []

        def finished(i: int, result: dict[str, Any]) -> None:
            c = candidate(settings[i], result, self.cap_gib)
            out.append(c)
            self.done += 1
            self.log(f"  trace {self.done}/~{total} done: {label(settings[i])}: {_brief(c)}")

        cfgs = [with_settings(self.cfg, s) for s in settings]
        dry_run_batch(cfgs, done=finished, **self.args)
        return out


def _brief(c: dict[str, Any]) -> str:
    if c.get("error"):
        return f"the step fails: {c['error'][:160]}"
    if not c["fits"]:
        return f"does not fit (traced peak {c['peak_gib']:.2f} GiB > {c['cap_gib']:.1f} GiB)"
    p = c["prediction"] or {}
    if not p.get("predicted"):
        return f"fits (traced peak {c['peak_gib']:.2f} GiB), no prediction: {p.get('why', '')}"
    return (f"fits (traced peak {c['peak_gib']:.2f} GiB) · {human(p['tokens_per_s_per_gpu'])} tokens/s per GPU "
            "predicted")


def virtual_preflight(cfg: RunConfig, tracer_args: dict[str, Any], tokens: int = 0, hours: float = 0.0,
                      price_per_gpu_hour: float = 0.0, log: Log = print) -> dict[str, Any]:
    """The virtual preflight of ``cfg`` (the module docstring): ``tracer_args`` are
    :func:`~flopwise.tune.dryrun.dry_run`'s ``gpu``, ``nproc_per_node``, ``nnodes``, ``memory_gb``,
    ``headroom`` and ``network`` (optional). Returns ``{"candidates", "choice", "budget", ...}``, and
    over several nodes ``network`` (:func:`hardware.network_facts`); raises as dry_run does."""
    tr = _Tracer(cfg, log=log, **tracer_args)
    started = time.monotonic()
    params = param_counts(cfg.model)["total"]
    per = SECONDS_PER_TRACE[0] + SECONDS_PER_TRACE[1] * params / 1e9
    upper = len(sizes_of(cfg, tr.world)) + 2 * (len(CHECKPOINTING) + len(LOSSES) + len(COMPILES) + len(STRATEGIES) + 1)
    over = f" ({network_text(tr.network)})" if tr.network else ""
    log(f"virtual preflight on {tr.world} × {tr.spec.name}{over}: up to ~{upper} traces on fake tensors (about "
        f"{per:.0f} s each for {human(params)} parameters on this machine, roughly): first the configured settings "
        "with the largest micro-batch that fits")
    first = tr.first()
    base = settings_of(first, cfg)
    fit = first["fit"]
    rows = [candidate(base, first, tr.cap_gib)]
    tr.done = 1
    log(f"  trace 1 done (with the fit search, {len(fit['tried_gib'])} sizes, {time.monotonic() - started:.0f} s): "
        f"{label(base)}: {_brief(rows[0])}; largest micro-batch that fits by trace: {fit['micro_batch']}")
    sizes = [b for b in sweep_sizes(cfg, tr.world, fit["micro_batch"]) if b != base[MB]]
    others = variations(base, tr.world, cfg.train.compile, fp8_available(tr.spec), int(tr.args["nnodes"]))
    above = fit["micro_batch"] is not None and any(b > fit["micro_batch"] for b in sizes_of(cfg, tr.world))
    total = 1 + len(sizes) + len(others) + (sum(1 for v in others if AC in v) if above else 0)
    log(f"  then ~{total - 1} more traces (the micro-batch sweep {sizes or 'none'}, then {len(others)} other "
        f"settings at the best of it), about {per * (total - 1) / 60:.1f} min")
    rows += tr.batch([base | {MB: b} for b in sizes], total)
    rows += _settings_rounds(tr, cfg, base, others, rows, fit["micro_batch"], total)
    mark_numerics(rows, base[STRATEGY], first["precision"], base[FP8])
    choice = choose(rows, configured={k: v for k, v in base.items() if k != MB})
    return {"gpu": tr.spec.name, "world": tr.world, "nproc_per_node": tr.args["nproc_per_node"],
            "nnodes": tr.args["nnodes"], "cap_gib": tr.cap_gib, "traces": tr.done,
            "seconds": round(time.monotonic() - started, 1), "of": step_identity(cfg), "configured": base,
            "largest_fit": fit["micro_batch"],
            "candidates": rows, "choice": choice,
            "budget": budget(choice, cfg, tr.world, tokens, hours, price_per_gpu_hour) if choice else None,
            **({"network": tr.network} if tr.network else {})}


def _settings_rounds(tr: _Tracer, cfg: RunConfig, base: dict[str, Any], others: list[dict[str, Any]],
                     sweep: list[dict[str, Any]], largest: int | None, total: int) -> list[dict[str, Any]]:
    """Each other setting at the sweep's best micro-batch (checkpointing also at the smallest
    size that did not fit), then once more at the next smaller size where it did not fit."""
    best = choose(sweep)
    sizes = sizes_of(cfg, tr.world, largest)
    at = best["settings"][MB] if best else sizes[0]
    above = [b for b in sizes if largest is not None and b > largest][:1]
    asked = [base | v | {MB: at} for v in others] + [base | v | {MB: b} for v in others if AC in v for b in above]
    rows = tr.batch(asked, total) if asked else []
    retry = []
    for c in rows[:len(others)]:
        smaller = [b for b in sizes if b < c["settings"][MB]]
        if not c["fits"] and not c.get("error") and smaller:
            retry.append(c["settings"] | {MB: smaller[-1]})
    return rows + (tr.batch(retry, total + len(retry)) if retry else [])


# --------------------------------------------------------------------------- the report

def render(v: dict[str, Any], run_with: list[str]) -> list[str]:
    """The virtual preflight's table and choice; every line with a predicted figure says so."""
    lines = [f"flopwise preflight --dry-run --rank · {v['world']} × {v['gpu']} · {v['traces']} traces on fake "
             f"tensors in {v['seconds']:.0f} s: nothing ran on a GPU",
             *([f"  every prediction below is over the {network_text(v['network'])}"] if v.get("network") else []),
             "  candidates, fastest predicted first (step time, tokens/s per GPU, MFU: predicted from the traced "
             "kernels; peak: traced)",
             f"  {'micro':>5} {'ckpt':>9} {'compile':>7} {'loss':>7} {'strategy':>8} {'fp8':>4} {'traced peak':>12} "
             f"{'step ms':>8} {'tok/s/GPU':>10} {'MFU':>6} {'share':>6}"]
    order = ranked(v["candidates"])
    top = _rate(order[0]) if order else None
    chosen = (v.get("choice") or {}).get("settings")
    for c in order + [c for c in v["candidates"] if c not in order]:
        s, p = c["settings"], c.get("prediction") or {}
        peak = f"{c['peak_gib']:.2f} GiB" if c["peak_gib"] is not None else "-"
        fp8 = "yes" if s.get(FP8) else "-"
        cols = f"  {s[MB]:>5} {s[AC]:>9} {s[COMPILE]:>7} {s[LOSS]:>7} {s[STRATEGY]:>8} {fp8:>4} {peak:>12}"
        if c in order and top:
            mfu = f"{100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "n/a"
            numerics = f"  {c['numerics']}: not chosen by itself" if c.get("numerics") else ""
            lines.append(f"{cols} {1e3 * p['step_s']:>8.2f} {human(p['tokens_per_s_per_gpu']):>10} {mfu:>6} "
                         f"{100 * _rate(c) / top:>5.1f}%  predicted{'  <- chosen' if s == chosen else ''}{numerics}")
        elif c.get("error"):
            lines.append(f"{cols}  the step fails: {c['error'][:120]}")
        elif not c["fits"]:
            lines.append(f"{cols}  does not fit (> {c['cap_gib']:.1f} GiB): not ranked")
        else:
            lines.append(f"{cols}  no prediction: {p.get('why', 'not predicted')}")
    lines += _choice_lines(v, run_with)
    return lines


def _choice_lines(v: dict[str, Any], run_with: list[str]) -> list[str]:
    c, b = v.get("choice"), v.get("budget")
    other = [x for x in ranked(v["candidates"]) if x.get("numerics")]
    faster = [x for x in other if not c or _rate(x) > _rate(c)]
    accept = ([f"  {'not chosen' if c else 'nothing else fits'}: {label(faster[0]['settings'])}, "
               + (f"{100 * (_rate(faster[0]) / _rate(c) - 1):+.1f}% predicted over the choice, " if c else "")
               + f"{faster[0]['numerics']}; set parallel.strategy={faster[0]['settings'][STRATEGY]} to train with "
               "those numerics and rank it as the configured one"] if faster else [])
    if not c or not b:
        return ["  no candidate fits and is predicted with the configured numerics: nothing to choose"
                if other else "  no candidate fits and is predicted: nothing to choose", *accept]
    p = c["prediction"]
    margin = (f"{100 * c['margin']:+.1f}% predicted over the runner-up ({label(c['runner_up'])})"
              if c["margin"] is not None else "no runner-up")
    lines = [f"  predicted choice: {label(c['settings'])}: {human(p['tokens_per_s_per_gpu'])} tokens/s per GPU "
             f"predicted, {margin}; {c['why']}"]
    if c["tied"]:
        lines.append(f"             tied (predicted): {'; '.join(label(s) for s in c['tied'])}")
    lines += accept
    lines += _budget_lines(b, v)
    overrides = [f"{k}={str(val).lower() if isinstance(val, bool) else val}" for k, val in c["settings"].items()
                 if (k != STRATEGY or val != "single") and (k != FP8 or val or (v.get("configured") or {}).get(FP8))]
    given = [a for a in run_with if a.split("=", 1)[0] not in SETTINGS]  # the choice's settings replace the user's
    launch = launch_command(v.get("nproc_per_node") or v.get("world", 1), v.get("nnodes") or 1)
    words = [a if a.startswith("--") else shlex.quote(a) for a in given + overrides]  # "--preset X": as given
    lines.append(f"  run it with: {launch} {' '.join(words)}")
    if (v.get("nnodes") or 1) > 1:
        lines.append(f"               on each of the {v['nnodes']} nodes at once; HEAD: the first node's address, "
                     "JOB: any id the nodes share (docs/distributed.md)")
    lines.append("  note: compile model and blocks trace to the same kernels unless the trace differs (the time model "
                 "fuses elementwise regions under either): a tie between them is a tie")
    return lines


def _budget_lines(b: dict[str, Any], v: dict[str, Any]) -> list[str]:
    """The budget's line -- the predicted time, GPU-hours and cost of the tokens, or under
    ``--hours`` the predicted tokens it affords -- each with its likely range, and the range's source."""
    r = b.get("band") or {}

    def likely(key: str, text: Callable[[float, float], str]) -> str:
        return f" (likely {text(*r[key])})" if r.get(key) else ""

    gpus = f"{v['world']} × {v['gpu']}"
    if b.get("hours_given"):
        head = (f"  predicted tokens in {hours_text(b['hours'])} ({b.get('source', '--hours')}) on {gpus}: "
                f"{human(b['tokens'])}"
                f"{likely('tokens', lambda lo, hi: f'{human(lo)}-{human(hi)}')} · "
                f"{gpu_hours_text(b['gpu_hours'])} GPU-hours")
        # the GPU-hours and cost are the user's hours': only the tokens are predicted
        cost = f" · cost ${b['cost']:,.2f} at ${b['price_per_gpu_hour']:g}/GPU-hour" if b.get("cost") else ""
        cost += " (the tokens predicted)"
    else:
        head = (f"  predicted time for {human(b['tokens'])} tokens ({b['source']}): {hours_text(b['hours'])}"
                f"{likely('hours', hours_range)} on {gpus} · {gpu_hours_text(b['gpu_hours'])} GPU-hours"
                f"{likely('gpu_hours', gpu_hours_range)}")
        cost = (f" · cost ${b['cost']:,.2f}{likely('cost', lambda lo, hi: f'${lo:,.2f}-${hi:,.2f}')} at "
                f"${b['price_per_gpu_hour']:g}/GPU-hour" if b.get("cost") else "") + " (predicted)"
    return [f"{head}{cost}",
            *([f"             likely ranges: {accuracy.band_text(r)}"] if r else [])]


def launch_command(nproc_per_node: int, nnodes: int = 1) -> str:
    """The command that starts ``flopwise train`` on the ranks a choice was made for: plain on one
    process; torchrun with ``--nproc-per-node`` on one node; and on several, torchrun with the
    node count and a c10d rendezvous, whose ``HEAD`` (the first node's address) and job id the
    user fills in. Pasted as ``flopwise train`` alone, an N-rank choice would train one rank
    with N times the accumulation."""
    if nproc_per_node * nnodes <= 1:
        return "flopwise train"
    if nnodes <= 1:
        return f"torchrun --nproc-per-node {nproc_per_node} -m flopwise train"
    return (f"torchrun --nnodes {nnodes} --nproc-per-node {nproc_per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint HEAD:29500 --rdzv-id JOB -m flopwise train")
