"""The training loop on one device (CPU or one CUDA GPU).

Order of work, cheapest checks first so bad input fails before anything is allocated:
config (already validated) -> run directory -> data directory -> model -> optimizer ->
loop. The loop logs every ``train.log_every`` steps, validates every ``eval.every``
steps on a fixed held-out subset, checkpoints every ``train.save_every`` steps and at the
end, then writes a text sample.
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
from flopwise.config import ConfigError, RunConfig
from flopwise.data.datadir import DataDir, open_data_dir
from flopwise.data.loader import fixed_windows, make_loader
from flopwise.evaluate.generate import generate
from flopwise.evaluate.loss import evaluate_loss, perplexity
from flopwise.measure.meter import ThroughputMeter, format_memory, memory_stats
from flopwise.measure.sinks import JsonlSink, format_mfu, human
from flopwise.model import build_model, configure_attention
from flopwise.plan import hardware
from flopwise.plan.budget import plan_for_run
from flopwise.plan.flops import flops_per_token, param_counts
from flopwise.train.checkpoint import save_checkpoint
from flopwise.train.optim import build_optimizer, lr_at, set_lr
from flopwise.train.step import forward_backward

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


# --------------------------------------------------------------------------- setup

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([f"train.device={name!r} but CUDA is not available on this machine"])
    return device


def resolve_precision(precision: str, device: torch.device) -> tuple[str, torch.dtype | None]:
    """(name, autocast dtype or None). ``auto``: bf16 autocast on CUDA with bf16 support.

    On a CPU without bf16 matrix units, bf16 matmuls are tens of times slower than
    float32, so ``auto`` keeps float32 there; ``bf16`` can still be asked for.
    """
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    return precision, (torch.bfloat16 if precision == "bf16" else None)


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
    key = precision if precision == "bf16" else ("tf32" if tf32_matmuls_allowed() else "fp32")
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


def prepare_run_dir(cfg: RunConfig) -> Path:
    if not cfg.train.run_dir:
        cfg.train.run_dir = str(Path("runs") / f"{cfg.preset or 'run'}-{datetime.now():%Y%m%d-%H%M%S}")
    run_dir = Path(cfg.train.run_dir)
    if run_dir.exists() and any((run_dir / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints")):
        raise ConfigError([
            f"train.run_dir {str(run_dir)!r} already holds a run (config.yaml / metrics.jsonl / checkpoints); "
            "choose another train.run_dir or remove that one"
        ])
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"train.run_dir {str(run_dir)!r} exists and is not a directory"])
    return run_dir


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
        "started": datetime.now().isoformat(timespec="seconds"),
    }


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

def train(cfg: RunConfig, log: Log = print) -> TrainResult:
    t_start = time.perf_counter()
    device = resolve_device(cfg.train.device)
    precision, amp_dtype = resolve_precision(cfg.train.precision, device)
    autocast = autocast_factory(device, amp_dtype)
    run_dir = prepare_run_dir(cfg)
    data = open_data(cfg, log)

    m, t, o, e = cfg.model, cfg.train, cfg.optim, cfg.eval
    total_steps = cfg.total_steps()
    accum = cfg.grad_accum_steps()
    step_tokens = cfg.tokens_per_step
    counts = param_counts(m)
    fpt = flops_per_token(m, t.seq_len)
    peak, peak_note = device_peak(device, precision, t.peak_tflops)
    uniform = math.log(data.vocab_size)

    # The data checks (each split long enough for a window) come before any allocation.
    train_loader = make_loader(cfg.data.loader, data, "train", t.seq_len, t.micro_batch_size, seed=t.seed,
                               device=device, doc_boundaries=m.doc_mask)
    val_windows = fixed_windows(data, "val", t.seq_len, e.batches * t.micro_batch_size)
    torch.manual_seed(t.seed)
    model = build_model(m, device=device, seed=t.seed)
    attention_notes = configure_attention(model, device, amp_dtype or model.tok_emb.weight.dtype)
    if m.hf_config:
        init_note = load_hf_init(model, m.hf_config)
    optimizer = build_optimizer(model, o, device)

    run_dir.mkdir(parents=True, exist_ok=True)
    config_yaml = cfg.to_yaml()
    (run_dir / "config.yaml").write_text(config_yaml)
    record = run_record(cfg, device, precision)
    plan = plan_for_run(cfg, torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                        precision, t.peak_tflops)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    (run_dir / "run.json").write_text(json.dumps(record, indent=2))
    shutil.copyfile(data.path / "tokenizer.json", run_dir / "tokenizer.json")  # the run is self-contained
    sink = JsonlSink(run_dir / "metrics.jsonl")

    log(f"flopwise train · preset {cfg.preset} · run dir {run_dir}")
    log(f"  device     {device_label(device)} · precision {precision} · peak {peak_note}")
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
    if m.hf_config:
        log(f"  init       {init_note}")
    log(f"  FLOPs      {human(fpt)}/token (6·N_matmul + attention at seq {t.seq_len})"
        f" · {total_steps:,} steps × {step_tokens:,} tokens = {human(total_steps * step_tokens)} tokens planned"
        f" · {human(fpt * total_steps * step_tokens)}FLOP total")
    log(f"  batch      global {t.global_batch_size} × seq {t.seq_len} = {step_tokens:,} tokens/step"
        f" · micro-batch {t.micro_batch_size} × accumulation {accum}")
    predicted = (f"{plan['hours'] * 60:.1f} min at {100 * plan['mfu']:.0f}% MFU" if plan["hours"] is not None
                 else "time n/a (no peak)")
    log(f"  plan       memory ≈ {plan['memory_gb']:.2f} GiB (model of params, grads, AdamW, activations)"
        f" · {predicted} · plan.json")
    log(f"  optimizer  AdamW lr {o.lr:g} (warmup {o.warmup_steps}, {o.schedule}"
        f"{f' to {o.lr * o.min_lr_ratio:g}' if o.schedule == 'cosine' else ''}) · weight decay {o.weight_decay:g}"
        f" · clip {o.grad_clip:g}")

    def validate(step: int, tokens: int) -> float:
        val = evaluate_loss(model, val_windows, t.micro_batch_size, device, autocast, data.eos_id, data.bos_id)
        log(f"  val  step {step:>6} | loss {val:.4f} | ppl {perplexity(val):,.1f} | uniform ln V = {uniform:.4f}")
        return val

    val_start = validate(0, 0)
    sink.write({"step": 0, "tokens": 0, "loss": None, "lr": None, "grad_norm": None, "tok_per_s": None,
                "mfu": None, "val_loss": val_start, "val_ppl": perplexity(val_start)})
    val_end = val_start

    meter = ThroughputMeter(fpt, peak, warmup_steps=t.warmup_log_steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clip = o.grad_clip if o.grad_clip > 0 else float("inf")
    loss_acc = torch.zeros((), device=device)
    steps_in_window = 0
    tokens = 0
    last_loss = float("nan")
    ckpt: Path | None = None
    t_loop = time.perf_counter()
    meter.pause()

    for step in range(total_steps):
        lr = lr_at(step, total_steps, o)
        set_lr(optimizer, lr)
        micro = (train_loader.next_batch() for _ in range(accum))
        loss = forward_backward(model, micro, step_tokens, autocast)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += step_tokens
        loss_acc += loss
        steps_in_window += 1
        meter.step(step_tokens)
        done = step + 1
        is_last = done == total_steps
        do_val = is_last or (e.every > 0 and done % e.every == 0)

        if done % t.log_every == 0 or is_last or do_val:
            last_loss = float(loss_acc) / steps_in_window  # .item() synchronises: timing is honest
            rates = meter.window()
            mem = memory_stats(device)
            row = {"step": done, "tokens": tokens, "loss": last_loss, "lr": lr, "grad_norm": float(grad_norm),
                   **rates, **mem, "elapsed_s": time.perf_counter() - t_start}
            log(f"step {done:>6}/{total_steps} | tok {human(tokens):>7} | loss {last_loss:.4f} | lr {lr:.2e}"
                f" | gnorm {float(grad_norm):.3f} | {human(rates['tok_per_s'])} tok/s | mfu {format_mfu(rates['mfu'])}"
                f" | {format_memory(mem)} | {1000 * rates['step_time_s']:.0f} ms/step")
            if do_val:
                val_end = validate(done, tokens)
                row.update(val_loss=val_end, val_ppl=perplexity(val_end))
            sink.write(row)
            loss_acc.zero_()
            steps_in_window = 0
        do_save = is_last or (t.save_every > 0 and done % t.save_every == 0)
        if do_save:
            state = {"tokens": tokens, "loader": train_loader.state_dict()}
            ckpt = save_checkpoint(run_dir, done, model, optimizer, state, config_yaml)
        if do_val or do_save:
            meter.pause()  # evaluation and saving are not training throughput

    train_time = time.perf_counter() - t_loop
    sample = ""
    if e.sample_tokens > 0:
        sample = write_sample(model, data, cfg, device, run_dir)
    sink.close()

    avg = meter.summary()
    wall = time.perf_counter() - t_start
    result = TrainResult(run_dir, total_steps, tokens, last_loss, val_start, val_end, uniform,
                         avg["tok_per_s"], avg["mfu"], wall, ckpt, sample)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
    (run_dir / "run.json").write_text(json.dumps({**record, "result": summary, "train_time_s": train_time}, indent=2))

    avg_tps = "n/a" if avg["tok_per_s"] is None else f"{human(avg['tok_per_s'])} tok/s"
    log(f"done: {total_steps:,} steps · {human(tokens)} tokens · train {_fmt_time(train_time)}"
        f" · wall {_fmt_time(wall)} · {avg_tps} (after warm-up) · mfu {format_mfu(avg['mfu'])}")
    log(f"  val loss {val_start:.4f} -> {val_end:.4f} (uniform ln V = {uniform:.4f}) · final train loss {last_loss:.4f}")
    log(f"  checkpoint {ckpt}")
    if sample:
        log(f"  sample ({run_dir / 'samples.txt'}):")
        for line in sample.splitlines()[:12]:
            log(f"    {line}")
    return result


def write_sample(model: torch.nn.Module, data: DataDir, cfg: RunConfig, device: torch.device, run_dir: Path) -> str:
    """Sample ``eval.sample_tokens`` tokens after ``eval.sample_prompt``; save to samples.txt."""
    e = cfg.eval
    tok = data.tokenizer
    ids = tok.encode(e.sample_prompt).ids or [data.eos_id]
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    out = generate(model, torch.tensor([ids], device=device), e.sample_tokens, cfg.train.seq_len,
                   temperature=e.temperature, top_k=e.top_k, generator=gen, eos_id=data.eos_id)
    text = tok.decode(out[0].tolist())
    with open(run_dir / "samples.txt", "a", encoding="utf-8") as f:
        f.write(f"--- prompt {e.sample_prompt!r} · temperature {e.temperature:g} · top-k {e.top_k}\n{text}\n")
    return text
