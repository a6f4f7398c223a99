"""What happens around the steps: measuring and logging, validation and multiple-choice
tasks, checkpoints (and the rollback's reload), and the end of the run (sample, run.json,
the closing lines). Each hook reads and updates the :class:`~flopwise.train.setup.Run`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flopwise.config import TIME_USED
from flopwise.data.datadir import DataDir
from flopwise.evaluate.generate import Sampling, generate
from flopwise.evaluate.loss import Shard, bits_per_byte, evaluate_loss, perplexity
from flopwise.evaluate.tasks import evaluate_tasks
from flopwise.fsio import AppendFile, json_text
from flopwise.manifest import seal_run_files
from flopwise.measure.meter import format_memory, memory_stats
from flopwise.measure.sinks import OUTER_SYNC, format_mfu, human
from flopwise.measure.timing import format_breakdown
from flopwise.parallel.strategy import is_fsdp_module
from flopwise.train.checkpoint import apply_retention, set_rng_state
from flopwise.train.dist_checkpoint import load_distributed, save_distributed
from flopwise.train.record import TrainResult, ended_start
from flopwise.train.schedule import extension_note
from flopwise.train.setup import Progress, Run
from flopwise.train.stopping import Deadline, by_signal
from flopwise.train.train_step import StepOutcome


def fmt_time(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# --------------------------------------------------------------------------- evaluation

def eval_shard(run: Run) -> Shard:
    """This rank's share of an evaluation, summed over the run's ranks."""
    return Shard(run.env.rank, run.world, lambda v: run.env.sum(v, run.device))


def validate(run: Run, step: int) -> float:
    """The held-out loss (shared out over ranks, summed), logged with perplexity and bits per byte;
    after step 0, the run's latest (its end figure). Its time is what a stop keeps room for."""
    t0 = run.clock()
    val = evaluate_loss(run.model, run.val_windows, run.cfg.train.micro_batch_size, run.device, run.autocast,
                        run.data.eos_id, run.data.bos_id, shard=eval_shard(run))
    run.deadline.stop_work.val_s = run.clock() - t0
    if step > 0:
        run.progress.val_end, run.progress.val_end_step = val, step
    run.log(f"  val  step {step:>6} | loss {val:.4f} | ppl {perplexity(val):,.1f} | bpb {bpb(run, val):.4f}"
            f" | uniform ln V = {run.uniform:.4f}")
    return val


def bpb(run: Run, val: float) -> float:
    return bits_per_byte(val, run.val_windows[:, 1:].numel(), run.val_bytes)


def val_metrics(run: Run, val: float) -> dict[str, float]:
    return {"val_loss": val, "val_ppl": perplexity(val), "val_bpb": bpb(run, val)}


def run_tasks(run: Run, step: int) -> dict[str, Any]:
    """``eval.tasks`` by log-probability, shared out over ranks."""
    e = run.cfg.eval
    results = evaluate_tasks(run.model, run.data.tokenizer, run.task_names, paths=run.task_paths,
                             limit=e.tasks_limit, device=run.device, batch_size=run.cfg.train.micro_batch_size,
                             autocast=run.autocast, shard=eval_shard(run))
    run.model.train()
    for name, r in results.items():
        run.log(f"  eval step {step:>6} | {name} acc {r['acc']:.4f} · acc_norm {r['acc_norm']:.4f}"
                f" (± {r['stderr']['acc']:.4f}, random {r['random']:.4f}, n {r['n']})")
    return results


def validate_at_start(run: Run) -> None:
    """Step 0's held-out loss, the reference every later one is compared with (a fresh run only).
    The run's end figure stays unmeasured until a validation after step 0.

    Until a validation or a sample is timed here (a resumed run), a stop's room for them is
    estimated from the step's time: a forward is about a third of a step's forward and backward
    per window, and a sample at most a window's forward per token (without the cache)."""
    p, work = run.progress, run.deadline.stop_work
    per_step = 3 * run.cfg.train.global_batch_size  # a step's compute, in window forwards
    work.val_steps = len(run.val_windows) / per_step
    work.sample_steps = run.cfg.eval.sample_tokens / per_step
    if p.step == 0:
        p.val_start = validate(run, 0)
        run.sink.write({"step": 0, "tokens": 0, "loss": None, "lr": None, "grad_norm": None, "tok_per_s": None,
                        "mfu": None, **val_metrics(run, p.val_start)})


# --------------------------------------------------------------------------- checkpoints

