"""The optimization ladder: the rungs people climb by hand to make a run fast, climbed for them.

``flopwise preflight --ladder`` starts from the user's configuration and tries one change
at a time, in the order people climb: precision, attention kernel, compile, compile mode,
loss path, micro-batch, activation checkpointing (only where it lets a micro-batch fit that
does not fit without), and on a CPU the thread count. Each option is measured on its own (``preflight.measure``: a fresh
model, optimizer and compiler; on CUDA a reset allocator and peak), and is **kept** only when

- it is faster than the best so far by more than the noise (the two measurements' spreads
  added, never less than ``MIN_NOISE``);
- its first step's loss -- the same initial weights on the same first global batch -- is
  within ``SAME_NUMERICS`` of the kept configuration's (``CHANGED_NUMERICS`` for a rung that
  changes numerics on purpose, such as bf16; fp8 is kept only when asked for);
- it fits the memory (measured peak under ``headroom`` of the device).

The climb is greedy: a kept option becomes the configuration the next options must beat.
It stops trying options once ``budget_s`` is spent (those rows say so). The ladder is a
preflight option rather than its own command because it ends where preflight ends: the
tuned ``preflight.yaml`` that ``flopwise train --config`` runs, and the prediction the run's
report compares with.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable

import torch

from flopwise.config import RunConfig, validate
from flopwise.measure.meter import MIN_NOISE, spread
from flopwise.model.attention import available_backends
from flopwise.train.losses import fused_linear_cross_entropy_available
from flopwise.train.precision import resolve as resolve_precision

SAME_NUMERICS = 1e-3  # relative first-step loss difference for a change that should not change it
CHANGED_NUMERICS = 2e-2  # ... for one that changes numerics on purpose (float32 -> bf16)

Settings = dict[str, Any]  # "section.key" -> value


def with_settings(cfg: RunConfig, settings: Settings) -> RunConfig:
    out = copy.deepcopy(cfg)
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        setattr(getattr(out, section), key, value)
    return out


def rungs(cfg: RunConfig, device: torch.device, sizes: list[int],
          fp8: bool = False) -> list[tuple[str, list[Settings], str]]:
    """``(rung, options, numerics)`` in climbing order, each where this device has it.
    ``numerics``: "same", "changed" (kept within CHANGED_NUMERICS) or "fp8" (kept only if asked)."""
    t, cuda = cfg.train, device.type == "cuda"
    out: list[tuple[str, list[Settings], str]] = []
    if cuda:
        precisions = [p for p in ("bf16", "bf16-pure") if p != resolve_precision(t.precision, device).name]
        out.append(("precision", [{"train.precision": p} for p in precisions], "changed"))
        if fp8:
            out.append(("fp8", [{"train.fp8": True}], "fp8"))
        usable = available_backends(device, torch.bfloat16)
        out.append(("attention", [{"model.attention": b} for b in ("flash", "flex", "sdpa")
                                  if usable.get(b) is None and b != cfg.model.attention], "same"))
    out.append(("compile", [{"train.compile": c} for c in ("blocks", "model") if c != t.compile], "same"))
    if cuda:
        out.append(("compile mode", [{"train.compile_mode": m} for m in ("max-autotune", "reduce-overhead")], "same"))
    losses = ["plain", "chunked"] + (["fused"] if fused_linear_cross_entropy_available(device) else [])
    out.append(("loss", [{"train.loss": x} for x in losses if x != t.loss], "same"))
    out.append(("micro-batch", [{"train.micro_batch_size": b} for b in sizes if b != t.micro_batch_size], "same"))
    if not cuda:  # how many cores torch computes with: all of them is not always fastest
        cores = os.cpu_count() or 1
        current = t.threads or torch.get_num_threads()
        counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, cores) if n <= cores} - {current})
        out.append(("threads", [{"train.threads": n} for n in counts], "same"))
    return out


def climb(cfg: RunConfig, measure_one: Callable[[RunConfig], dict[str, Any]], device: torch.device,
          sizes: list[int], run_tokens: int, fpt: float, peak: float | None, memory_gb: float = 0.0,
          headroom: float = 0.9, price_per_gpu_hour: float = 0.0, budget_s: float = 900.0, fp8: bool = False,
          clock: Callable[[], float] = time.perf_counter, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Climb from ``cfg``; ``measure_one(cfg)`` times a configuration (``preflight.measure``'s
    dict, with ``first_loss``) or raises (an out-of-memory is a result). Returns the ladder
    as ``preflight.json`` records it (``report`` draws it) with the chosen settings."""
    t0 = clock()
    measure_one(cfg)  # untimed: the first measurement in a process pays its warm-up (threads, allocator, caches)
    start = measure_one(cfg)
    best = _summary(start, fpt, peak, run_tokens, price_per_gpu_hour)
    ladder: dict[str, Any] = {"device": str(device), "budget_minutes": budget_s / 60, "rungs": [],
                              "start": {**best, "settings": _settings_of(cfg)}}
    state = {"cfg": cfg, "best": best, "chosen": {}}
    log(f"ladder: start {best['tok_per_s']:,.0f} tok/s · first-step loss {best['loss']}")

    def attempt(name: str, settings: Settings, numerics: str) -> dict[str, Any]:
        row = climb_one(name, settings, numerics, state["cfg"], state["best"], ladder, measure_one, fpt, peak,
                        run_tokens, price_per_gpu_hour, memory_gb, headroom, fp8, budget_s - (clock() - t0))
        ladder["rungs"].append(row)
        log(f"ladder: {name:<13} {row['change']:<36} {_rate(row)} {'kept' if row['kept'] else '-':>4} · {row['why']}")
        if row["kept"]:
            state["cfg"] = with_settings(state["cfg"], settings)
            state["chosen"] = {**state["chosen"], **settings}
            state["best"] = {k: row[k] for k in _summary_keys()}
        return row

    too_big: list[int] = []  # micro-batches that did not fit without checkpointing
    for name, options, numerics in rungs(cfg, device, sizes, fp8):
        for settings in options:
            if name == "compile mode" and state["cfg"].train.compile == "off":
                continue  # a mode of a compiler that is not on
            row = attempt(name, settings, numerics)
            if name == "micro-batch" and row["status"] in ("oom", "no-fit"):
                too_big.append(settings["train.micro_batch_size"])
    bigger = [b for b in too_big if b > state["cfg"].train.micro_batch_size]
    for b in bigger:  # checkpointing only where it lets a larger micro-batch fit
        for mode in ("selective", "full"):
            attempt("checkpointing", {"train.micro_batch_size": b, "train.activation_checkpointing": mode}, "same")
    if not bigger:
        ladder["rungs"].append({"rung": "checkpointing", "change": "-", "numerics": "same", "status": "skipped",
                                "kept": False, "why": "every micro-batch tried fits without it", **_empty()})
    ladder.update(chosen=state["chosen"], final=state["best"], spent_minutes=(clock() - t0) / 60)
    return ladder


