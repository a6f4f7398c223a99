"""The start-up summary: what the run is about to do, what was chosen, and why.

One line per subject (device and precision, parallelism, data, model, attention, init,
speed settings, FLOPs, batch, the plan's prediction, tracking, optimizer, time budget,
schedule, batch ramp), each a fact the user can check against their config; a pure function of the
:class:`~flopwise.train.setup.Run`, so it is tested without training.
"""

from __future__ import annotations

import json

from flopwise.data.loader import overlap_note
from flopwise.data.meta import held_out_overlap_note
from flopwise.measure.sinks import human
from flopwise.train.defaults import device_label
from flopwise.train.hooks import fmt_time
from flopwise.train.optim import describe_optimizer, skips_on_device
from flopwise.train.precision import cpu_native_bf16
from flopwise.train.setup import Run


def describe(run: Run) -> list[str]:
    cfg, p, env = run.cfg, run.progress, run.env
    m, t, o = cfg.model, cfg.train, cfg.optim
    total, world = run.total_steps, run.world
    step_tokens = cfg.tokens_per_step
    lines = [f"flopwise train · preset {cfg.preset} · run dir {run.run_dir}"]
    if run.start.resumed_run or run.start.note.startswith("--fresh"):
        lines.append(f"  resume     {run.start.note}" + (f" (step {p.step:,} of {total:,}, {human(p.tokens)} tokens)"
                                                       if run.start.checkpoint else ""))
        if run.start.changes:  # what trains from here on, where it is not what the checkpoint was trained with
            lines.append(f"  {'':<10} {run.start.changes}")
    lines.append(f"  device     {device_label(run.device)} · precision {run.prec.name} · peak {run.flops.peak_note}")
    native = cpu_native_bf16() if run.device.type == "cpu" and t.precision == "auto" else None
    if native and run.prec.name == "float32":
        lines.append(f"  {'':<10} precision auto -> float32, though this CPU multiplies bf16 natively ({native}): "
                     "train.precision=bf16 is faster on larger models; `flopwise preflight --ladder` measures it")
    if run.strategy.name != "single" or world > 1:
        lines.append(f"  parallel   {run.strategy.name} · {world} rank(s), {env.launched} · {env.backend} · "
                     f"{run.strategy.why}")
        lines += [f"  {'':<10} {note}" for note in run.notes.get("parallel", [])]
    else:  # one process: a note only where it continues a DiLoCo checkpoint (what it leaves behind)
        lines += [f"  parallel   {note}" for note in run.notes.get("parallel", [])]
    data = run.data
    epochs = ""
    planned_tokens = total * step_tokens if total else expected_tokens(run)  # a time-only run: what it should reach
    if cfg.data.loader == "epoch" and planned_tokens:
        about = "≈" if not total else ""
        epochs = f" ({about}{planned_tokens / run.train_loader.target_tokens_per_epoch:.2f} epochs)"
    lines.append(f"  data       {data.path} · vocab {data.vocab_size:,} · train {human(data.num_tokens('train'))} "
                 f"tokens · val {human(data.num_tokens('val'))} tokens · loader {cfg.data.loader}{epochs}")
    unused = unused_vocab_note(m.vocab_size, data.vocab_size, m.d_model)
    overlap = overlap_note(len(run.val_windows), t.seq_len, data.num_tokens("val")) if len(run.val_windows) else ""
    leak = held_out_overlap_note(data.meta)
    for note in (unused, f"NOTE: validation: {overlap}; a larger val split gives a steadier loss" if overlap else "",
                 f"WARNING: {leak}" if leak else ""):
        if note:
            lines.append(f"  {'':<10} {note}")
    counts = run.flops.counts
    experts = f" · {m.n_experts} experts top-{m.moe_top_k} ({human(counts['active'])} active)" if m.is_moe else ""
    lines.append(f"  model      {m.arch} · {m.n_layers} layers · d_model {m.d_model} · heads {m.n_heads} q / "
                 f"{m.n_kv_heads} kv · {m.mlp} {m.expert_ffn_hidden if m.is_moe else m.ffn_hidden} · {m.norm} · "
                 f"{m.pos_emb}{experts} · params {human(counts['total'])} ({human(counts['non_embedding'])} "
                 "non-embedding)")
    for label in ("attention", "init", "speed", "validation"):
        for i, note in enumerate(run.notes.get(label, [])):
            lines.append(f"  {label if i == 0 else '':<10} {note.removeprefix('attention: ')}")
    fpt = run.flops.per_token
    if total:
        length = (f"{total:,} steps × {step_tokens:,} tokens = {human(total * step_tokens)} tokens planned"
                  f" · {human(fpt * total * step_tokens)}FLOP total")
    else:
        length = "as many steps as train.max_hours holds" + (f" (≈{human(planned_tokens)} tokens, "
                                                             f"{human(fpt * planned_tokens)}FLOP)" if planned_tokens
                                                             else "")
    lines.append(f"  FLOPs      {human(fpt)}/token (6·N_matmul + attention at seq {t.seq_len}) · {length}")
    ranks = f" × {world} ranks" if world > 1 else ""
    lines.append(f"  batch      global {t.global_batch_size} × seq {t.seq_len} = {step_tokens:,} tokens/step"
                 f" · micro-batch {t.micro_batch_size} × accumulation {run.accum}{ranks}")
    plan = run.plan
    predicted = (f"{plan['hours'] * 60:.1f} min at {100 * plan['mfu']:.0f}% MFU" if plan["hours"] is not None
                 else "time n/a (no peak)")
    lines.append(f"  plan       memory ≈ {plan['memory_gb']:.2f} GiB (model of params, grads, AdamW, activations)"
                 f" · {predicted} · plan.json")
    code = run.record["code"]
    commit = code["git_commit"]
    lines.append(f"  tracking   {', '.join(run.sink.names)} · run.json (code {commit[:12] if commit else 'not in git'}"
                 f"{' + uncommitted changes' if code['git_dirty'] else ''})")
    lines += [f"  tracking   {note}" for note in getattr(run.sink, "notes", [])]
    sched = {"cosine": f"cosine to {o.lr * o.min_lr_ratio:g}", "constant": "constant",
             "wsd": f"WSD: {o.decay_shape} decay over the last {o.decay_fraction:.0%} to {o.lr * o.min_lr_ratio:g}"
                    + (", fitted to train.max_hours" if cfg.fits_to_time else "")}[o.schedule]
    if o.schedule == "cosine" and cfg.fits_to_time:
        sched += " over train.max_hours (progress is the share of the time spent)"
    lines.append(f"  optimizer  {describe_optimizer(run.optimizer)} · warmup {o.warmup_steps}, {sched}"
                 f" · weight decay {o.weight_decay:g} · clip {o.grad_clip:g}")
    if not skips_on_device(run.optimizer):
        lines.append("  optimizer  not fused (optim.fused=false): a bad step cannot be skipped on the device, so each "
                     "step reads its loss before the update (one host sync per step)")
    if t.max_hours > 0:
        lines.append(budget_line(run))
    lines += [f"  schedule   {note}" for note in run.notes.get("schedule", [])]
    if run.ramp is not None:
        lines.append(f"  batch ramp {t.batch_ramp_start} -> {run.accum} micro-batches per step over the first "
                     f"{human(t.batch_ramp_tokens)} tokens · {run.ramp.steps:,} steps for "
                     f"{human(t.max_tokens)} tokens")
    return lines