def save(run: Run) -> Path:
    """A checkpoint of the current step (every rank writes its part), then retention."""
    p, t = run.progress, run.cfg.train
    t0 = run.clock()
    state = {"tokens": p.tokens, "loader": run.train_loader.state_dict(), "val_loss_start": p.val_start,
             "val_windows": len(run.val_windows),
             "data_fingerprint": run.data.meta.get("fingerprint"), "guard": run.guard.state_dict(),
             "time_budget": run.deadline.state_dict()}  # train.max_hours is the run's: a resume continues it
    if run.cont is not None:
        state["lr_continuation"] = run.cont._asdict()
    if run.prec.scaler is not None:
        state["grad_scaler"] = run.prec.scaler.state_dict()
    path = save_distributed(run.run_dir, p.step, run.parts, state, run.config_yaml)
    run.env.on_main(lambda: apply_retention(run.run_dir, t.keep_checkpoints, t.milestone_every))
    run.deadline.record_save(run.clock() - t0)
    p.last_saved = path
    return path


def reload(run: Run, path: Path) -> dict[str, Any]:
    """A rollback: every rank reloads its part of ``path`` (weights, optimizer, RNG)."""
    saved = load_distributed(path, run.parts)
    if "rng" in saved:
        set_rng_state(saved["rng"], run.device)
    return saved


def save_on_stop(run: Run, stopped: str) -> None:
    p = run.progress
    if p.last_saved is None or p.last_saved.name != f"step-{p.step:07d}":
        save(run)
    config = run.run_dir / "config.yaml"
    if by_signal(stopped):
        run.log(f"  stop       {stopped}: checkpoint at step {p.step:,} saved; `flopwise train --config {config}` "
                "resumes it")
        return
    if run.cfg.time_only:  # its budget's end is the run's: the closing "finished:" line says how to extend it
        run.log(f"  end        {stopped}: checkpoint at step {p.step:,} saved")
        return
    # the time budget is the run's: resumed as it is, it has nothing left to train
    hours = run.cfg.train.max_hours
    run.log(f"  stop       {stopped}: checkpoint at step {p.step:,} saved; the run is finished (its "
            f"train.max_hours={hours:g} is spent): `flopwise train --config {config} train.max_hours={2 * hours:g}` "
            "extends it by as much again")


SIGNAL_STOP_S = 10.0  # what a signal's stop spends after its save: preemption notices are often 30 s


def on_stop(run: Run, stopped: str, last: StepOutcome | None) -> str:
    """A stop before the last step (a signal, the time budget): the steps since the last
    training row are logged (``last``: the latest good step read), the checkpoint saved, then
    the run validated and sampled where there is time -- the budget kept room for both; a
    signal's stop does what takes at most :data:`SIGNAL_STOP_S` -- else the log says the end
    was not measured (and run.json holds null). Returns the sample ("" when none)."""
    p = run.progress
    at = due(run, p.step)
    if last is not None and p.steps_in_window > 0:
        log_step(run, last, last.lr, replace(at, last=False, val=False))  # validated below, where there is time
    save_on_stop(run, stopped)
    if p.step == 0:  # nothing trained: step 0's validation is the end's, and a sample would be noise
        return ""
    do_val, do_sample, why, sample_why = _stop_work(run, by_signal(stopped))
    if p.val_end_step == p.step and math.isfinite(p.val_end):
        do_val = False  # validated at this very step already (eval.every)
    elif not do_val:
        run.log(f"  val  step {p.step:>6} | not measured: {why}; `flopwise eval {run.run_dir}` measures the "
                "checkpoint")
    if do_val:
        val = validate(run, p.step)
        run.sink.write({"step": p.step, "tokens": p.tokens, **val_metrics(run, val)})
    if run.cfg.eval.sample_tokens > 0 and not do_sample and not at.sample:
        run.log(f"  sample     not written: {sample_why}; `flopwise generate {run.run_dir}` samples the checkpoint")
    return take_sample(run, p.step) if do_sample and not at.sample else ""