def climb_one(name: str, settings: Settings, numerics: str, current: RunConfig, best: dict[str, Any],
              ladder: dict[str, Any], measure_one, fpt: float, peak: float | None, run_tokens: int,
              price: float, memory_gb: float, headroom: float, fp8: bool, budget_left_s: float) -> dict[str, Any]:
    """One option measured against the best so far: its row, ``kept`` or not and why."""
    row = {"rung": name, "change": _changes(settings), "numerics": numerics, "kept": False, **_empty()}
    if budget_left_s <= 0:
        return {**row, "status": "skipped", "why": "the time budget is spent"}
    cand = with_settings(current, settings)
    problems = validate(cand)
    if problems:
        return {**row, "status": "skipped", "why": "not a valid configuration: " + "; ".join(problems)}
    try:
        m = measure_one(cand)
    except Exception as e:  # noqa: BLE001 - an out-of-memory or an unsupported combination is a result
        oom = "out of memory" in str(e).lower()
        return {**row, "status": "oom" if oom else "error", "why": str(e).splitlines()[0][:200]}
    row.update(_summary(m, fpt, peak, run_tokens, price), status="ok")
    row["delta_prev"] = row["tok_per_s"] / best["tok_per_s"] - 1
    row["delta_start"] = row["tok_per_s"] / ladder["start"]["tok_per_s"] - 1
    noise = max(MIN_NOISE, (best.get("spread") or 0.0) + (row["spread"] or 0.0))
    tol = SAME_NUMERICS if numerics == "same" else CHANGED_NUMERICS
    if row["loss"] is None or best["loss"] is None:
        return {**row, "why": "no first-step loss measured: numerics cannot be checked"}
    drift = abs(row["loss"] - best["loss"]) / max(abs(best["loss"]), 1e-12)
    if memory_gb and row["peak_gb"] is not None and row["peak_gb"] > headroom * memory_gb:
        return {**row, "status": "no-fit",
                "why": f"peak {row['peak_gb']:.2f} GiB > {headroom:.0%} of {memory_gb:.1f} GiB"}
    if drift > tol:
        return {**row, "why": f"first-step loss moved {drift:.1e} (tolerance {tol:.0e}): not the same training"}
    if row["delta_prev"] <= 0:
        return {**row, "why": f"{row['delta_prev']:+.1%}: slower than the best so far"}
    if row["delta_prev"] <= noise:
        return {**row, "why": f"{row['delta_prev']:+.1%}: within the noise ({noise:.1%})"}
    if numerics == "fp8" and not fp8:
        return {**row, "why": "fp8 changes numerics: kept only when asked for (--ladder-fp8)"}
    return {**row, "kept": True, "why": f"{row['delta_prev']:+.1%} (noise {noise:.1%}); loss within {tol:.0e}"}


def _summary_keys() -> tuple[str, ...]:
    return ("tok_per_s", "spread", "mfu", "peak_gb", "loss", "data_share", "hours", "cost")


def _summary(m: dict[str, Any], fpt: float, peak: float | None, run_tokens: int, price: float) -> dict[str, Any]:
    rate = m["tok_per_s"]
    hours = run_tokens / rate / 3600
    return {"tok_per_s": rate, "spread": spread(m.get("tok_per_s_windows") or [rate]),
            "mfu": rate * fpt / peak if peak else None, "peak_gb": m.get("peak_gb"), "loss": m.get("first_loss"),
            "data_share": m.get("data_share"), "hours": hours, "cost": hours * price if price else None}


def _empty() -> dict[str, Any]:
    return {"tok_per_s": None, "spread": None, "mfu": None, "peak_gb": None, "loss": None, "data_share": None,
            "hours": None, "cost": None, "delta_prev": None, "delta_start": None}


def _changes(settings: Settings) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def _rate(row: dict[str, Any]) -> str:
    return f"{row['tok_per_s']:>10,.0f} tok/s" if row.get("tok_per_s") else f"{row['status']:>16}"


def _settings_of(cfg: RunConfig) -> Settings:
    t = cfg.train
    return {"train.precision": t.precision, "model.attention": cfg.model.attention, "train.compile": t.compile,
            "train.compile_mode": t.compile_mode, "train.loss": t.loss, "train.micro_batch_size": t.micro_batch_size,
            "train.activation_checkpointing": t.activation_checkpointing, "train.threads": t.threads}
