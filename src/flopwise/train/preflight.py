"""``flopwise preflight``: fit the run to the machine before spending the budget.

1. **End to end**: a few real training steps in a scratch run directory -- data readable,
   model built, loss finite and falling, a checkpoint saved and loaded back identically.
2. **Compile**: graphs and graph breaks with reasons (``train --explain``'s report).
3. **Micro-batch search** at the configured global batch: powers of two and the planner's
   largest fitting micro-batch, each timed after warm-up (tokens/s, MFU, peak memory); an
   out-of-memory is caught and noted; sizes the memory model says cannot fit under the
   headroom are not run (on a CPU, ``--memory-gb`` simulates a device). Activation
   checkpointing is tried where it makes a larger micro-batch fit. The fastest that fits wins.
4. **Data starvation**: the share of step time spent waiting for data, with a warning.
5. **Prediction**: the full run's wall time, cost and final-checkpoint time from the
   measured throughput, next to the planner's from the nominal MFU.

Writes ``preflight.json`` and ``preflight.yaml`` (the configuration with the chosen
settings: ``flopwise train --config preflight.yaml`` runs it as is).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from flopwise.config import RunConfig
from flopwise.measure.sinks import human
from flopwise.plan.flops import flops_per_token
from flopwise.plan.budget import memory_settings_for_run
from flopwise.plan.memory import MemorySettings, estimate

Log = Callable[[str], None]
STARVATION_WARN = 0.05  # waiting for data above 5% of step time deserves a look


@dataclass
class Trial:
    micro_batch: int
    checkpointing: str
    status: str  # ok | oom | no-fit (planner) | error
    tok_per_s: float | None = None
    mfu: float | None = None
    peak_gb: float | None = None
    predicted_gb: float | None = None
    data_share: float | None = None
    note: str = ""


def _oom(e: BaseException) -> bool:
    return isinstance(e, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


def measure(cfg: RunConfig, micro_batch: int, checkpointing: str, warmup: int, steps: int,
            device: torch.device) -> dict[str, float]:
    """Tokens/s, peak memory and data share of ``steps`` optimizer steps after ``warmup``, with
    the trainer's own step (loss function, wrappers, precision, optimizer) at this micro-batch."""
    from flopwise.data.datadir import open_data_dir
    from flopwise.data.loader import make_loader
    from flopwise.model import build_model, configure_attention
    from flopwise.train.optim import build_optimizer
    from flopwise.train.precision import resolve
    from flopwise.train.step import forward_backward, make_loss_fn
    from flopwise.train.trainer import autocast_factory, resolve_loss_impl
    from flopwise.train.wrap import wrap_model

    t = cfg.train
    t.micro_batch_size, t.activation_checkpointing = micro_batch, checkpointing
    accum = cfg.grad_accum_steps()
    prec = resolve(t.precision, device)
    data = open_data_dir(cfg.data, log=lambda s: None)
    loader = make_loader(cfg.data.loader, data, "train", t.seq_len, micro_batch, seed=t.seed, device=device,
                         doc_boundaries=cfg.model.doc_mask)
    model = build_model(cfg.model, device=device, seed=t.seed)
    configure_attention(model, device, prec.autocast_dtype or torch.float32)
    wrap_model(model, t)
    loss_fn = make_loss_fn(model, resolve_loss_impl(t.loss, cfg.model, t, device), t.loss_chunk_tokens,
                           compile_mode=t.compile_mode if t.compile == "model" else None)
    opt = build_optimizer(model, cfg.optim, device)
    autocast = autocast_factory(device, prec.autocast_dtype)
    data_s = 0.0

    def batches():
        nonlocal data_s
        for _ in range(accum):
            t0 = time.perf_counter()
            b = loader.next_batch()
            data_s += time.perf_counter() - t0
            yield b

    def step():
        forward_backward(model, batches(), cfg.tokens_per_step, autocast, loss_fn)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    try:
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        data_s = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    finally:
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    return {"tok_per_s": steps * cfg.tokens_per_step / wall, "peak_gb": peak, "data_share": data_s / wall}


def candidates(cfg: RunConfig) -> list[int]:
    """Micro-batches that divide the global batch: powers of two up to it."""
    g = cfg.train.global_batch_size
    out, b = [], 1
    while b <= g:
        if g % b == 0:
            out.append(b)
        b *= 2
    return out