def unused_vocab_note(model_vocab: int, data_vocab: int, d_model: int, pad: int = 128) -> str:
    """A note when the model's vocabulary is larger than the data's by more than padding to a
    multiple of ``pad`` (GPT-2's 50,257 -> 50,304 is padding, not waste): the extra rows of the
    embedding and LM head are never a target, yet the head computes their logits every token,
    and the loss starts at ln(model vocab), above the data's uniform ln V."""
    padded = -(-data_vocab // pad) * pad
    if model_vocab <= padded:
        return ""
    return (f"NOTE: model.vocab_size {model_vocab:,} is larger than the data's vocabulary {data_vocab:,}: "
            f"{(model_vocab - data_vocab) * d_model:,} embedding and LM-head weights are never a target and the "
            f"head computes their logits every token; model.vocab_size={padded} fits the data (padded to a "
            f"multiple of {pad})")


def expected_rate(run: Run) -> tuple[float, str] | None:
    """The run's tokens/s before it measures its own, and where it comes from: the preflight's
    measured rate (``train.preflight``, at the same number of ranks), else the plan's at its
    nominal MFU of the GPU's peak; None where neither is known (a CPU has no peak)."""
    if run.preflight is not None:
        try:
            pred = json.loads(run.preflight).get("prediction") or {}
        except ValueError:
            pred = {}
        rate = pred.get("tok_per_s")
        if isinstance(rate, (int, float)) and rate > 0 and pred.get("world", 1) == run.world:
            return float(rate), "the preflight's measured rate"
    plan = run.plan
    if plan.get("effective_flops") and plan.get("flops_per_token"):
        return plan["effective_flops"] / plan["flops_per_token"], f"the plan's {100 * plan['mfu']:.0f}% MFU"
    return None


def expected_tokens(run: Run) -> float | None:
    """The tokens a run whose only limit is its time is expected to reach in what is left of it."""
    rate = expected_rate(run)
    if rate is None or not run.cfg.time_only:
        return None
    left = max(run.deadline.budget_s - run.deadline.spent_before, 0.0)
    return run.progress.tokens + rate[0] * left


def binding_limit(run: Run) -> str:
    """Which limit is expected to end the run, at :func:`expected_rate`: its time, or its steps."""
    cfg, d = run.cfg, run.deadline
    rate = expected_rate(run)
    if cfg.time_only:
        if rate is None:
            return ("the run's only limit: as many steps as fit, the schedule fitted to it; the progress lines say "
                    "the tokens it is expected to reach")
        return (f"the run's only limit: ≈{human(expected_tokens(run) or 0)} tokens expected at {human(rate[0])} "
                f"tok/s ({rate[1]}), the schedule fitted to it")
    if rate is None:
        return f"with {cfg.limit_key()}: the first reached ends the run"
    steps_s = (run.total_steps - run.progress.step) * cfg.tokens_per_step / rate[0]
    left = max(d.budget_s - d.spent_before, 0.0)
    first = (f"{cfg.limit_key()} ends the run first" if steps_s <= left
             else f"it ends the run first, at ≈{human(run.progress.tokens + rate[0] * left)} tokens")
    return (f"with {cfg.limit_key()}: at {human(rate[0])} tok/s ({rate[1]}) the "
            f"{run.total_steps:,} steps take ≈{fmt_time(steps_s + d.spent_before)}, so {first}")


def budget_line(run: Run) -> str:
    """``train.max_hours``: the run's time, across its starts (a resume says what is left of it),
    and which limit is expected to end the run."""
    d, hours = run.deadline, run.cfg.train.max_hours
    line = (f"  budget     train.max_hours={hours:g} ({fmt_time(d.budget_s)}) of training time, the run's across "
            "its starts")
    if run.start.checkpoint is not None and not d.carried:
        line += ": its checkpoint records no time spent (an older flopwise), so it counts from this start"
    elif run.start.checkpoint is not None:
        left = max(d.budget_s - d.spent_before, 0)
        line += f": {fmt_time(d.spent_before)} spent before this start, {fmt_time(left)} left"
    return f"{line}; {binding_limit(run)}"