def _stop_work(run: Run, signal_: bool) -> tuple[bool, bool, str, str]:
    """Whether the stop validates and samples -- the same answer on every rank (each takes part
    in both) -- and why it does not validate, and why it writes no sample."""
    d, e = run.deadline, run.cfg.eval
    val_s = Deadline.MARGIN * d.stop_work.validation(d.step_s)
    sample_s = Deadline.MARGIN * d.stop_work.sample(d.step_s)
    if signal_:
        room, what = SIGNAL_STOP_S, f"a signal's stop spends at most {SIGNAL_STOP_S:g} s on it"
    elif d.end is not None:
        room = d.end - d.clock()
        what = f"the {fmt_time(max(room, 0.0))} left of train.max_hours"
    else:
        room, what = math.inf, ""
    do_val = val_s <= room
    do_sample = e.sample_tokens > 0 and (val_s if do_val else 0.0) + sample_s <= room
    votes = run.env.sum([float(do_val), float(do_sample)], run.device)
    why = f"a validation takes ~{fmt_time(val_s)} here, more than {what}" if not do_val else \
        "another rank had no time for it"
    sample_why = (f"{e.sample_tokens} tokens take ~{fmt_time(sample_s)} here, more than {what}" if not do_sample
                  else "another rank had no time for it")
    return votes[0] == run.world, votes[1] == run.world, why, sample_why


# --------------------------------------------------------------------------- after each step

def count_step(run: Run, step_tokens: int, step_s: float) -> None:
    """Count the step just issued, before its values are read: the step, its tokens (taken
    back if it turns out bad), the throughput clock."""
    p, t = run.progress, run.cfg.train
    p.step += 1
    p.tokens += step_tokens
    run.meter.step(step_tokens)
    run.timer.end_step(step_s)
    run.deadline.record_step(step_s)
    if p.step - p.first_step == t.warmup_log_steps:
        run.recompiles.arm()  # compiling is warm-up; from here on a compile is a recompile


@dataclass(frozen=True)
class Due:
    """What is due after step ``step`` (1-based), decided once when the step is counted; the loop
    and every hook after it read this one record."""

    step: int
    last: bool  # the run's last step
    val: bool  # a validation: eval.every, or the last step
    log: bool  # a training row: train.log_every, a validation, the last step
    tasks: bool  # eval.tasks: eval.tasks_every, or the last step (on a step that logs)
    save: bool  # a checkpoint: train.checkpoint_every, or the last step
    sample: bool  # a sample during training: eval.sample_every (the last step's is the end's: finish)
    layer_stats: bool  # per-layer statistics were taken (tracking.grad_norms_every)

    @property
    def read_now(self) -> bool:
        """Whether the step is read at once, before the next step; any other is read one step late."""
        return self.log or self.save or self.layer_stats or self.sample


def due(run: Run, step: int) -> Due:
    """What is due after step ``step`` (1-based)."""
    t, e, tr = run.cfg.train, run.cfg.eval, run.cfg.tracking
    last = step == run.total_steps
    val = last or (e.every > 0 and step % e.every == 0)
    return Due(step=step, last=last, val=val, log=val or step % t.log_every == 0,
               tasks=bool(run.task_names) and (last or (e.tasks_every > 0 and step % e.tasks_every == 0)),
               save=last or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0),
               sample=e.sample_every > 0 and e.sample_tokens > 0 and step % e.sample_every == 0 and not last,
               layer_stats=tr.grad_norms_every > 0 and step % tr.grad_norms_every == 0)


def record_good(run: Run, out: StepOutcome, due_: Due) -> None:
    """A good step's loss, as read: into the log window; a spike logged (``due_``: the step's)."""
    p = run.progress
    ratio = run.guard.spike(out.loss)
    if ratio is not None:
        run.log(f"  event step {out.step + 1}: loss spike {out.loss:.4f} = {ratio:.1f}x the running mean")
        run.sink.write({"step": out.step + 1, "event": "loss_spike", "loss": out.loss, "ratio": ratio})
    p.loss_sum += out.loss
    p.steps_in_window += 1
    if out.layer_stats is not None and not due_.log:
        run.sink.write({"step": out.step + 1, **out.layer_stats})


def after_step(run: Run, out: StepOutcome, due_: Due, good: bool = True) -> None:
    """Log, validate, run tasks and save when they are due (``due_``) after step ``out`` (read
    now). A skipped step (not ``good``) still ends where it was due -- validated, saved -- with
    no training row of its own (its loss is in the event the guard wrote)."""
    p = run.progress
    if good and due_.log:
        log_step(run, out, out.lr, due_)
    elif due_.val:
        p.val_end = validate(run, p.step)
        run.sink.write({"step": p.step, "tokens": p.tokens, **val_metrics(run, p.val_end)})
    if due_.save:
        save(run)
    if due_.sample:
        text = " ⏎ ".join(take_sample(run, p.step).splitlines())
        run.log(f"  sample step {p.step:>6} | {text[:160]}")
    if due_.val or due_.save or due_.sample:
        run.meter.pause()  # evaluation, saving and sampling are not training throughput


