"""The training loop: one device (CPU or one CUDA GPU), or one rank of a data-parallel run.

Order of work, cheapest checks first so bad input fails before anything is allocated:
config (already validated) -> run directory (new, or resumed from its latest complete
checkpoint: see ``resume.py``) -> data directory -> model -> optimizer -> loop. The loop
logs every ``train.log_every`` steps, validates every ``eval.every`` steps on a fixed
held-out subset, checkpoints every ``train.checkpoint_every`` steps and at the end
(keeping ``train.keep_checkpoints``), stops early and cleanly on a signal, on
``train.max_hours`` or on a non-finite step (``stopping.py``), then writes a text sample
(prompted by the start of a validation document unless ``eval.sample_prompt`` is set).

A run directory whose checkpoint already holds the steps asked for is left untouched
(:func:`finished_run`); one resumed with a different length keeps its learning rate where
it was rather than recomputing the schedule for the new length (:func:`resumed_schedule`).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

from flopwise import __version__
from flopwise.config import ConfigError, RunConfig, batch_split_problems, load_run_config
from flopwise.data.datadir import DataDir, open_data_dir
from flopwise.data.loader import fixed_windows, make_loader
from flopwise.deps import missing_for_run, require
from flopwise.evaluate.generate import generate
from flopwise.evaluate.loss import bits_per_byte, evaluate_loss, perplexity, target_bytes
from flopwise.fsio import atomic_write
from flopwise.measure.meter import ThroughputMeter, format_memory, memory_stats
from flopwise.measure.sinks import format_mfu, human
from flopwise.measure.tracking import NullTracker, Tracker
from flopwise.model import build_model, configure_attention
from flopwise.plan import hardware
from flopwise.plan.budget import plan_for_run
from flopwise.plan.flops import flops_per_token, flops_per_token_6n, hardware_flops_per_token, param_counts
from flopwise.train.checkpoint import apply_retention, set_rng_state
from flopwise.train.optim import CombinedOptimizer, build_optimizer, describe_optimizer, lr_at, set_lr, set_lr_factor
from flopwise.train.schedule import Continuation, continue_schedule, lr_factor, ramp_plan, time_progress
from flopwise.train.resume import start_run, truncate_metrics
from flopwise.train.precision import MasterWeights, apply_fp8
from flopwise.train.precision import resolve as resolve_precision_full
from flopwise.train.step import forward_backward, make_loss_fn
from flopwise.train.timing import StepTimer, format_breakdown, nvtx, profiler
from flopwise.train.wrap import RecompileWatch, checkpointed_blocks, wrap_for_training
from flopwise.train.dist_checkpoint import load_distributed, save_distributed
from flopwise.train.distributed import DistEnv, init_distributed, resolve_device
from flopwise.train.parallel import clip_grad_norm, grad_sync, resolve_strategy, zero1_optimizer
from flopwise.train.stopping import Deadline, NonFiniteError, NonFiniteGuard, SignalStop  # noqa: F401

Log = Callable[[str], None]


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    final_loss: float
    val_loss_start: float
    val_loss_end: float
    uniform_loss: float
    tok_per_s: float | None
    mfu: float | None
    wall_time_s: float
    checkpoint: Path | None
    sample: str
    stopped: str | None = None  # why the run stopped before its last step (signal, max_hours)


# --------------------------------------------------------------------------- setup

def resolve_precision(precision: str, device: torch.device) -> tuple[str, torch.dtype | None]:
    """(name, autocast dtype or None). ``auto``: bf16 autocast on CUDA with bf16 support.

    On a CPU without bf16 matrix units, bf16 matmuls are tens of times slower than
    float32, so ``auto`` keeps float32 there; ``bf16`` can still be asked for.
    """
    p = resolve_precision_full(precision, device)
    return p.name, p.autocast_dtype


def autocast_factory(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def tf32_matmuls_allowed() -> bool:
    """Whether float32 CUDA matmuls run on TF32 tensor cores (newer torch: ``fp32_precision``)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if isinstance(precision, str) and precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(getattr(matmul, "allow_tf32", False))


def device_peak(device: torch.device, precision: str, user_tflops: float) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device and a note on where it came from."""
    if user_tflops > 0:
        return user_tflops * 1e12, f"{user_tflops:g} TFLOP/s (train.peak_tflops)"
    if device.type != "cuda":
        return None, "no peak for CPUs (set train.peak_tflops for MFU)"
    name = torch.cuda.get_device_name(device)
    key = {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16"}.get(
        precision, "tf32" if tf32_matmuls_allowed() else "fp32")
    peak = hardware.peak_tflops(name, key)
    if peak is None:
        return None, f"{name!r} not in the hardware table (set train.peak_tflops for MFU)"
    return peak * 1e12, f"{peak:g} TFLOP/s dense {key} ({hardware.lookup(name).name})"


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def open_data(cfg: RunConfig, log: Log) -> DataDir:
    """The prepared data directory: ``data.path``, or the embedded corpus prepared once."""
    dd = open_data_dir(cfg.data, log=log)
    if dd.vocab_size > cfg.model.vocab_size:
        raise ConfigError([
            f"data at {dd.path} has vocabulary {dd.vocab_size} but model.vocab_size is "
            f"{cfg.model.vocab_size}: token ids would overflow the embedding"
        ])
    dd.num_tokens("val")  # a missing validation split is an error here, naming the splits there are
    return dd


def run_record(cfg: RunConfig, device: torch.device, precision: str) -> dict[str, Any]:
    """What produced this run: versions, device, command line."""
    import numpy
    import tokenizers

    return {
        "flopwise": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "tokenizers": tokenizers.__version__,
        "platform": platform.platform(),
        "device": device_label(device),
        "precision": precision,
        "argv": sys.argv,
        "code": code_version(),
        "started": datetime.now().isoformat(timespec="seconds"),
    }


def code_version() -> dict[str, Any]:
    """The git commit of flopwise's own source and whether it had uncommitted changes
    (None outside a git checkout, e.g. an installed wheel)."""
    import subprocess

    src = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty}


def load_hf_init(model: torch.nn.Module, hf_path: str) -> str:
    """Weights of a Hugging Face model directory (``model.hf_config``) for continued
    pretraining; the architecture came from its ``config.json`` when the config was built."""
    from flopwise.model.io import load_hf_weights

    path = Path(hf_path).expanduser()
    directory = path.parent if path.is_file() else path
    if not any((directory / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return f"architecture from {path}; no safetensors beside it: random initialisation"
    load_hf_weights(model, directory)
    return f"weights from {directory} (Hugging Face safetensors)"


def _fmt_time(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# --------------------------------------------------------------------------- the loop

def train(cfg: RunConfig, log: Log = print, fresh: bool = False) -> TrainResult:
    """Train ``cfg`` in ``train.run_dir``: a new run, or the resumption of the run there.

    Under ``torchrun`` every rank calls this; they train in lockstep and rank 0 alone logs
    and writes the run's files (``train/distributed.py``, ``train/parallel.py``)."""
    require(missing_for_run(cfg))  # optional packages the config asks for: refused before any work
    t_start = time.perf_counter()
    env, device = init_distributed(cfg.parallel.strategy, cfg.train.device, cfg.parallel.backend,
                                   cfg.parallel.timeout_min)
    try:
        with contextlib.ExitStack() as locks:  # rank 0 holds the run directory's lock until the run ends
            result = _train(cfg, log if env.is_main else _quiet, fresh, env, device, t_start, locks)
        env.barrier()  # ranks leave together: tearing the group down under a rank still using it aborts
        return result
    finally:
        env.close()


