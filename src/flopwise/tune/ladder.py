"""The optimization ladder: the rungs people climb by hand to make a run fast, climbed for them.

``flopwise preflight --ladder`` starts from the user's configuration and tries one change
at a time, in the order people climb: precision (on CUDA, and on a CPU that multiplies bf16
natively: AMX or AVX-512 BF16), attention kernel, compile, loss path,
micro-batch, activation checkpointing (only where it lets a micro-batch fit that does not fit
without), the loader (batches assembled ahead; pinned host memory on CUDA), then on CUDA the
compile mode and on a CPU the thread count. The compile modes come last: ``max-autotune``
tunes kernels for the shapes of the chosen micro-batch, and its compile can take minutes,
which the rungs that usually pay more (the micro-batch above all) should not wait behind.
With ``--nproc-per-node N`` the climbed configuration is then scaled out to N ranks on this
machine, and the data-parallel strategy and the gradient bucket size are climbed there.

Each option is measured on its own, as the micro-batch search's trials are (``trial.TrialRunner``
around ``trial.measure``: a fresh model, optimizer and compiler; on CUDA an emptied allocator
and a reset peak; with ``--isolation process``, the default on a GPU, in a fresh process,
which is how N-rank options always run), and is **kept** only when

- it is faster than the best so far by more than the noise (the two measurements' spreads
  added, never less than ``MIN_NOISE``) -- for a micro-batch or checkpointing row, it is the
  one :func:`~flopwise.tune.choice.choose` picks of the two in the one micro-batch search
  (:func:`~flopwise.tune.choice.search`, the plain search's too): beyond the noise the faster,
  within it no checkpointing first, then on a GPU the larger micro-batch, on a CPU the faster
  median;
- its first step's loss -- the same initial weights on the same first global batch -- is
  within ``SAME_NUMERICS`` of the kept configuration's (``CHANGED_NUMERICS`` for a rung that
  changes numerics on purpose, such as bf16; fp8 is measured where it runs and kept only
  when asked for);
- it fits the memory (measured peak under ``headroom`` of the device; an option whose
  planned peak does not fit is not run at all).

The climb is greedy: a kept option becomes the configuration the next options must beat.
At the end the climbed configuration is measured once more (``confirm``): the kept rate is
the best of noisy measurements and reads high; the fresh one is the ladder's final rate. When
that fresh rate is below the start's by more than the noise (the spreads added, as above), the
kept rungs did not hold up: the climb falls back to the starting configuration (at N ranks, to
the scale-out's), says so, and ``preflight.yaml`` ships that (``ladder["fell_back"]``).
It stops trying options once its budget (``--budget-minutes``) is spent (those rows say so);
each row records the seconds its trial took. Before the budget is spent, time is held back
for the rows that end the climb -- the scale-out to N ranks and, once a rung is kept, the
confirmation -- about one start trial each, so a slow option (a long compile) cannot leave
the climb unconfirmed. The ladder is a preflight option rather than its own command because
it ends where preflight ends: the tuned ``preflight.yaml`` that ``flopwise train --config``
runs, and the prediction the run's report compares with.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flopwise.config import RunConfig, batch_split_problems, validate
from flopwise.measure.meter import MIN_NOISE
from flopwise.model.attention import available_backends, select_backend
from flopwise.model.loss import fused_linear_cross_entropy_available
from flopwise.parallel.strategy import incompatibilities
from flopwise.plan.budget import memory_settings_for_run
from flopwise.plan.flops import param_counts
from flopwise.plan.memory import estimate, numerics_change, state_bytes
from flopwise.train.precision import cpu_native_bf16, fp8_problem
from flopwise.train.precision import resolve as resolve_precision
from flopwise.tune.choice import Trial, median_spread, search
from flopwise.tune.request import Bench, TuneRequest
from flopwise.tune.trial import failure_status

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
          fp8: bool = False) -> list[tuple[str, list[Settings] | None, str]]:
    """``(rung, options, numerics)`` in climbing order, each where this device has it.
    ``numerics``: "same", "changed" (kept within CHANGED_NUMERICS), "residual" (a strategy whose
    residual stream has another dtype: measured, never kept by itself) or "fp8" (measured where the
    device and torchao can run it, kept only if asked).
    The checkpointing rung's options (None here) depend on which micro-batches did not fit."""
    t, cuda = cfg.train, device.type == "cuda"
    out: list[tuple[str, list[Settings] | None, str]] = []
    if cuda:
        precisions = [p for p in ("bf16", "bf16-pure") if p != resolve_precision(t.precision, device).name]
        out.append(("precision", [{"train.precision": p} for p in precisions], "changed"))
        if (fp8 or fp8_problem(device) is None) and not t.fp8:  # measured where it runs; kept only if asked
            out.append(("fp8", [{"train.fp8": True}], "fp8"))
        usable = available_backends(device, torch.bfloat16)
        current = select_backend(cfg.model.attention, device, torch.bfloat16, cfg.model.doc_mask)[0]  # auto's pick
        out.append(("attention", [{"model.attention": b} for b in ("flash", "flex", "sdpa")
                                  if usable.get(b) is None and b != current], "same"))
    elif cpu_native_bf16() and resolve_precision(t.precision, device).name != "bf16":
        # AMX / AVX-512 BF16 multiply bf16 matrices several times faster than float32
        out.append(("precision", [{"train.precision": "bf16"}], "changed"))
    out.append(("compile", [{"train.compile": c} for c in ("blocks", "model") if c != t.compile], "same"))
    losses = ["plain", "chunked"] + (["fused"] if fused_linear_cross_entropy_available(device) else [])
    out.append(("loss", [{"train.loss": x} for x in losses if x != t.loss], "same"))
    out.append(("micro-batch", [{"train.micro_batch_size": b} for b in sizes if b != t.micro_batch_size], "same"))
    out.append(("checkpointing", None, "same"))
    # The host side: batches assembled ahead on a thread; on CUDA pinned (page-locked) host
    # buffers, which make the copy asynchronous (on by default; tried off only if it is off).
    loader = [{"data.prefetch": n} for n in (1, 2) if n != cfg.data.prefetch]
    if cuda and not cfg.data.pin_memory:
        loader.insert(0, {"data.pin_memory": True})
    out.append(("loader", loader, "same"))
    if cuda:  # last: max-autotune tunes for the chosen micro-batch, and may compile for minutes
        out.append(("compile mode", [{"train.compile_mode": m} for m in ("max-autotune", "reduce-overhead")
                                     if m != t.compile_mode], "same"))
    else:  # how many cores torch computes with: all of them is not always fastest
        cores = os.cpu_count() or 1
        threads_now = t.threads or torch.get_num_threads()
        counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, cores) if n <= cores} - {threads_now})
        out.append(("threads", [{"train.threads": n} for n in counts], "same"))
    return out