def log_step(run: Run, out: StepOutcome, lr: float, due_: Due) -> None:
    """The metrics row and the log line of the window since the last one (a log step: the step's
    values were read at once, and on CUDA the window's timing events are waited for)."""
    p, world = run.progress, run.world
    p.last_loss = p.loss_sum / p.steps_in_window
    t_log = run.clock()
    rates = run.meter.window()
    mem = memory_stats(run.device)
    parts = run.timer.window()
    row: dict[str, Any] = {"step": p.step, "tokens": p.tokens, "loss": p.last_loss, "lr": lr,
                           "grad_norm": out.grad_norm, **rates, **mem, **parts,
                           "elapsed_s": run.clock() - run.t_start}
    if world > 1:
        row.update(world_size=world, tok_per_s_per_gpu=rates["tok_per_s"] / world)
    # training time left: at the run's steady pace so far (the window's own until there is one), or,
    # for a run whose only limit is its time, what is left of it
    pace = run.meter.pace() or rates["step_time_s"]
    row["eta_s"] = (run.fit.seconds_left() if run.cfg.time_only and run.fit is not None
                    else (run.total_steps - p.step) * pace)
    f = run.flops
    mfu = rates["mfu"]
    if mfu is not None:  # the other conventions, for comparison (docs/planning.md#conventions)
        row["mfu_6n"] = mfu * f.per_token_6n / f.per_token
        if f.hardware != f.per_token:
            row["hfu"] = mfu * f.hardware / f.per_token
    warning = run.recompiles.check()
    if warning:
        run.log(f"  {warning}")
        run.sink.write({"step": p.step, "event": "recompile", "message": warning})
    if run.guard.skipped or run.guard.rollbacks:
        row.update(skipped_steps=run.guard.skipped, rollbacks=run.guard.rollbacks)
    outer = run.outer.window(run.env, p.tokens) if run.outer is not None else None
    if outer is not None:
        for sync in outer.pop("outer_rounds"):  # a row for each outer step since the last log row
            run.sink.write({"step": sync["step"], "event": OUTER_SYNC, **sync})
        row.update(outer)
    per_gpu = f" ({human(rates['tok_per_s'] / world)}/GPU)" if world > 1 else ""
    of = f"/{run.total_steps}" if run.total_steps else ""  # a run whose only limit is its time has no last step
    run.log(f"step {p.step:>6}{of} | tok {human(p.tokens):>7} | loss {p.last_loss:.4f} | lr {lr:.2e}"
            f" | gnorm {out.grad_norm:.3f} | {human(rates['tok_per_s'])} tok/s{per_gpu}"
            f" | mfu {format_mfu(rates['mfu'])}"
            f" | {format_memory(mem)} | {1000 * rates['step_time_s']:.0f} ms/step"
            f" | {format_breakdown(parts, rates['step_time_s'])}{outer_text(outer)}"
            f" | ETA {eta_text(row, run.deadline, run.cfg.tokens_per_step / pace if run.cfg.time_only else None)}")
    if due_.val:
        p.val_end = validate(run, p.step)
        row.update(val_metrics(run, p.val_end))
    if due_.tasks:
        row["eval"] = run_tasks(run, p.step)
    if out.layer_stats is not None:
        row.update(out.layer_stats)
    run.sink.write(row)
    p.loss_sum, p.steps_in_window = 0.0, 0
    run.timer.host["log"] += run.clock() - t_log


def outer_syncs(metrics: Path) -> list[dict[str, Any]]:
    """The run's DiLoCo outer steps as metrics.jsonl recorded them: outer step, inner step,
    outer learning rate, pseudo-gradient norm and drift (a resume truncates the file at its
    checkpoint, so each outer step is there once)."""
    out = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        row = json.loads(line)
        if row.get("event") == OUTER_SYNC:
            out.append({k: v for k, v in row.items() if k != "event"})
    return out


def outer_text(outer: dict[str, Any] | None) -> str:
    """DiLoCo's part of the log line: outer steps, their traffic and time, the groups' drift."""
    if outer is None:
        return ""
    text = f" | outer {outer['outer_steps']} · lr {outer['outer_lr']:g} · {outer['outer_bytes'] / 2**20:.1f} MiB each"
    if "drift" in outer:
        text += f" · pgnorm {outer['pseudo_grad_norm']:.3g} · drift {outer['drift']:.3g}"
    return text