def preflight(cfg: RunConfig, tokens: int = 0, hours: float = 0.0, memory_gb: float = 0.0,
              headroom: float = 0.9, warmup: int = 2, steps: int = 3, price_per_gpu_hour: float = 0.0,
              out_dir: str | Path = "", measure_fn=measure, log: Log = print) -> dict[str, Any]:
    from flopwise.train.trainer import device_peak, explain_run, resolve_device, train

    device = resolve_device(cfg.train.device)
    out = Path(out_dir or f"runs/{cfg.preset or 'run'}-preflight")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"preset": cfg.preset, "device": str(device)}
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
        memory_gb = memory_gb or torch.cuda.get_device_properties(device).total_memory / 2**30
    precision = cfg.train.precision if cfg.train.precision != "auto" else (
        "bf16" if device.type == "cuda" else "float32")
    peak, peak_note = device_peak(device, precision, cfg.train.peak_tflops)
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)

    # 1. end to end, in a scratch directory
    scratch = Path(tempfile.mkdtemp(prefix="flopwise-preflight-"))
    try:
        check = _copy(cfg)
        check.train.run_dir, check.train.max_steps, check.train.max_tokens = str(scratch / "run"), 4, 0
        check.train.checkpoint_every, check.train.log_every, check.eval.every = 2, 1, 0
        check.eval.sample_tokens, check.eval.tasks, check.tracking.tensorboard = 0, "", "false"
        result = train(check, log=lambda s: None)
        rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        e2e = _check_checkpoint(result.run_dir, check, device)
        e2e.update(loss_first=losses[0], loss_last=losses[-1], finite=all(map(_finite, losses)),
                   falling=losses[-1] < losses[0],
                   recompiles=[r["message"] for r in rows if r.get("event") == "recompile"])
        report["end_to_end"] = e2e
        log(f"preflight: end to end OK · loss {losses[0]:.4f} -> {losses[-1]:.4f} over 4 steps"
            f" ({'falling' if e2e['falling'] else 'NOT falling'}) · checkpoint round trip "
            f"{'identical' if e2e['checkpoint_identical'] else 'DIFFERENT'} · save {e2e['save_s']:.2f}s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    # 2. compile diagnostics: graphs and breaks; recompiles seen after warm-up in the steps above
    if cfg.train.compile != "off":
        report["compile"] = explain_run(_copy(cfg), log=log)
        for warning in report["end_to_end"]["recompiles"]:
            log(f"preflight: {warning}")

    # 3. micro-batch search
    from flopwise.train.trainer import resolve_loss_impl

    loss = resolve_loss_impl(cfg.train.loss, cfg.model, cfg.train, device)
    settings = memory_settings_for_run(cfg, precision, loss)  # activation checkpointing: tried both below
    trials: list[Trial] = []
    for ckpt in ("none", "full"):
        for b in candidates(cfg):
            s = MemorySettings(**{**settings.__dict__, "activation_checkpointing": ckpt})
            pred = estimate(cfg.model, b, cfg.train.seq_len, s).gb()["total"]
            trial = Trial(b, ckpt, "ok", predicted_gb=pred)
            if ckpt == "full" and any(x.status == "ok" and x.checkpointing == "none" and x.micro_batch >= b
                                      for x in trials):
                continue  # checkpointing only where it lets a larger micro-batch fit
            if memory_gb and pred > headroom * memory_gb:
                trial.status, trial.note = "no-fit", f"planner: {pred:.2f} GiB > {headroom:.0%} of {memory_gb:.1f} GiB"
                trials.append(trial)
                continue
            try:
                m = measure_fn(_copy(cfg), b, ckpt, warmup, steps, device)
            except Exception as e:  # an OOM is a result, anything else too, but named
                trial.status = "oom" if _oom(e) else "error"
                trial.note = str(e).splitlines()[0][:200]
                trials.append(trial)
                continue
            trial.tok_per_s, trial.peak_gb, trial.data_share = m["tok_per_s"], m["peak_gb"], m["data_share"]
            trial.mfu = trial.tok_per_s * fpt / peak if peak else None
            if trial.peak_gb is not None and memory_gb and trial.peak_gb > headroom * memory_gb:
                trial.status, trial.note = "no-fit", f"measured {trial.peak_gb:.2f} GiB > {headroom:.0%} headroom"
            trials.append(trial)
    ok = [x for x in trials if x.status == "ok"]
    if not ok:
        raise RuntimeError("preflight: no micro-batch fits: " + "; ".join(f"{x.micro_batch}: {x.note}" for x in trials))
    best = max(ok, key=lambda x: x.tok_per_s)
    report["trials"] = [x.__dict__ for x in trials]
    report["chosen"] = {"micro_batch_size": best.micro_batch, "activation_checkpointing": best.checkpointing}
    log(f"{'micro-batch':>11} {'ckpt':>5} {'status':>7} {'tok/s':>10} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9}"
        f" {'data':>6}")
    for x in trials:
        log(f"{x.micro_batch:>11} {x.checkpointing:>5} {x.status:>7} "
            f"{human(x.tok_per_s) if x.tok_per_s else '-':>10} "
            f"{f'{100 * x.mfu:.1f}%' if x.mfu is not None else 'n/a':>6} "
            f"{f'{x.peak_gb:.2f}' if x.peak_gb is not None else 'n/a':>9} {x.predicted_gb:>9.2f} "
            f"{f'{100 * x.data_share:.1f}%' if x.data_share is not None else '-':>6}"
            f"{'  <- chosen' if x is best else ''}{'  ' + x.note if x.note else ''}")

    # 4. data starvation
    report["data_share"] = best.data_share
    if best.data_share is not None and best.data_share > STARVATION_WARN:
        remedies = (["data.loader=epoch (no random sampling)"] if cfg.data.loader == "random" else []) + [
            "a faster disk", "data.prefetch"]
        log(f"preflight: WARNING: {100 * best.data_share:.1f}% of step time waits for data: try "
            f"{', '.join(remedies[:-1])} or {remedies[-1]}")

    # 5. prediction
    tuned = _copy(cfg)
    tuned.train.micro_batch_size, tuned.train.activation_checkpointing = best.micro_batch, best.checkpointing
    hours = hours or (cfg.train.max_hours if not tokens else 0.0)  # a run bounded by train.max_hours
    budget_tokens = tokens or (int(hours * 3600 * best.tok_per_s) if hours else tuned.total_steps() * tuned.tokens_per_step)
    if cfg.train.max_hours and budget_tokens / best.tok_per_s > cfg.train.max_hours * 3600:
        budget_tokens = int(cfg.train.max_hours * 3600 * best.tok_per_s)  # it will stop on time, with fewer tokens
        report["stops_at_max_hours"] = True
    # A batch-size ramp changes how tokens are grouped into steps, not the tokens per second of a
    # micro-batch, so the same rate carries the whole run.
    wall_s = budget_tokens / best.tok_per_s
    report["prediction"] = {
        "tokens": budget_tokens, "tok_per_s": best.tok_per_s, "mfu": best.mfu, "memory_gb": best.peak_gb or
        best.predicted_gb, "wall_time_s": wall_s, "hours": wall_s / 3600,
        "cost": wall_s / 3600 * price_per_gpu_hour if price_per_gpu_hour else None,
        "final_checkpoint_s": report["end_to_end"]["save_s"],
        "planner": {"mfu": 0.40, "hours": budget_tokens * fpt / (0.40 * peak) / 3600 if peak else None,
                    "note": peak_note},
    }
    if tokens:
        tuned.train.max_tokens, tuned.train.max_steps = tokens, 0
    p = report["prediction"]
    planned = f"planner at 40% MFU: {p['planner']['hours']:.2f} h" if p["planner"]["hours"] else "planner: no peak"
    cost = f" · ${p['cost']:,.0f}" if p["cost"] else ""
    log(f"preflight: {human(budget_tokens)} tokens at {human(best.tok_per_s)} tok/s = {p['hours']:.2f} h{cost}"
        f" · {planned} · final checkpoint ~{p['final_checkpoint_s']:.2f}s")

    (out / "preflight.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    tuned.train.run_dir = ""
    data = tuned.to_dict()
    data["train"]["preflight"] = str((out / "preflight.json").resolve())
    (out / "preflight.yaml").write_text(yaml.safe_dump({"preset": cfg.preset, **data}, sort_keys=False))
    log(f"preflight: wrote {out / 'preflight.json'} and {out / 'preflight.yaml'} "
        f"(flopwise train --config {out / 'preflight.yaml'})")
    return report


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _copy(cfg: RunConfig) -> RunConfig:
    import copy

    return copy.deepcopy(cfg)


def _check_checkpoint(run_dir: Path, cfg: RunConfig, device: torch.device) -> dict[str, Any]:
    """Load the scratch run's last checkpoint into a fresh model: every tensor must come back."""
    from flopwise.model import build_model
    from flopwise.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    ckpt = latest_checkpoint(run_dir)
    model = build_model(cfg.model, device=device, seed=cfg.train.seed + 1)
    load_checkpoint(ckpt, model, map_location=device)
    saved = torch.load(ckpt / "model.pt", map_location=device, weights_only=True)
    identical = all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    t0 = time.perf_counter()
    save_checkpoint(run_dir, 10**6, model, None, {}, "", rng=None)  # the weights alone...
    # ... a full checkpoint also holds AdamW's two moments: about three times the bytes.
    return {"checkpoint_identical": identical, "save_s": 3 * (time.perf_counter() - t0)}