def _quiet(_: str) -> None:
    """The log of ranks other than 0."""


def _train(cfg: RunConfig, log: Log, fresh: bool, env: DistEnv, device: torch.device, t_start: float,
           locks: contextlib.ExitStack) -> TrainResult:
    prec = resolve_precision_full(cfg.train.precision, device)
    precision, amp_dtype = prec.name, prec.autocast_dtype
    autocast = autocast_factory(device, amp_dtype)
    world = env.world_size
    m, t, o, e, tr = cfg.model, cfg.train, cfg.optim, cfg.eval, cfg.tracking
    split = batch_split_problems(t, world)  # the config checked one rank; this is the launch's count
    if split:
        raise ConfigError(split)
    loss_impl = resolve_loss_impl(t.loss, m, t, device)
    strategy = resolve_strategy(cfg, env, device, precision, loss_impl)  # refusals before any work
    start = env.on_main(lambda: start_run(cfg, fresh, locks))
    cfg.train.run_dir = str(start.run_dir)  # rank 0 named it (a timestamp): every rank uses that name
    run_dir = start.run_dir
    data = env.main_first(lambda: open_data(cfg, log))  # the embedded corpus is prepared once, by rank 0

    total_steps = cfg.total_steps()
    accum = cfg.grad_accum_steps(world)  # micro-batches per step on each rank
    step_tokens = cfg.tokens_per_step  # over all ranks
    micro_tokens = t.micro_batch_size * t.seq_len * world  # one micro-batch on every rank
    ramp = None
    if t.batch_ramp_tokens:  # steps grow from batch_ramp_start micro-batches to the full batch
        ramp = ramp_plan(t.max_tokens, micro_tokens, accum, t.batch_ramp_tokens, t.batch_ramp_start)
        total_steps = ramp.steps if not t.max_steps else min(ramp.steps, t.max_steps)
    counts = param_counts(m)
    fpt = flops_per_token(m, t.seq_len)
    fpt_6n = flops_per_token_6n(m)
    # Hardware FLOPs: recomputed forwards of checkpointed blocks on top (HFU's numerator).
    recomputed = len(checkpointed_blocks(m.n_layers, t.activation_checkpointing, t.checkpoint_every_k)) / m.n_layers
    hfpt = fpt + round(recomputed * (hardware_flops_per_token(m, t.seq_len, True) - fpt))
    peak, peak_note = device_peak(device, precision, t.peak_tflops)
    uniform = math.log(data.vocab_size)
    data_fingerprint = data.meta.get("fingerprint")
    done = int(start.checkpoint.name[5:]) if start.checkpoint is not None else 0
    if start.checkpoint is not None and done >= total_steps:  # nothing to train: touch nothing
        return finished_run(run_dir, start.checkpoint, done, total_steps, uniform, t_start, log)

    task_names = [x.strip() for x in e.tasks.split(",") if x.strip()]
    task_paths = task_files(e.task_dir, task_names)  # a missing task file is named before any work
    # The data checks (each split long enough for a window) come before any allocation.
    train_loader = make_loader(cfg.data.loader, data, "train", t.seq_len, t.micro_batch_size, seed=t.seed,
                               device=device, doc_boundaries=m.doc_mask, rank=env.rank, world_size=world,
                               step_samples=None if ramp else t.global_batch_size)  # epochs end on a step
    # The held-out set does not depend on the number of ranks (they share it out), so runs on
    # 1 and 8 GPUs report comparable validation losses; a resumed run keeps its first one.
    val_windows = fixed_windows(data, "val", t.seq_len, e.batches * t.micro_batch_size)
    torch.manual_seed(t.seed)
    model = build_model(m, device=device, seed=t.seed)
    if m.hf_config and start.checkpoint is None:
        init_note = load_hf_init(model, m.hf_config)
    speed_notes = [apply_fp8(model, device)] if t.fp8 else []
    master = MasterWeights(model) if precision == "bf16-pure" else None
    state_model = master.master if master else model  # what the optimizer steps and checkpoints hold (fp32)
    attention_notes = configure_attention(model, device, amp_dtype or model.tok_emb.weight.dtype)
    # FSDP2 shards `model` in place: the optimizer is built after, on the shards
    train_model, wrap_notes, parallel_notes = wrap_for_training(model, cfg, strategy.name, env, device, amp_dtype)
    speed_notes += wrap_notes
    loss_fn = make_loss_fn(train_model, loss_impl, t.loss_chunk_tokens,
                           compile_mode=t.compile_mode if t.compile == "model" else None)
    speed_notes.append(f"loss {loss_impl}" + (f" ({t.loss_chunk_tokens} tokens per chunk: no full logits)"
                                              if loss_impl == "chunked" else ""))
    optimizer = build_optimizer(state_model, o, device)
    if strategy.name == "zero1":
        optimizer = zero1_optimizer(optimizer)
    guard = NonFiniteGuard.from_config(t, uniform_loss=math.log(m.vocab_size))  # the logits' uniform loss

    step, tokens, val_start = 0, 0, float("nan")
    cont: Continuation | None = None  # the rate of a run whose length changed on resume
    schedule_note = ""
    if start.checkpoint is not None:
        saved = load_distributed(start.checkpoint, env, strategy.name, state_model, optimizer, device)
        if master:
            master.master_to_model()
        if prec.scaler is not None and "grad_scaler" in saved:
            prec.scaler.load_state_dict(saved["grad_scaler"])
        if saved.get("data_fingerprint") != data_fingerprint:
            raise ConfigError([f"train.run_dir {str(run_dir)!r}: the data changed since the checkpoint "
                               f"(fingerprint {str(saved.get('data_fingerprint'))[:12]} -> {str(data_fingerprint)[:12]}); "
                               "pass --fresh to start over"])
        try:
            train_loader.load_state_dict(saved["loader"])
        except ValueError as err:  # e.g. the random loader's per-rank streams at another world size
            raise ConfigError([f"train.run_dir {str(run_dir)!r}: cannot continue the data position of "
                               f"{start.checkpoint.name} with {world} rank(s): {err}"]) from None
        step, tokens, val_start = saved["step"], saved["tokens"], saved.get("val_loss_start", float("nan"))
        if saved.get("val_windows", len(val_windows)) != len(val_windows):  # resumed at another geometry:
            val_windows = fixed_windows(data, "val", t.seq_len, saved["val_windows"])  # the same held-out set
        guard.load_state_dict(saved.get("guard", {}))
        if "rng" in saved:
            set_rng_state(saved["rng"], device)
        cont, schedule_note = resumed_schedule(start.checkpoint, saved, step, total_steps, cfg, ramp is not None)
    config_yaml = cfg.to_yaml()
    record = run_record(cfg, device, precision)
    record["parallel"] = {"strategy": strategy.name, "world_size": world, "backend": env.backend,
                          "launched": env.launched, "why": strategy.why}
    plan = plan_for_run(cfg, torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                        precision, t.peak_tflops, loss=loss_impl, gpus=world, strategy=strategy.name)

    def write_run_files() -> None:  # rank 0: the run's non-sharded files
        if start.resumed_run:
            truncate_metrics(run_dir / "metrics.jsonl", step)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.yaml", config_yaml)  # a kill mid-write leaves the old copy, never half
        previous = _read_json(run_dir / "run.json") if start.resumed_run else {}
        record["starts"] = previous.get("starts", []) + [{"at_step": step, "started": record["started"],
                                                          "world_size": world}]
        atomic_write(run_dir / "plan.json", json.dumps(plan, indent=2))
        atomic_write(run_dir / "run.json", json.dumps(record, indent=2))
        shutil.copyfile(data.path / "tokenizer.json", run_dir / "tokenizer.json")  # the run is self-contained
        if t.preflight and Path(t.preflight).is_file():  # plan vs preflight vs actual, in the report
            shutil.copyfile(t.preflight, run_dir / "preflight.json")

    env.on_main(write_run_files)
    sink, sink_error = NullTracker(), None
    if env.is_main:
        try:
            sink = Tracker(run_dir, cfg.tracking, cfg.to_dict(), run_dir.name)
        except Exception as err:  # noqa: BLE001 - e.g. W&B asked for and missing: every rank stops with it
            sink_error = err
    sink_error = env.broadcast(sink_error)
    if sink_error is not None:
        raise sink_error
    val_bytes = target_bytes(val_windows, data.tokenizer)  # for bits per byte, comparable across tokenizers

    log(f"flopwise train · preset {cfg.preset} · run dir {run_dir}")
    if start.resumed_run or start.note.startswith("--fresh"):
        log(f"  resume     {start.note}" + (f" (step {step:,} of {total_steps:,}, {human(tokens)} tokens)"
                                           if start.checkpoint else ""))
    log(f"  device     {device_label(device)} · precision {precision} · peak {peak_note}")
    if strategy.name != "single" or world > 1:
        log(f"  parallel   {strategy.name} · {world} rank(s), {env.launched} · {env.backend} · {strategy.why}")
        for note in parallel_notes:
            log(f"  {'':<10} {note}")
    epochs = ""
    if cfg.data.loader == "epoch":
        epochs = f" ({total_steps * step_tokens / train_loader.target_tokens_per_epoch:.2f} epochs)"
    log(f"  data       {data.path} · vocab {data.vocab_size:,} · train {human(data.num_tokens('train'))} tokens"
        f" · val {human(data.num_tokens('val'))} tokens · loader {cfg.data.loader}{epochs}")
    experts = f" · {m.n_experts} experts top-{m.moe_top_k} ({human(counts['active'])} active)" if m.is_moe else ""
    log(f"  model      {m.arch} · {m.n_layers} layers · d_model {m.d_model} · heads {m.n_heads} q / {m.n_kv_heads} kv"
        f" · {m.mlp} {m.expert_ffn_hidden if m.is_moe else m.ffn_hidden} · {m.norm} · {m.pos_emb}{experts}"
        f" · params {human(counts['total'])} ({human(counts['non_embedding'])} non-embedding)")
    for i, note in enumerate(attention_notes):
        log(f"  {'attention' if i == 0 else '':<10} {note.removeprefix('attention: ')}")
    if m.hf_config and start.checkpoint is None:
        log(f"  init       {init_note}")
    for i, note in enumerate(speed_notes):
        log(f"  {'speed' if i == 0 else '':<10} {note}")
    log(f"  FLOPs      {human(fpt)}/token (6·N_matmul + attention at seq {t.seq_len})"
        f" · {total_steps:,} steps × {step_tokens:,} tokens = {human(total_steps * step_tokens)} tokens planned"
        f" · {human(fpt * total_steps * step_tokens)}FLOP total")
    ranks = f" × {world} ranks" if world > 1 else ""
    log(f"  batch      global {t.global_batch_size} × seq {t.seq_len} = {step_tokens:,} tokens/step"
        f" · micro-batch {t.micro_batch_size} × accumulation {accum}{ranks}")
    predicted = (f"{plan['hours'] * 60:.1f} min at {100 * plan['mfu']:.0f}% MFU" if plan["hours"] is not None
                 else "time n/a (no peak)")
    log(f"  plan       memory ≈ {plan['memory_gb']:.2f} GiB (model of params, grads, AdamW, activations)"
        f" · {predicted} · plan.json")
    commit = record["code"]["git_commit"]
    log(f"  tracking   {', '.join(sink.names)} · run.json (code {commit[:12] if commit else 'not in git'}"
        f"{' + uncommitted changes' if record['code']['git_dirty'] else ''})")
    sched = {"cosine": f"cosine to {o.lr * o.min_lr_ratio:g}", "constant": "constant",
             "wsd": f"WSD: {o.decay_shape} decay over the last {o.decay_fraction:.0%} to {o.lr * o.min_lr_ratio:g}"
                    + (", fitted to train.max_hours" if o.fit_to_time else "")}[o.schedule]
    log(f"  optimizer  {describe_optimizer(optimizer)} · warmup {o.warmup_steps}, {sched}"
        f" · weight decay {o.weight_decay:g} · clip {o.grad_clip:g}")
    if schedule_note:
        log(f"  schedule   {schedule_note}")
    if ramp is not None:
        log(f"  batch ramp {t.batch_ramp_start} -> {accum} micro-batches per step over the first "
            f"{human(t.batch_ramp_tokens)} tokens · {ramp.steps:,} steps for {human(t.max_tokens)} tokens")

    def validate(step: int, tokens: int) -> float:
        val = evaluate_loss(model, val_windows, t.micro_batch_size, device, autocast, data.eos_id, data.bos_id,
                            shard=(env.rank, world), reduce=lambda v: env.sum(v, device))
        log(f"  val  step {step:>6} | loss {val:.4f} | ppl {perplexity(val):,.1f} | bpb {bpb(val):.4f}"
            f" | uniform ln V = {uniform:.4f}")
        return val

    def bpb(val: float) -> float:
        return bits_per_byte(val, val_windows[:, 1:].numel(), val_bytes)

    def run_tasks(step: int) -> dict[str, Any]:
        from flopwise.evaluate.tasks import evaluate_tasks

        results = evaluate_tasks(model, data.tokenizer, task_names, paths=task_paths,
                                 limit=e.tasks_limit, device=device, batch_size=t.micro_batch_size,
                                 autocast=autocast, shard=(env.rank, world), reduce=lambda v: env.sum(v, device))
        model.train()
        for name, r in results.items():
            log(f"  eval step {step:>6} | {name} acc {r['acc']:.4f} · acc_norm {r['acc_norm']:.4f}"
                f" (± {r['stderr']['acc']:.4f}, random {r['random']:.4f}, n {r['n']})")
        return results

    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + AdamW m, v
    deadline = Deadline(t.max_hours, t_start, state_bytes)
    fit = TimeFit(deadline, o.warmup_steps) if o.fit_to_time else None
    last_saved = start.checkpoint

    def save(done: int, tokens: int) -> Path:
        nonlocal last_saved
        t0 = time.perf_counter()
        state = {"tokens": tokens, "loader": train_loader.state_dict(), "val_loss_start": val_start,
                 "val_windows": len(val_windows),
                 "data_fingerprint": data_fingerprint, "guard": guard.state_dict()}
        if cont is not None:
            state["lr_continuation"] = cont._asdict()
        if prec.scaler is not None:
            state["grad_scaler"] = prec.scaler.state_dict()
        path = save_distributed(run_dir, done, env, strategy.name, state_model, optimizer, state, config_yaml,
                                train_loader.state_dict(), device)
        env.on_main(lambda: apply_retention(run_dir, t.keep_checkpoints, t.milestone_every))
        deadline.record_save(time.perf_counter() - t0)
        last_saved = path
        return path

    def reload(path: Path) -> dict[str, Any]:  # a rollback: every rank reloads its part
        saved = load_distributed(path, env, strategy.name, state_model, optimizer, device)
        if "rng" in saved:
            set_rng_state(saved["rng"], device)
        return saved

    first_step = step
    if step == 0:
        val_start = validate(0, 0)
        sink.write({"step": 0, "tokens": 0, "loss": None, "lr": None, "grad_norm": None, "tok_per_s": None,
                    "mfu": None, "val_loss": val_start, "val_ppl": perplexity(val_start), "val_bpb": bpb(val_start)})
    val_end = val_start

    meter = ThroughputMeter(fpt, peak * world if peak else None, warmup_steps=t.warmup_log_steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clip = o.grad_clip if o.grad_clip > 0 else float("inf")
    loss_sum, steps_in_window = 0.0, 0
    last_loss = float("nan")
    stopped = ""
    t_loop = time.perf_counter()
    meter.pause()
    timer = StepTimer(device)
    recompiles = RecompileWatch(t.compile != "off")
    # What the optimizer steps -- not model.parameters(): under FSDP2 a module whose weights
    # are gathered (the root after an evaluation) lists its unsharded copies there.
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]

    with SignalStop() as signals, profiler(t.profile, run_dir / "profile", t.profile_wait, t.profile_warmup,
                                           t.profile_active) as prof:
        while step < total_steps:
            stopped = stop_reason(env, signals, deadline, fit, device)  # a fitted WSD stops itself below
            if stopped:
                break
            t_step = time.perf_counter()
            if ramp is not None:
                accum = ramp.accums[step]
                step_tokens = accum * micro_tokens
            lr = lr_for_step(step, total_steps, tokens + step_tokens, o, t, ramp, fit, cont)
            if fit is not None and fit.done(step):
                stopped = "the time budget is used with the decay finished"
                break
            if isinstance(optimizer, CombinedOptimizer):
                set_lr_factor(optimizer, lr / o.lr)
            else:
                set_lr(optimizer, lr)
            with timer.part("fwd_bwd"), nvtx(t.nvtx, "forward_backward"):
                micro = timer.timed_batches(train_loader.next_batch, accum)
                # Each rank divides by its own share of the tokens; DDP/FSDP average over ranks,
                # on this step's last micro-batch (a batch ramp changes their number per step).
                sync = grad_sync(train_model, strategy.name, accum) if strategy.name != "single" else None
                loss = forward_backward(train_model, micro, step_tokens // world, autocast, loss_fn, prec.scaler, sync)
            with timer.part("optim"), nvtx(t.nvtx, "optimizer"):
                if master:
                    master.grads_to_master()
                if prec.scaler is not None:
                    prec.scaler.unscale_(optimizer)
                grad_norm = clip_grad_norm(opt_params, clip)
            loss_f, gnorm_f = global_loss(env, loss, grad_norm)  # one transfer per step
            # With fp16 loss scaling an overflowing gradient is routine: the scaler skips that
            # update and lowers its scale, so only the loss decides there. A collapse (gradient
            # norm ~0 for train.collapse_steps steps) is handled as a bad step too, from the same floats.
            finite = guard.check(loss_f, gnorm_f if prec.scaler is None else 0.0)
            if not finite or guard.collapsed(loss_f, gnorm_f):
                step, tokens = handle_nonfinite(
                    guard, step, tokens, loss_f, gnorm_f, lr, optimizer, train_loader, run_dir, last_saved, sink, log,
                    reload=reload, is_main=env.is_main, collapse=finite)
                if master:
                    master.master_to_model()
                if prec.scaler is not None:
                    prec.scaler.update()  # closes this step's unscale_ so the next step can unscale again
                meter.pause()
                continue
            layer_stats = None
            if tr.grad_norms_every > 0 and (step + 1) % tr.grad_norms_every == 0:
                layer_stats = layer_grad_norms(state_model)
                before = ({n: p.detach().clone() for n, p in state_model.named_parameters()}
                          if tr.update_ratios else None)
            with timer.part("optim"), nvtx(t.nvtx, "optimizer"):
                if prec.scaler is not None:
                    prec.scaler.step(optimizer)
                    prec.scaler.update()
                else:
                    optimizer.step()
                if master:
                    master.master_to_model()
            if layer_stats is not None and tr.update_ratios:
                layer_stats["update_ratios"] = update_ratios(state_model, before)
            optimizer.zero_grad(set_to_none=True)
            prof.step()
            step += 1
            tokens += step_tokens
            ratio = guard.spike(loss_f)
            if ratio is not None:
                log(f"  event step {step}: loss spike {loss_f:.4f} = {ratio:.1f}x the running mean")
                sink.write({"step": step, "event": "loss_spike", "loss": loss_f, "ratio": ratio})
            loss_sum += loss_f
            steps_in_window += 1
            meter.step(step_tokens)
            timer.end_step(time.perf_counter() - t_step)
            deadline.record_step(time.perf_counter() - t_step)
            if step - first_step == t.warmup_log_steps:
                recompiles.arm()  # compiling is warm-up; from here on a compile is a recompile
            is_last = step == total_steps
            do_val = is_last or (e.every > 0 and step % e.every == 0)

            if step % t.log_every == 0 or is_last or do_val:
                last_loss = loss_sum / steps_in_window
                t_log = time.perf_counter()
                rates = meter.window()
                mem = memory_stats(device)
                parts = timer.window()
                row = {"step": step, "tokens": tokens, "loss": last_loss, "lr": lr, "grad_norm": gnorm_f,
                       **rates, **mem, **parts, "elapsed_s": time.perf_counter() - t_start}
                if world > 1:
                    row.update(world_size=world, tok_per_s_per_gpu=rates["tok_per_s"] / world)
                row["eta_s"] = (total_steps - step) * rates["step_time_s"]  # training time left at this pace
                if rates.get("mfu") is not None:  # the other conventions, for comparison (README "Conventions")
                    row["mfu_6n"] = rates["mfu"] * fpt_6n / fpt
                    if hfpt != fpt:
                        row["hfu"] = rates["mfu"] * hfpt / fpt
                warning = recompiles.check()
                if warning:
                    log(f"  {warning}")
                    sink.write({"step": step, "event": "recompile", "message": warning})
                if guard.skipped or guard.rollbacks:
                    row.update(skipped_steps=guard.skipped, rollbacks=guard.rollbacks)
                per_gpu = f" ({human(rates['tok_per_s'] / world)}/GPU)" if world > 1 else ""
                log(f"step {step:>6}/{total_steps} | tok {human(tokens):>7} | loss {last_loss:.4f} | lr {lr:.2e}"
                    f" | gnorm {gnorm_f:.3f} | {human(rates['tok_per_s'])} tok/s{per_gpu}"
                    f" | mfu {format_mfu(rates['mfu'])}"
                    f" | {format_memory(mem)} | {1000 * rates['step_time_s']:.0f} ms/step"
                    f" | {format_breakdown(parts, rates['step_time_s'])} | ETA {eta_text(row, deadline)}")
                if do_val:
                    val_end = validate(step, tokens)
                    row.update(val_loss=val_end, val_ppl=perplexity(val_end), val_bpb=bpb(val_end))
                if task_names and (is_last or (e.tasks_every > 0 and step % e.tasks_every == 0)):
                    row["eval"] = run_tasks(step)
                if layer_stats is not None:
                    row.update(layer_stats)
                sink.write(row)
                loss_sum, steps_in_window = 0.0, 0
                timer.host["log"] += time.perf_counter() - t_log
            elif layer_stats is not None:
                sink.write({"step": step, **layer_stats})
            do_save = is_last or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0)
            if do_save:
                save(step, tokens)
            if do_val or do_save:
                meter.pause()  # evaluation and saving are not training throughput

        if stopped:
            if last_saved is None or last_saved.name != f"step-{step:07d}":
                save(step, tokens)
            log(f"  stop       {stopped}: checkpoint at step {step:,} saved; "
                f"`flopwise train --config {run_dir / 'config.yaml'}` resumes it")

    recompiles.close()
    train_time = time.perf_counter() - t_loop
    sample = ""
    if e.sample_tokens > 0 and not stopped and step == total_steps and step > first_step:
        sample = write_sample(model, data, cfg, device, run_dir if env.is_main else None)  # every rank: FSDP2
    sink.close()

    avg = meter.summary()
    wall = time.perf_counter() - t_start
    result = TrainResult(run_dir, step, tokens, last_loss, val_start, val_end, uniform,
                         avg["tok_per_s"], avg["mfu"], wall, last_saved, sample, stopped or None)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
    if env.is_main:
        atomic_write(run_dir / "run.json", json.dumps({**record, "result": summary, "train_time_s": train_time},
                                                     indent=2))

    avg_tps = "n/a" if avg["tok_per_s"] is None else f"{human(avg['tok_per_s'])} tok/s"
    log(f"{'stopped' if stopped else 'done'}: {step:,} steps · {human(tokens)} tokens · train {_fmt_time(train_time)}"
        f" · wall {_fmt_time(wall)} · {avg_tps} (after warm-up) · mfu {format_mfu(avg['mfu'])}")
    log(f"  val loss {val_start:.4f} -> {val_end:.4f} (uniform ln V = {uniform:.4f}) · final train loss {last_loss:.4f}")
    log(f"  checkpoint {last_saved}")
    if sample:
        log(f"  sample ({run_dir / 'samples.txt'}):")
        for line in sample.splitlines()[:12]:
            log(f"    {line}")
    return result


