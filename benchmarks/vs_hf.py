"""flopwise's training step against the usual alternative, same model, batch and device.

Baseline (the stack a user copies from a blog post): ``transformers.LlamaForCausalLM`` with
SDPA attention, ``torch.compile``, AdamW (fused on CUDA), bf16 autocast on CUDA, in a plain
loop: logits, float32 cross-entropy, backward per micro-batch, clip, step.
Project: flopwise's own step -- ``build_model``, ``wrap_model`` (checkpointing/compile as
configured), ``make_loss_fn`` (plain or chunked LM-head loss), ``forward_backward``, the
same clip and optimizer step. Both start from the same weights (ours exported to HF) and
see the same batches of the embedded corpus. After warm-up (compilation included), the
contenders alternate in rounds; each round times ``--steps`` optimizer steps after a
device synchronisation. Reported: tokens/s, MFU (PaLM FLOPs, dense peak of the device;
n/a on CPU), peak memory (CUDA), and the ratio flopwise / baseline.

    python benchmarks/vs_hf.py [--preset tiny] [--sizes tiny,small] [--compile auto|on|off] [--rounds 3]

Writes benchmarks/results/vs-hf-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import torch
import torch.nn.functional as F


from _results import cores as n_cores, save_result  # benchmarks/ is on sys.path when a script runs
from flopwise.config import build_config
from flopwise.data.datadir import open_data_dir
from flopwise.data.loader import fixed_windows
from flopwise.model import build_model, configure_attention
from flopwise.model.hf import to_hf_model
from flopwise.plan import hardware
from flopwise.plan.flops import flops_per_token
from flopwise.train.optim import build_optimizer
from flopwise.train.step import forward_backward, make_loss_fn
from flopwise.train.wrap import wrap_model

SIZES = {
    "tiny": [],  # the preset: 4 layers, d 128, vocab 8,192, seq 128
    "small": ["model.d_model=256", "model.n_layers=6", "model.n_heads=8", "model.n_kv_heads=4",
              "model.ffn_hidden=768", "train.seq_len=256", "model.max_seq_len=256", "train.micro_batch_size=8",
              "train.global_batch_size=16"],
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--sizes", default="tiny,small", help="comma-separated: tiny, small (CPU); or 'preset' alone")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra key=value config overrides for both")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="auto: on for CUDA")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per round")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    amp = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp else contextlib.nullcontext
    results = []
    for size in args.sizes.split(","):
        overrides = (SIZES.get(size, []) if size != "preset" else []) + args.overrides
        overrides += [f"train.compile={'model' if use_compile else 'off'}", "train.max_steps=1"]
        cfg = build_config(preset=args.preset, overrides=overrides)
        results.append(run_size(size, cfg, device, autocast, amp, args))
        r = results[-1]
        print(f"{size:<6} {r['tokens_per_step']:>7} tok/step | flopwise {r['flopwise']['tok_per_s']:>10,.0f} tok/s "
              f"| baseline {r['baseline']['tok_per_s']:>10,.0f} tok/s | ratio {r['ratio']:.3f}"
              + (f" | MFU {100 * r['flopwise']['mfu']:.1f}% vs {100 * r['baseline']['mfu']:.1f}%"
                 if r['flopwise']['mfu'] is not None else ""))
    cores = n_cores()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cores} cores)"
    import transformers

    out = {"transformers": transformers.__version__,
           "compile": use_compile, "autocast": str(amp), "rounds": args.rounds, "steps_per_round": args.steps,
           "baseline": "transformers LlamaForCausalLM, sdpa, torch.compile (if on), AdamW (fused on CUDA), "
                       "bf16 autocast on CUDA, plain loop", "results": results}
    tag = "cuda-" + dev_name.split()[-1].lower() if device.type == "cuda" else f"cpu{cores}"
    save_result("vs-hf", tag, dev_name, out)
    return 0


def run_size(size, cfg, device, autocast, amp, args) -> dict:
    t, m = cfg.train, cfg.model
    data = open_data_dir(cfg.data, log=lambda s: None)
    accum = cfg.grad_accum_steps()
    n_batches = accum * 4
    windows = fixed_windows(data, "train", t.seq_len, n_batches * t.micro_batch_size).to(device)
    batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(t.micro_batch_size)]
    step_tokens = cfg.tokens_per_step

    # flopwise
    ours = build_model(m, device=device, seed=0)
    configure_attention(ours, device, amp or torch.float32)
    wrap_model(ours, t)
    loss_fn = make_loss_fn(ours, _loss_impl(cfg), t.loss_chunk_tokens,
                           compile_mode=t.compile_mode if t.compile == "model" else None)
    opt_ours = build_optimizer(ours, cfg.optim, device)
    # baseline: the same initial weights, as transformers' model
    base_model = to_hf_model(build_model(dataclasses.replace(m), device="cpu", seed=0)).to(device).train()
    base_fwd = torch.compile(base_model) if t.compile != "off" else base_model
    fused = device.type == "cuda"
    opt_base = torch.optim.AdamW(base_model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                 weight_decay=cfg.optim.weight_decay, fused=fused)

    def step_ours(i):
        micro = (batches[(i * accum + j) % len(batches)] for j in range(accum))
        forward_backward(ours, micro, step_tokens, autocast, loss_fn)
        torch.nn.utils.clip_grad_norm_(ours.parameters(), cfg.optim.grad_clip)
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_base(i):
        for j in range(accum):
            x, y = batches[(i * accum + j) % len(batches)]
            with autocast():
                logits = base_fwd(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / step_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(base_model.parameters(), cfg.optim.grad_clip)
        opt_base.step()
        opt_base.zero_grad(set_to_none=True)

    contenders = {"flopwise": step_ours, "baseline": step_base}
    for fn in contenders.values():  # warm-up, compilation included
        for i in range(args.warmup):
            fn(i)
    sync(device)
    times = {k: [] for k in contenders}
    peak = {k: None for k in contenders}
    for r in range(args.rounds):
        for name, fn in (contenders.items() if r % 2 == 0 else reversed(list(contenders.items()))):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            for i in range(args.steps):
                fn(i)
            sync(device)
            times[name].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak[name] = max(peak[name] or 0, torch.cuda.max_memory_allocated(device) / 2**30)
    fpt = flops_per_token(m, t.seq_len)
    peak_flops = None
    if device.type == "cuda":
        p = hardware.peak_tflops(torch.cuda.get_device_name(device), "bf16" if amp else "tf32")
        peak_flops = p * 1e12 if p else None
    rows = {}
    for name in contenders:
        tps = args.steps * step_tokens / min(times[name])
        rows[name] = {"tok_per_s": tps, "seconds_per_round": times[name], "peak_memory_gib": peak[name],
                      "mfu": tps * fpt / peak_flops if peak_flops else None}
    return {"size": size, "model": {k: getattr(m, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                                              "ffn_hidden", "vocab_size")},
            "seq_len": t.seq_len, "micro_batch": t.micro_batch_size, "accum": accum, "tokens_per_step": step_tokens,
            "loss_impl": _loss_impl(cfg), "flops_per_token": fpt, **rows,
            "ratio": rows["flopwise"]["tok_per_s"] / rows["baseline"]["tok_per_s"]}


def _loss_impl(cfg) -> str:
    from flopwise.train.trainer import resolve_loss_impl

    return resolve_loss_impl(cfg.train.loss, cfg.model, cfg.train, torch.device("cuda" if torch.cuda.is_available()
                                                                             else "cpu"))


if __name__ == "__main__":
    sys.exit(main())