def data_parallel_rungs(cfg: RunConfig, precision: str, strategy: str) -> list[tuple[str, list[Settings], str]]:
    """At N ranks, after the scale-out (measured with ``strategy``, what ``parallel.strategy``
    resolved to): the other strategies that can run this configuration, then for DDP and
    ZeRO-1 the gradient bucket size (the all-reduce's unit: small buckets start early and
    overlap more of backward, large ones pay less latency per byte)."""
    others = [s for s in ("ddp", "zero1", "fsdp2") if s != strategy and not incompatibilities(cfg, s, precision)]
    buckets = [mb for mb in (10.0, 50.0, 100.0) if mb != cfg.parallel.bucket_mb]
    same = [s for s in others if not numerics_change(s, strategy, precision)]
    unlike = [s for s in others if s not in same]  # fsdp2 beside ddp under bf16: another residual stream
    return [("strategy", [{"parallel.strategy": s} for s in same], "same"),
            *([("strategy", [{"parallel.strategy": s} for s in unlike], "residual")] if unlike else []),
            ("buckets", [{"parallel.bucket_mb": mb} for mb in buckets], "same")]


def climb(cfg: RunConfig, measure_one: Callable[..., dict[str, Any]], sizes: list[int], bench: Bench,
          request: TuneRequest, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Climb from ``cfg`` on ``bench`` as ``request`` asks (its budget, ranks, fp8, run and log),
    its budget kept by ``clock``; ``measure_one(cfg, world=1, timeout_s=None)`` times a configuration on ``world``
    ranks (``trial.measure``'s dict, with ``first_loss``: preflight gives a ``trial.TrialRunner``),
    within ``timeout_s`` where it can stop a trial (one in its own processes), or raises (an
    out-of-memory is a result). ``sizes``: the micro-batches the micro-batch rung may try.
    The per-device rungs run on one rank; with ``request.world > 1`` the climbed configuration
    is then scaled out to that many ranks and the strategy and bucket rungs run there. Returns
    the ladder as ``preflight.json`` records it (``report`` draws it) with the chosen settings.
    Where trials share this process (not ``bench.fresh``), the start is measured once untimed first."""
    c = Climb(measure_one, bench, request, request.tokens or cfg.total_steps() * cfg.tokens_per_step, clock)
    if not c.run_tokens:  # a time budget alone (train.max_hours, or --hours)
        c.fixed_hours = request.hours or cfg.train.max_hours
    if not bench.fresh:  # the first measurement in a process pays its warm-up (threads, allocator, caches)
        measure_one(cfg)
    t0 = c.clock()
    start = measure_one(cfg)
    c.begin(cfg, start, request.world, seconds=c.clock() - t0)
    too_big: list[int] = []  # micro-batches that did not fit without checkpointing
    for name, options, numerics in rungs(cfg, bench.device, sizes, request.ladder_fp8):
        if name == "micro-batch":
            too_big = c.micro_batches(sizes)
        elif name == "checkpointing":
            c.checkpointing(too_big)
        else:
            for settings in options or []:
                if name == "compile mode" and c.cfg.train.compile == "off":
                    continue  # a mode of a compiler that is not on
                c.attempt(name, settings, numerics)
    if request.world > 1:
        c.scale_out(request.world)
    c.confirm()
    # world: the ranks the final configuration was measured on -- the launch that was measured, which
    # preflight writes and predicts; one rank when the scale-out was skipped or failed
    c.ladder.update(chosen=c.chosen, final=c.best, spent_minutes=c.spent_s() / 60, world=c.world,
                    world_asked=request.world)
    return c.ladder


@dataclass(frozen=True)
class Fallback:
    """Where a climb whose confirmation measures slower ends instead (``Climb.fell_back``):
    what it is called, its configuration, the settings it keeps and its figures."""

    what: str
    cfg: RunConfig
    chosen: Settings
    best: dict[str, Any]


class Climb:
    """One climb's fixed setting (how an option is measured, judged and priced) and its state:
    the configuration so far, its figures, the settings kept and the rows."""

    def __init__(self, measure_one: Callable[..., dict[str, Any]], bench: Bench, request: TuneRequest,
                 run_tokens: int, clock: Callable[[], float] = time.perf_counter):
        self.measure_one, self.bench, self.device, self.run_tokens = measure_one, bench, bench.device, run_tokens
        self.fixed_hours = 0.0  # a run whose only limit is its time: every option trains that long, to more tokens
        self.budget_s, self.fp8 = request.budget_minutes * 60, request.ladder_fp8
        self.price = request.price_per_gpu_hour
        self.clock, self.log, self.t0 = clock, request.log, clock()
        self.world = 1  # ranks the options are measured on now
        self.chosen: Settings = {}

    def spent_s(self) -> float:
        return self.clock() - self.t0

    def begin(self, cfg: RunConfig, start: dict[str, Any], world: int, seconds: float = 0.0) -> None:
        self.cfg, self.best = cfg, self.summary(start)
        self.ladder: dict[str, Any] = {"device": str(self.device), "budget_minutes": self.budget_s / 60,
                                       "rungs": [], "world": world,
                                       "start": {**self.best, "seconds": seconds, "settings": _settings_of(cfg)}}
        loss = "not measured" if self.best["loss"] is None else f"{self.best['loss']:.6g}"
        self.log(f"ladder: start {self.best['tok_per_s']:,.0f} tok/s · first-step loss {loss} · "
                 f"{seconds:.0f} s a trial")
        self.fallback = Fallback("the starting configuration", cfg, {}, self.best)

    def summary(self, m: dict[str, Any], world: int = 1) -> dict[str, Any]:
        """A measurement on ``world`` ranks as a ladder row's figures: the rate is the global
        batch's, MFU is per device and the cost counts every device's hours."""
        rate = m["tok_per_s"]
        hours = self.fixed_hours or self.run_tokens / rate / 3600
        return {"tok_per_s": rate, "spread": median_spread(m.get("tok_per_s_windows") or [rate]),
                "mfu": self.bench.mfu(rate, world), "peak_gb": m.get("peak_gb"), "loss": m.get("first_loss"),
                "data_share": m.get("data_share"), "hours": hours,
                "cost": hours * self.price * world if self.price else None}

    def measure(self, row: dict[str, Any], cfg: RunConfig, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``row`` with ``cfg`` measured on ``world`` ranks: its figures and its change against the
        best so far and the start (status ok), or why there are none (the budget is spent: skipped;
        out of memory; an error); and the measurement ({} without one)."""
        held, for_what = self.held_back(row["rung"])
        left = self.budget_s - self.spent_s() - held
        if left <= 0:
            why = "the time budget is spent" + (f" (the last {held:.0f} s are held for {for_what})" if held else "")
            return {**row, "status": "skipped", "why": why}, {}
        t0 = self.clock()
        try:  # a trial in its own processes is stopped where its share of the budget ends
            m = self.measure_one(cfg, world=world, timeout_s=left)
        except Exception as e:  # noqa: BLE001 - an out-of-memory or an unsupported combination is a result
            return {**row, "status": failure_status(e), "why": str(e).splitlines()[0][:200],
                    "seconds": self.clock() - t0}, {}
        out = {**row, **self.summary(m, world), "status": "ok", "seconds": self.clock() - t0}
        out["delta_prev"] = out["tok_per_s"] / self.best["tok_per_s"] - 1
        out["delta_start"] = out["tok_per_s"] / self.ladder["start"]["tok_per_s"] - 1
        return out, m

    def held_back(self, rung: str) -> tuple[float, str]:
        """Seconds of the budget an option may not use, and what for: about one start trial for
        each row still to come that ends the climb -- the scale-out to N ranks, and the
        confirmation once a rung has been kept. Those rows themselves use all that is left."""
        if rung in ("ranks", "confirm"):
            return 0.0, ""
        rows = (["the scale-out"] if self.ladder["world"] > 1 and self.world == 1 else []) + (
            ["the confirmation"] if any(r["kept"] for r in self.ladder["rungs"]) else [])
        return self.ladder["start"]["seconds"] * len(rows), " and ".join(rows)  # the start's trial: one more

    def attempt(self, name: str, settings: Settings, numerics: str) -> dict[str, Any]:
        """Measure one option against the best so far, record its row, keep it if it earns that."""
        row = self.judge(name, settings, numerics)
        self.record(row, settings)
        return row

    def record(self, row: dict[str, Any], settings: Settings) -> None:
        self.ladder["rungs"].append(row)
        took = f" · {row['seconds']:.0f} s" if row.get("seconds") is not None else ""
        self.log(f"ladder: {row['rung']:<13} {row['change']:<36} {_rate(row)} {'kept' if row['kept'] else '-':>4} · "
                 f"{row['why']}{took}")
        if row["kept"]:
            self.cfg = with_settings(self.cfg, settings)
            self.chosen = {**self.chosen, **settings}
            self.best = {k: row[k] for k in _summary_keys()}

    def skip(self, name: str, settings: Settings, why: str) -> None:
        self.record({"rung": name, "change": _changes(settings) if settings else "-", "numerics": "same",
                     "status": "skipped", "kept": False, "why": why, **_empty()}, settings)

    def judge(self, name: str, settings: Settings, numerics: str) -> dict[str, Any]:
        """One option measured against the best so far: its row, ``kept`` or not and why (a
        micro-batch or checkpointing row that passes: without a why, for the search to decide)."""
        row = {"rung": name, "change": _changes(settings), "numerics": numerics, "kept": False, **_empty()}
        cand = with_settings(self.cfg, settings)
        problems = validate(cand)
        if problems:
            return {**row, "status": "skipped", "why": "not a valid configuration: " + "; ".join(problems)}
        memory, headroom, best = self.bench.memory_gb, self.bench.headroom, self.best
        planned = planned_gb(cand, self.device) if memory and self.world == 1 else None
        if planned is not None and not self.bench.fits(planned):  # not worth a compile to see it run out
            return {**row, "status": "no-fit",
                    "why": f"planner: {planned:.2f} GiB > {headroom:.0%} of {memory:.1f} GiB (not run)"}
        row, _ = self.measure(row, cand, self.world)
        if row["status"] != "ok":
            return row
        noise = max(MIN_NOISE, (best.get("spread") or 0.0) + (row["spread"] or 0.0))
        tol = SAME_NUMERICS if numerics == "same" else CHANGED_NUMERICS
        drift = _drift(row["loss"], best["loss"])
        if drift is None:
            return {**row, "why": "no first-step loss measured: numerics cannot be checked"}
        if row["peak_gb"] is not None and not self.bench.fits(row["peak_gb"]):
            return {**row, "status": "no-fit",
                    "why": f"peak {row['peak_gb']:.2f} GiB > {headroom:.0%} of {memory:.1f} GiB"}
        if drift > tol:
            return {**row, "why": f"first-step loss moved {drift:.1e} (tolerance {tol:.0e}): not the same training"}
        if name in ("micro-batch", "checkpointing"):  # kept or not by the one search (choice.search)
            return row
        if row["delta_prev"] <= 0:
            return {**row, "why": f"{row['delta_prev']:+.1%}: slower than the best so far"}
        if row["delta_prev"] <= noise:
            return {**row, "why": f"{row['delta_prev']:+.1%}: within the noise ({noise:.1%})"}
        if numerics == "fp8" and not self.fp8:
            return {**row, "why": "fp8 changes numerics: kept only when asked for (--ladder-fp8)"}
        if numerics == "residual":  # a strategy whose residual stream is of another dtype (plan.memory's rule)
            s = settings["parallel.strategy"]
            return {**row, "why": f"{s} changes numerics (another residual-stream dtype): kept only when configured "
                                  f"(parallel.strategy={s})"}
        return {**row, "kept": True, "why": f"{row['delta_prev']:+.1%} (noise {noise:.1%}); loss within {tol:.0e}"}

    def micro_batches(self, sizes: list[int]) -> list[int]:
        """The micro-batch rung, then the checkpointing rung's rows: the one micro-batch search
        (:func:`~flopwise.tune.choice.search`, the plain search's too) from the current size,
        each size judged here (fit, numerics) and kept by its rule; checkpointing selective,
        then full. Returns the sizes checkpointing was tried for (none: the checkpointing rung
        says so)."""
        t = self.cfg.train
        start = Trial(t.micro_batch_size, t.activation_checkpointing, "ok", tok_per_s=self.best["tok_per_s"],
                      spread=self.best.get("spread"))
        pending: dict[int, dict[str, Any]] = {}  # a measured size's row, by its trial, until it is decided

        def measure(b: int, mode: str) -> Trial:
            name, settings = _size_rung(b, mode, start.checkpointing)
            row = self.judge(name, settings, "same")
            # a row the judge turned down (numerics, memory) is not a size the search may choose
            status = row["status"] if row["status"] != "ok" or "why" not in row else "error"
            trial = Trial(b, mode, status, tok_per_s=row["tok_per_s"], spread=row["spread"], note=row.get("why", ""))
            pending[id(trial)] = row
            return trial

        def decided(trial: Trial, best_now: bool, why: str) -> None:
            name, settings = _size_rung(trial.micro_batch, trial.checkpointing, start.checkpointing)
            row = pending.pop(id(trial), None)
            if row is None:  # not measured: past where its direction stopped
                self.skip(name, settings, why)
                return
            if trial.status == "ok":
                row["kept"], row["why"] = best_now, (f"{row['delta_prev']:+.1%}: {why}"
                                                     + (f"; loss within {SAME_NUMERICS:.0e}" if best_now else ""))
            self.record(row, settings)

        _, bigger = search(start, sizes, measure, decided, self.device.type, ("selective", "full"))
        return bigger

    def checkpointing(self, bigger: list[int]) -> None:
        """The checkpointing rung's rows came with the micro-batch search's; without a size that
        needed it, a row says so."""
        if not bigger:
            self.skip("checkpointing", {}, "every micro-batch tried fits without it")

    def confirm(self) -> None:
        """The climbed configuration measured once more, as the ladder's final rate. A kept rung's
        rate is the best of several noisy measurements, so it reads high (the winner's curse);
        a fresh measurement of the same configuration does not, and is what the run that follows
        is predicted from. Its row says how far the kept rate was above it. Slower than the start
        beyond the noise, the climb falls back to the start (:meth:`fell_back`). Nothing to confirm
        when no rung was kept (the start was measured once, unselected) or on the scale-out's
        own measurement (the ranks row: no choice was made on it)."""
        kept = [r for r in self.ladder["rungs"] if r["kept"]]
        if not kept or kept[-1]["rung"] == "ranks":
            return
        row, _ = self.measure({"rung": "confirm", "change": "-", "numerics": "same", "kept": False, **_empty()},
                              self.cfg, self.world)
        if row["status"] == "skipped":
            row["why"] += ": the final rate is the kept rung's, the best of its measurements (it may read high)"
        if row["status"] == "ok":
            self.ladder["selection_bias"] = self.best["tok_per_s"] / row["tok_per_s"] - 1
            if self.fell_back(row):
                return
            row["kept"] = True
            row["why"] = (f"the climbed configuration measured again: {row['delta_prev']:+.1%} against its kept "
                          "rate (the best of several measurements reads high); the run is predicted from this one")
        self.record(row, {})

    def fell_back(self, row: dict[str, Any]) -> bool:
        """Whether the confirmation ``row`` measured the climbed configuration slower than where
        the climb started (``self.fallback``) by more than the two measurements' noise (the
        rule an option is kept by, reversed): then the kept rungs did not hold up when measured
        again, and the climb ends on the start -- its configuration, settings and rate, a
        measurement taken once and not selected -- with a row and a line that say so."""
        back = self.fallback
        noise = max(MIN_NOISE, (back.best.get("spread") or 0.0) + (row["spread"] or 0.0))
        behind = row["tok_per_s"] / back.best["tok_per_s"] - 1
        if behind >= -noise:
            return False
        row["why"] = (f"the climbed configuration measured again: {row['tok_per_s']:,.0f} tok/s, {behind:+.1%} "
                      f"against {back.what} ({back.best['tok_per_s']:,.0f}; noise {noise:.1%}): its kept rungs did "
                      f"not hold up -- falling back to {back.what}")
        self.record(row, {})
        self.log(f"ladder: the climbed configuration measured slower than {back.what} ({behind:+.1%}, "
                 f"{row['tok_per_s']:,.0f} against {back.best['tok_per_s']:,.0f} tok/s): preflight.yaml gets "
                 f"{back.what}, not {_changes(self.chosen) or 'the climb'}")
        self.ladder["fell_back"] = {"to": back.what, "confirmed_tok_per_s": row["tok_per_s"], "behind": behind,
                                    "noise": noise, "dropped": {k: v for k, v in self.chosen.items()
                                                                if k not in back.chosen}}
        self.cfg, self.chosen, self.best = back.cfg, dict(back.chosen), dict(back.best)
        return True

    def scale_out(self, world: int) -> None:
        """The climbed configuration on ``world`` ranks (kept: it is the launch being planned),
        then the strategy and bucket rungs against it."""
        cfg, one = self.cfg, self.best
        row = {"rung": "ranks", "change": f"{world} ranks", "numerics": "same", "kept": False, **_empty()}
        split = batch_split_problems(cfg.train, world)
        if split:
            self.record({**row, "status": "skipped", "why": "; ".join(split)}, {})
            return
        row, m = self.measure(row, cfg, world)
        if row["status"] != "ok":  # the N-rank launch failing is a result; the one-rank climb stands
            self.record(row, {})
            return
        self.world = world
        strategy = m.get("strategy") or cfg.parallel.strategy
        row.update(kept=True, change=f"{world} ranks, parallel.strategy={strategy}")
        scaling = row["tok_per_s"] / (world * one["tok_per_s"])
        drift = _drift(row["loss"], one["loss"])
        row["why"] = (f"the launch asked for: {row['tok_per_s'] / one['tok_per_s']:.2f}x one rank's rate, "
                      f"{scaling:.0%} scaling efficiency"
                      + (f"; first-step loss {drift:.1e} from one rank's" if drift is not None else ""))
        self.ladder["scaling_efficiency"] = scaling
        self.record(row, {"parallel.strategy": strategy})
        # what the N-rank rungs are confirmed against: one rank's start was measured on other ranks
        self.fallback = Fallback(f"the {world}-rank launch of the one-rank climb", self.cfg, self.chosen, self.best)
        precision = resolve_precision(cfg.train.precision, self.device).name
        grads_mb = gradient_mb(cfg, precision)
        # DDP fills a first 1 MB bucket, then buckets of bucket_mb: every size at least the gradients' own
        # makes the same two buckets, so one such size is measured (the configuration's, or the first tried)
        one_bucket = cfg.parallel.bucket_mb if cfg.parallel.bucket_mb >= grads_mb else None
        for name, options, numerics in data_parallel_rungs(self.cfg, precision, strategy):
            for settings in options:
                if name == "buckets" and self.cfg.parallel.strategy not in ("ddp", "zero1"):
                    continue  # FSDP2 reduce-scatters per block: no bucket size
                if name == "buckets" and settings["parallel.bucket_mb"] >= grads_mb:
                    if one_bucket is not None:
                        self.skip(name, settings, f"the buckets of {one_bucket:g} MB: the gradients "
                                                  f"({grads_mb:.1f} MB) fit in one bucket of either size")
                        continue
                    one_bucket = settings["parallel.bucket_mb"]
                self.attempt(name, settings, numerics)


def _size_rung(micro_batch: int, mode: str, start_mode: str) -> tuple[str, Settings]:
    """A size the micro-batch search tries as a ladder row: the micro-batch rung at the current
    checkpointing, the checkpointing rung at another."""
    if mode == start_mode:
        return "micro-batch", {"train.micro_batch_size": micro_batch}
    return "checkpointing", {"train.micro_batch_size": micro_batch, "train.activation_checkpointing": mode}


def gradient_mb(cfg: RunConfig, precision: str) -> float:
    """The gradients DDP's buckets hold -- every trainable parameter's, in the parameters' dtype
    under ``precision`` -- in ``parallel.bucket_mb``'s unit (2**20 bytes)."""
    settings = memory_settings_for_run(cfg, precision, cfg.train.loss)
    return state_bytes(param_counts(cfg.model)["total"], settings)["grads"] / 2**20


def _drift(loss: float | None, ref: float | None) -> float | None:
    if loss is None or ref is None:
        return None
    return abs(loss - ref) / max(abs(ref), 1e-12)


def planned_gb(cfg: RunConfig, device: torch.device) -> float:
    """The memory model's peak for one rank of ``cfg`` (GiB), as preflight's search uses it."""
    t = cfg.train
    settings = memory_settings_for_run(cfg, resolve_precision(t.precision, device).name, t.loss)
    return estimate(cfg.model, t.micro_batch_size, t.seq_len, settings).gb()["total"]


def _summary_keys() -> tuple[str, ...]:
    return ("tok_per_s", "spread", "mfu", "peak_gb", "loss", "data_share", "hours", "cost")


def _empty() -> dict[str, Any]:
    return {"tok_per_s": None, "spread": None, "mfu": None, "peak_gb": None, "loss": None, "data_share": None,
            "hours": None, "cost": None, "delta_prev": None, "delta_start": None, "seconds": None}


def _changes(settings: Settings) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def _rate(row: dict[str, Any]) -> str:
    return f"{row['tok_per_s']:>10,.0f} tok/s" if row.get("tok_per_s") else f"{row['status']:>16}"


def _settings_of(cfg: RunConfig) -> Settings:
    t = cfg.train
    return {"train.precision": t.precision, "model.attention": cfg.model.attention, "train.compile": t.compile,
            "train.compile_mode": t.compile_mode, "train.loss": t.loss, "train.micro_batch_size": t.micro_batch_size,
            "train.activation_checkpointing": t.activation_checkpointing, "train.threads": t.threads,
            "data.prefetch": cfg.data.prefetch, "data.pin_memory": cfg.data.pin_memory,
            "parallel.strategy": cfg.parallel.strategy, "parallel.bucket_mb": cfg.parallel.bucket_mb}