def handle_nonfinite(guard: NonFiniteGuard, step: int, tokens: int, loss: float, grad_norm: float, lr: float,
                     optimizer: torch.optim.Optimizer, loader, run_dir: Path, last_saved: Path | None, sink,
                     log: Log, reload: Callable[[Path], dict[str, Any]], is_main: bool = True,
                     collapse: bool = False) -> tuple[int, int]:
    """Apply ``train.nonfinite`` to a bad step: a loss or gradients that are not finite, or
    (``collapse``) the last step of a collapse (:meth:`NonFiniteGuard.collapsed`); the update
    has not happened. Returns the (step, tokens) the loop continues from; raises
    :class:`NonFiniteError`, after writing ``nonfinite-step-N.json``, when the policy is
    ``stop`` or one of its bounds is reached (:meth:`NonFiniteGuard.refusal` says which)."""
    bad_step = step + 1
    optimizer.zero_grad(set_to_none=True)
    if collapse:
        what = (f"collapse at step {bad_step}: gradient norm {grad_norm:.3g} for {guard.collapse_steps} steps in a "
                f"row (loss {loss:.6f}, uniform ln V = {guard.uniform_loss:.6f})")
    else:
        what = f"non-finite loss or gradients at step {bad_step} (loss {loss}, grad norm {grad_norm})"
    event = "collapse" if collapse else "nonfinite"
    sink.write({"step": bad_step, "event": event, "loss": loss, "grad_norm": grad_norm, "policy": guard.policy})
    checkpoint = last_saved.name if last_saved is not None else None
    refusal = guard.refusal(checkpoint, collapse)
    if refusal:
        if guard.policy != "stop":
            log(f"  event {what}: stopping: {refusal}")
        diag = run_dir / f"nonfinite-step-{bad_step:07d}.json"
        if is_main:
            diag.write_text(json.dumps({
                "step": bad_step, "event": event, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                "policy": guard.policy, "stopped_because": refusal, "in_a_row": guard.in_a_row,
                "skipped": guard.skipped, "rollbacks": guard.rollbacks, "rollbacks_to": guard.rollbacks_to,
                "loader_after_step": loader.state_dict(), "last_checkpoint": str(last_saved) if last_saved else None,
            }, indent=2, default=str))
        raise NonFiniteError(f"{what}; diagnostics in {diag}; last checkpoint {last_saved}; {refusal}")
    if guard.policy == "skip":
        guard.record_skip()
        log(f"  event {what}: update skipped ({guard.in_a_row} in a row, {guard.skipped} of at most "
            f"{guard.max_skips} in the run)")
        return step + 1, tokens + 0  # the batch is consumed, nothing learned from it
    # rollback: the weights, optimizer and RNG of the last checkpoint; the data since it is skipped.
    # The guard keeps its own counts (reload does not touch it): the one being made included.
    position = loader.state_dict()
    saved = reload(last_saved)  # weights, optimizer and RNG states
    loader.load_state_dict(position)
    guard.record_rollback(checkpoint)
    log(f"  event {what}: rolled back to {checkpoint}, skipping the data since then ({guard.rollbacks} of at most "
        f"{guard.max_rollbacks} in the run, {guard.rollbacks_to[checkpoint]} of "
        f"{guard.max_rollbacks_per_checkpoint} to this checkpoint)")
    return saved["step"], saved["tokens"]