def eta_text(row: dict[str, Any], deadline: Deadline, time_only_rate: float | None = None) -> str:
    """Time left at the current pace, and against ``train.max_hours`` when there is a budget; for a
    run whose only limit is its time (``time_only_rate``: its tokens/s at the steady pace), the time
    left of it and the tokens the run is expected to reach by its end at that pace."""
    text = f"{fmt_time(row['eta_s'])} ({fmt_time(row['elapsed_s'])} elapsed)"
    if time_only_rate is not None:
        reach = row["tokens"] + row["eta_s"] * time_only_rate
        return f"{text} of training left in train.max_hours · ≈{human(reach)} tokens by its end at this pace"
    if deadline.end is not None:
        left = deadline.end - deadline.clock()
        verdict = "fits" if row["eta_s"] <= left else "stops early"
        text += f" · {verdict} in the {fmt_time(max(left, 0))} left of train.max_hours"
    return text


# --------------------------------------------------------------------------- the end

def finish(run: Run, stopped: str, train_time: float, sample: str = "") -> TrainResult:
    """The end's sample (a stop's was taken by :func:`on_stop`: ``sample``), run.json's result
    and the closing lines."""
    p, e, log = run.progress, run.cfg.eval, run.log
    run.recompiles.close()
    if e.sample_tokens > 0 and not stopped and p.step == run.total_steps and p.step > p.first_step:
        sample = take_sample(run, p.step)
    run.sink.close()
    avg = run.meter.summary()
    wall = run.clock() - run.t_start
    measured = math.isfinite(p.val_end)
    result = TrainResult(run.run_dir, p.step, p.tokens, p.last_loss, p.val_start, p.val_end, run.uniform,
                         avg["tok_per_s"], avg["mfu"], wall, p.last_saved, sample, stopped or None,
                         p.val_end_step if measured else None)
    # A figure not measured is null (not NaN, which is not JSON, nor the start's loss again).
    summary = {k: (str(v) if isinstance(v, Path) else None if isinstance(v, float) and not math.isfinite(v) else v)
               for k, v in asdict(result).items()}
    if run.env.is_main:
        record = {**run.record, "result": summary, "train_time_s": train_time}
        if run.outer is not None:  # DiLoCo: every outer step of the run, this start's and the earlier ones'
            record["outer_syncs"] = outer_syncs(run.run_dir / "metrics.jsonl")
        if "starts" in record:  # this start's own figures beside the earlier ones' (the result is its alone)
            record["starts"] = ended_start(record["starts"], p.step, avg, wall)
        seal_run_files(run.run_dir, {"run.json": json_text(record)})
    avg_tps = "n/a" if avg["tok_per_s"] is None else f"{human(avg['tok_per_s'])} tok/s"
    ended = not stopped or (run.cfg.time_only and stopped == TIME_USED)  # a time-only run's end is its budget's
    log(f"{'done' if ended else 'stopped'}: {p.step:,} steps · {human(p.tokens)} tokens · train "
        f"{fmt_time(train_time)} · wall {fmt_time(wall)} · {avg_tps} (after warm-up) · mfu {format_mfu(avg['mfu'])}")
    log(f"  {losses_text(p)} (uniform ln V = {run.uniform:.4f}) · {train_loss_text(p)}")
    log(f"  checkpoint {p.last_saved}")
    if ended and (p.step == run.total_steps or run.cfg.time_only):
        log(f"  finished: {extend_text(run)}")
    if sample:
        log(f"  sample ({run.run_dir / 'samples.txt'}):")
        for line in sample.splitlines()[:12]:
            log(f"    {line}")
    return result


def extend_text(run: Run) -> str:
    """How to train a finished run longer: the limit that ended it (``RunConfig.limit_key``), raised."""
    t, config = run.cfg.train, run.run_dir / "config.yaml"
    if run.cfg.time_only:
        return (f"train.max_hours={t.max_hours:g} ({fmt_time(run.deadline.budget_s)}), the run's only limit, is used: "
                f"{run.progress.step:,} steps trained in it; `flopwise train --config {config} "
                f"train.max_hours={2 * t.max_hours:g}` trains it longer ({extension_note(run.cfg, {}, 0, 0)})")
    limit = run.cfg.limit_key()
    if limit == "train.max_tokens":
        raise_to = f"train.max_tokens={2 * t.max_tokens}"
    else:
        raise_to = f"train.max_steps={2 * max(t.max_steps, run.total_steps)}"
    return (f"all {run.total_steps:,} steps of {limit or 'its length'} are trained; "
            f"`flopwise train --config {config} {raise_to}` trains it longer (the rate goes on from where it ended)")


