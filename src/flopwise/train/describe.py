"""The start-up summary: what the run is about to do, what was chosen, and why.

One line per subject (device and precision, parallelism, data, model, attention, init,
speed settings, FLOPs, batch, the plan's prediction, tracking, optimizer, time budget,
schedule, batch ramp), each a fact the user can check against their config; a pure function of the
:class:`~flopwise.train.setup.Run`, so it is tested without training.
"""

from __future__ import annotations

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
    if cfg.data.loader == "epoch":
        epochs = f" ({total * step_tokens / run.train_loader.target_tokens_per_epoch:.2f} epochs)"
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
    lines.append(f"  FLOPs      {human(fpt)}/token (6·N_matmul + attention at seq {t.seq_len})"
                 f" · {total:,} steps × {step_tokens:,} tokens = {human(total * step_tokens)} tokens planned"
                 f" · {human(fpt * total * step_tokens)}FLOP total")
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
                    + (", fitted to train.max_hours" if o.fit_to_time else "")}[o.schedule]
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


def budget_line(run: Run) -> str:
    """``train.max_hours``: the run's time, across its starts; a resume says what is left of it."""
    d, hours = run.deadline, run.cfg.train.max_hours
    line = (f"  budget     train.max_hours={hours:g} ({fmt_time(d.budget_s)}) of training time, the run's across "
            "its starts")
    if run.start.checkpoint is None:
        return line
    if not d.carried:
        return line + ": its checkpoint records no time spent (an older flopwise), so it counts from this start"
    left = max(d.budget_s - d.spent_before, 0)
    return line + f": {fmt_time(d.spent_before)} spent before this start, {fmt_time(left)} left"