def layer_grad_norms(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Each parameter's gradient norm (before clipping), in one device-to-host transfer."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    norms = torch.stack([_full(g.detach().float().norm()) for _, g in named]).tolist()
    return {"grad_norms": dict(zip((n for n, _ in named), norms))}


def update_ratios(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """|w_after - w_before| / |w_before| per parameter: how far this step moved each weight."""
    names, ratios = [], []
    for n, p in model.named_parameters():
        old = before[n].float()
        names.append(n)
        ratios.append(_full((p.detach().float() - old).norm()) / _full(old.norm()).clamp_min(1e-12))
    return dict(zip(names, torch.stack(ratios).tolist()))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A norm over all ranks' shards when ``t`` is an FSDP2 DTensor; ``t`` otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def task_files(task_dir: str, names: list[str]) -> dict[str, str]:
    """``eval.task_dir``'s file (or folder) for each task: TASK.jsonl, .json, .parquet or TASK/."""
    if not task_dir:
        return {}
    root = Path(task_dir).expanduser()
    found = {}
    for name in names:
        for candidate in (root / f"{name}.jsonl", root / f"{name}.json", root / f"{name}.parquet", root / name):
            if candidate.exists():
                found[name] = str(candidate)
                break
        else:
            raise ConfigError([f"eval.task_dir {task_dir!r} has no {name}.jsonl, .json, .parquet or {name}/"])
    return found


def explain_run(cfg: RunConfig, log: Log = print) -> dict[str, Any]:
    """The graph-break report for ``flopwise train --explain``: graphs, breaks and their
    reasons when dynamo traces the training loss on one real micro-batch. Trains nothing."""
    from flopwise.train.wrap import explain

    device = resolve_device(cfg.train.device)
    prec = resolve_precision_full(cfg.train.precision, device)
    data = open_data(cfg, log)
    m, t = cfg.model, cfg.train
    loader = make_loader(cfg.data.loader, data, "train", t.seq_len, t.micro_batch_size, seed=t.seed,
                         device=device, doc_boundaries=m.doc_mask)
    model = build_model(m, device=device, seed=t.seed)
    configure_attention(model, device, prec.autocast_dtype or torch.float32)
    from flopwise.train.wrap import apply_activation_checkpointing

    apply_activation_checkpointing(model, t.activation_checkpointing, t.checkpoint_every_k)
    loss_fn = make_loss_fn(model, resolve_loss_impl(t.loss, m, t, device), t.loss_chunk_tokens)
    batch = loader.next_batch()
    with autocast_factory(device, prec.autocast_dtype)():
        report = explain(lambda *b: loss_fn(*b)[0], *batch)
    log(f"explain: {report['graphs']} graph(s), {report['graph_breaks']} graph break(s) for one training "
        f"micro-batch ({t.micro_batch_size} x {t.seq_len}) of {cfg.preset}")
    for r in report["reasons"]:
        log(f"  break: {r}")
    if not report["graph_breaks"]:
        log("  no graph breaks: train.compile=model compiles the step as one graph")
    return report


class TimeFit:
    """WSD fitted to ``train.max_hours``: after the warm-up steps, progress is the share of the
    time budget used (the final save's time kept aside), so the decay ends as the budget does."""

    def __init__(self, deadline: Deadline, warmup_steps: int):
        self.deadline, self.warmup_steps = deadline, warmup_steps
        self.start = time.perf_counter()
        self.agreed_progress: float | None = None  # under data parallelism: rank 0's, shared each step

    def budget_s(self) -> float:
        return self.deadline.end - self.start - Deadline.MARGIN * self.deadline.save_s

    def measure(self) -> float:
        """The share of the budget used by this process's clock."""
        return time_progress(time.perf_counter() - self.start, self.budget_s(), Deadline.MARGIN * self.deadline.step_s)

    def progress(self) -> float:
        return self.agreed_progress if self.agreed_progress is not None else self.measure()

    def done(self, step: int) -> bool:
        return step >= self.warmup_steps and self.progress() >= 1.0


def finished_run(run_dir: Path, checkpoint: Path, done: int, total_steps: int, uniform: float, t_start: float,
                 log: Log) -> TrainResult:
    """A run directory whose latest checkpoint already holds ``total_steps`` steps (or more):
    say so and change nothing -- no run.json, metrics, config or checkpoint is rewritten.
    The result is the one the run recorded when it finished (run.json), where there is one."""
    prev = _read_json(run_dir / "run.json").get("result") or {}
    if not isinstance(prev, dict) or prev.get("steps") != done:
        prev = {}
    if done == total_steps:
        log(f"finished: {run_dir} already holds all {total_steps:,} steps ({checkpoint}); nothing to train, "
            "nothing changed. To train longer, raise train.max_steps (or train.max_tokens); --fresh starts over")
    else:
        log(f"nothing to train: {run_dir} already holds {done:,} steps ({checkpoint}), more than the "
            f"{total_steps:,} asked; nothing changed. Raise train.max_steps (or train.max_tokens) to train "
            "longer; --fresh starts a new run")
    nan = float("nan")
    return TrainResult(run_dir, done, int(prev.get("tokens") or 0), _num(prev.get("final_loss")),
                       _num(prev.get("val_loss_start")), _num(prev.get("val_loss_end")), uniform,
                       prev.get("tok_per_s"), prev.get("mfu"), time.perf_counter() - t_start, checkpoint,
                       prev.get("sample") or "", None) if prev else TrainResult(
        run_dir, done, 0, nan, nan, nan, uniform, None, None, time.perf_counter() - t_start, checkpoint, "", None)


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else float("nan")


def resumed_schedule(checkpoint: Path, saved: dict[str, Any], step: int, total_steps: int, cfg: RunConfig,
                     ramped: bool) -> tuple[Continuation | None, str]:
    """The learning rate of a resumed run whose length (``train.max_steps``/``max_tokens``)
    may have changed since ``checkpoint`` (its own config.yaml holds the length its steps were
    taken under): ``(continuation or None, a note for the log, "" when nothing changed)``.

    An unchanged length keeps the schedule as it was (bit-identical to an uninterrupted run).
    A changed one goes on from the rate of the last step taken (``schedule.continue_schedule``)
    instead of recomputing the schedule for the new length, which would move the rate
    (extending a finished cosine would raise it from its floor)."""
    o, t = cfg.optim, cfg.train
    before = saved.get("lr_continuation")
    before = Continuation(**before) if isinstance(before, dict) else None
    try:
        old = load_run_config(checkpoint / "config.yaml")
    except (ConfigError, OSError):
        old = None
    if o.fit_to_time:
        return None, ""  # progress is the share of train.max_hours used, not of the steps
    if ramped:
        if old is not None and (old.train.max_tokens, old.train.max_steps) != (t.max_tokens, t.max_steps):
            raise ConfigError([f"train.run_dir {t.run_dir!r}: a batch-ramped run's schedule follows its tokens, so "
                               f"its length cannot change on resume (train.max_tokens {old.train.max_tokens} -> "
                               f"{t.max_tokens}, train.max_steps {old.train.max_steps} -> {t.max_steps}): keep "
                               f"train.max_tokens={old.train.max_tokens} train.max_steps={old.train.max_steps}, "
                               "or pass --fresh to start over"])
        return None, ""
    old_total = before.total if before is not None else (old.total_steps() if old is not None else total_steps)
    floor = o.lr * o.min_lr_ratio
    if old_total == total_steps:
        if before is None:
            return None, ""
        return before, (f"the rate follows the continuation set at step {before.from_step:,} when the run's length "
                        f"changed: {_continuation_text(before, floor)}")

    def previous(k: int) -> float:  # the rate step k had
        return before.at(k, floor) if before is not None and k >= before.from_step else lr_at(k, old_total, o)

    last = step - 1
    prev_rate, new_rate = previous(last), lr_at(last, total_steps, o)
    cont = continue_schedule(step, total_steps, prev_rate, new_rate, o)
    change = f"length {old_total:,} -> {total_steps:,} steps"
    if cont is None:
        end = f" (its decay now ends at step {total_steps:,})" if o.schedule == "wsd" else ""
        return None, (f"{change}: step {step:,}'s rate is the same under both ({new_rate:.3g}), so the {o.schedule} "
                      f"schedule of {total_steps:,} steps goes on from there{end}")
    restart = lr_at(step, total_steps, o)
    return cont, (f"{change}: {_continuation_text(cont, floor)}, where the {old_total:,}-step schedule left it "
                  f"(recomputing the {o.schedule} schedule for {total_steps:,} steps would set {restart:.3g} "
                  f"at step {step + 1:,})")


def _continuation_text(c: Continuation, floor: float) -> str:
    if c.lr <= floor:
        return f"the rate is held at {c.lr:.3g} from step {c.from_step + 1:,} to {c.total:,}"
    return (f"the rate continues from {c.lr:.3g} at step {c.from_step:,} and decays ({c.shape}) to {floor:.3g} "
            f"at step {c.total:,}")


def lr_for_step(step: int, total_steps: int, tokens_after: int, o, t, ramp, fit: TimeFit | None,
                cont: Continuation | None = None) -> float:
    """The learning rate of the next step: by steps (``lr_at``), by tokens during a batch ramp
    (steps differ in size), by time for a WSD fitted to ``train.max_hours``, or along ``cont``
    after a resume that changed the run's length (:func:`resumed_schedule`)."""
    if cont is not None and step >= cont.from_step:
        return cont.at(step, o.lr * o.min_lr_ratio)
    if fit is not None:
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        return o.lr * lr_factor(fit.progress(), o, 0.0)
    if ramp is not None:
        return o.lr * lr_factor(tokens_after / t.max_tokens, o, o.warmup_steps / max(total_steps, 1))
    return lr_at(step, total_steps, o)


def resolve_loss_impl(choice: str, m, t, device: torch.device) -> str:
    """``auto``: a fused kernel on CUDA when one is installed; plain when the whole loss is
    compiled (the compiler fuses the head and the loss itself); else chunked, which on this
    project's CPU measurements (benchmarks/chunked_ce.py) is both faster and smaller than the
    plain path already at the tiny preset's size."""
    from flopwise.train.losses import fused_linear_cross_entropy_available

    if choice != "auto":
        if choice == "fused" and not fused_linear_cross_entropy_available(device):
            raise ConfigError(["train.loss=fused: no fused linear cross-entropy kernel here (Liger-Kernel on CUDA)"])
        return choice
    if fused_linear_cross_entropy_available(device):
        return "fused"
    return "plain" if t.compile == "model" else "chunked"


def eta_text(row: dict[str, Any], deadline: Deadline) -> str:
    """Time left at the current pace, and against ``train.max_hours`` when there is a budget."""
    text = f"{_fmt_time(row['eta_s'])} ({_fmt_time(row['elapsed_s'])} elapsed)"
    if deadline.end is not None:
        left = deadline.end - time.perf_counter()
        verdict = "fits" if row["eta_s"] <= left else "stops early"
        text += f" · {verdict} in the {_fmt_time(max(left, 0))} left of train.max_hours"
    return text


def stop_reason(env: DistEnv, signals: SignalStop, deadline: Deadline, fit: "TimeFit | None",
                device: torch.device) -> str:
    """Why to stop before the next step ("" to go on), the same answer on every rank: a
    signal that reached any rank, ``train.max_hours`` by any rank's clock. Under data
    parallelism a WSD fitted to the time budget follows rank 0's clock, so every rank sets
    the same learning rate: its progress travels in the same (one, tiny) all-reduce."""
    signal, late = signals.requested, fit is None and deadline.must_stop()
    if env.distributed:
        progress = fit.measure() if fit is not None and env.is_main else 0.0
        n_signals, n_late, progress = env.sum([float(signal), float(late), progress], device)
        if fit is not None:
            fit.agreed_progress = progress
        if n_signals and not signal:
            return "a signal received by another rank"
        signal, late = bool(n_signals), bool(n_late)
    if signal:
        return f"{signals.name} received"
    if late:
        return f"train.max_hours={deadline.max_hours:g} reached" + (" (by the slowest rank's clock)"
                                                                    if env.distributed else "")
    return ""


def global_loss(env: DistEnv, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
    """The step's loss and gradient norm as floats, in one device-to-host transfer. Under data
    parallelism the loss is the mean of the ranks' (each over its share of the batch), so a
    NaN on one rank is a NaN on all and every rank takes the same non-finite decision; the
    gradient norm is already global."""
    packed = torch.stack([loss.float(), grad_norm.float().to(loss.device)])
    if env.distributed:
        packed = env.sum_tensor(packed.to(loss.device if env.backend == "nccl" else "cpu")) / env.world_size
    loss_f, gnorm_f = packed.tolist()
    return loss_f, gnorm_f


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


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


def write_sample(model: torch.nn.Module, data: DataDir, cfg: RunConfig, device: torch.device,
                 run_dir: Path | None) -> str:
    """Sample ``eval.sample_tokens`` tokens after ``eval.sample_prompt`` -- when that is empty
    (the default), after the start of a validation document (:func:`validation_prompt`); save
    to samples.txt (``run_dir`` None: on ranks other than 0, which generate in step with it,
    write nothing)."""
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
    from torch.distributed.fsdp import FSDPModule

    out = generate(model, torch.tensor([ids], device=device), e.sample_tokens, cfg.train.seq_len,
                   temperature=e.temperature, top_k=e.top_k, generator=gen, eos_id=data.eos_id,
                   use_cache=not isinstance(model, FSDPModule))
    text = tok.decode(out[0].tolist())
    if run_dir is None:
        return text
    with open(run_dir / "samples.txt", "a", encoding="utf-8") as f:
        f.write(f"--- prompt {shown!r} ({source}) · temperature {e.temperature:g} · top-k {e.top_k}\n"
                f"{text}\n")
    return text