def losses_text(p: Progress) -> str:
    """The validation losses of the closing line: at the start and at the end, each a figure
    measured or "not measured" (never the start's loss again as the end's); the end's step
    when it is not the last."""
    def loss(v: float) -> str:
        return f"{v:.4f}" if math.isfinite(v) else "not measured"

    if p.step == 0:  # nothing trained: the start is the end
        return f"val loss {loss(p.val_start)}"
    if not math.isfinite(p.val_end):
        return f"val loss {loss(p.val_start)} -> not measured at step {p.step:,}"
    at = f" (at step {p.val_end_step:,})" if p.val_end_step != p.step else ""
    return f"val loss {loss(p.val_start)} -> {p.val_end:.4f}{at}"


def train_loss_text(p: Progress) -> str:
    """The last logged training loss; a run stopped before its first logged step measured none
    (a NaN here would read as a diverged run)."""
    if math.isfinite(p.last_loss):
        return f"final train loss {p.last_loss:.4f}"
    return "no train step logged" + (f" since step {p.first_step:,}" if p.first_step else "")


SAMPLE_PROMPT_TOKENS = 12  # the default prompt: this many tokens from the start of a validation document


def validation_prompt(data: DataDir, n_tokens: int = SAMPLE_PROMPT_TOKENS) -> list[int]:
    """The first ``n_tokens`` tokens of the first validation document (one that starts after an
    EOS and is at least twice as long as the prompt, so the model has something to continue):
    a prompt in the corpus's own language, the same every time. Falls back to the split's
    first tokens when no such document is among its first tokens."""
    eos = data.eos_id
    head = data.shards("val")[0][: 1 << 20]  # documents start soon: no need to read a whole shard
    ends = [-1, *(int(i) for i in (head == eos).nonzero()[0]), len(head)]
    for a, b in zip(ends[1:], ends[2:]):  # a document: after the EOS at a, up to the next one at b
        if b - a - 1 >= 2 * n_tokens:
            return [int(x) for x in head[a + 1 : a + 1 + n_tokens]]
    ids = [int(x) for x in head[:n_tokens] if int(x) != eos]
    return ids or [eos]


def take_sample(run: Run, step: int) -> str:
    """The run's sample at ``step`` into samples.txt (every rank generates: FSDP2); timed, as
    what a stop keeps room for."""
    t0 = run.clock()
    text = write_sample(run.model, run.data, run.cfg, run.device, run.run_dir if run.env.is_main else None, step)
    run.deadline.stop_work.sample_s = run.clock() - t0
    return text


def write_sample(model: torch.nn.Module, data: DataDir, cfg, device: torch.device, run_dir: Path | None,
                 step: int | None = None) -> str:
    """Sample ``eval.sample_tokens`` tokens after ``eval.sample_prompt`` -- when that is empty
    (the default), after the start of a validation document (:func:`validation_prompt`); save
    to samples.txt with the ``step`` the weights are of (``run_dir`` None: on ranks other than
    0, which generate in step with it, write nothing)."""
    e = cfg.eval
    tok = data.tokenizer
    if e.sample_prompt:
        ids, shown, source = tok.encode(e.sample_prompt).ids or [data.eos_id], e.sample_prompt, "eval.sample_prompt"
    else:
        ids, source = validation_prompt(data), "the start of a validation document"
        shown = tok.decode(ids)
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    # An FSDP2-sharded model computes in its MixedPrecisionPolicy's dtype, which a KV cache
    # sized from the (sharded, fp32) weights would not match: it recomputes the window instead.
    out = generate(model, torch.tensor([ids], device=device), e.sample_tokens, cfg.train.seq_len,
                   Sampling(temperature=e.temperature, top_k=e.top_k, generator=gen), eos_id=data.eos_id,
                   use_cache=not is_fsdp_module(model))
    text = tok.decode(out[0].tolist())
    if run_dir is None:
        return text
    f = AppendFile(run_dir / "samples.txt", "the sample")  # whole or not at all: a full disk leaves no torn entry
    try:
        at = f" · step {step}" if step is not None else ""
        f.write(f"--- prompt {shown!r} ({source}){at} · temperature {e.temperature:g} · top-k {e.top_k}\n{text}\n")
    finally:
        f.close()
    return text
