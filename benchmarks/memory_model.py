"""The memory model (flopwise.plan.memory) against torch.cuda.max_memory_allocated.

SmolLM-360M at seq 2048, micro-batches 1, 2, 4, 8 (override with --micro-batches), one
real training step each, as ``flopwise train`` does it on CUDA: bf16 autocast forward,
float32 loss (train/train_step.py), backward, gradient clipping, fused AdamW step.

Each micro-batch starts from a fresh allocator state (new model and optimizer,
``empty_cache``). A first step creates the AdamW state; the peak of the second step is
measured twice:

* ``grads_resident``: gradients kept between steps (``zero_grad(set_to_none=False)``,
  the situation of gradient accumulation) -- what the model's ``total`` assumes;
* ``set_to_none``: the trainer with one micro-batch per step (``set_to_none=True``),
  whose peak may be lower by up to the gradient bytes.

Prints a table and writes ``benchmarks/results/memory_model-<device>-<date>.json``.
Without CUDA it says so and exits 0 without writing anything.

    python benchmarks/memory_model.py [--preset smollm-360m] [--seq-len 2048] [--micro-batches 1,2,4,8]
"""

from __future__ import annotations

import argparse
import gc
import re
import sys

import torch
from _results import save_result  # benchmarks/ is on sys.path when a script runs

from flopwise.config import OptimConfig, build_config
from flopwise.model import build_model
from flopwise.model.loss import loss_sum
from flopwise.plan.memory import GIB, MemorySettings, estimate
from flopwise.train.optim import build_optimizer


def measure(cfg, micro_batch: int, seq_len: int, device: torch.device, set_to_none: bool) -> dict:
    """Peak allocated bytes of the second of two training steps, from a clean allocator."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg, device=device)
    opt = build_optimizer(model, OptimConfig(), device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device, generator=gen)
    y = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), device=device, generator=gen)
    tokens = micro_batch * seq_len

    def step():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(x)
        s = loss_sum(logits, y)
        (s / tokens).backward()
        del logits, s
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    try:
        step()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        out = {"peak_allocated": torch.cuda.max_memory_allocated(device),
               "peak_reserved": torch.cuda.max_memory_reserved(device), "oom": False}
    except torch.cuda.OutOfMemoryError:
        out = {"peak_allocated": None, "peak_reserved": None, "oom": True}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm-360m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("memory_model: CUDA is not available; this benchmark compares the memory model with "
              "torch.cuda.max_memory_allocated and needs a GPU. Nothing measured, nothing written.")
        return 0

    device = torch.device("cuda")
    cfg = build_config(preset=args.preset).model
    settings = MemorySettings(precision="bf16", attention="sdpa")
    name = torch.cuda.get_device_name(device)
    total_mem = torch.cuda.get_device_properties(device).total_memory
    rows = []
    print(f"memory model vs max_memory_allocated: {args.preset}, seq {args.seq_len}, bf16 autocast, "
          f"fused AdamW, on {name} ({total_mem / GIB:.1f} GiB), torch {torch.__version__}")
    print(f"{'micro':>5} {'predicted':>10} {'resident':>10} {'err':>7} {'to_none':>10} {'err':>7} "
          f"{'reserved':>10}   (GiB)")
    for b in [int(v) for v in args.micro_batches.split(",") if v.strip()]:
        est = estimate(cfg, b, args.seq_len, settings)
        predicted = est.allocated
        resident = measure(cfg, b, args.seq_len, device, set_to_none=False)
        to_none = measure(cfg, b, args.seq_len, device, set_to_none=True)

        def err(m):
            return None if m["peak_allocated"] is None else (predicted - m["peak_allocated"]) / m["peak_allocated"]

        row = {
            "micro_batch": b, "seq_len": args.seq_len, "predicted_bytes": predicted,
            "predicted_terms_gib": est.gb(),
            "actual_grads_resident_bytes": resident["peak_allocated"], "rel_error_grads_resident": err(resident),
            "actual_set_to_none_bytes": to_none["peak_allocated"], "rel_error_set_to_none": err(to_none),
            "reserved_bytes": resident["peak_reserved"], "oom": resident["oom"] or to_none["oom"],
        }
        rows.append(row)

        def g(v):
            return f"{v / GIB:10.2f}" if v is not None else f"{'OOM':>10}"

        def e(v):
            return f"{100 * v:+6.1f}%" if v is not None else f"{'-':>7}"

        print(f"{b:>5} {g(predicted)} {g(resident['peak_allocated'])} {e(row['rel_error_grads_resident'])} "
              f"{g(to_none['peak_allocated'])} {e(row['rel_error_set_to_none'])} {g(resident['peak_reserved'])}")

    result = {
        "device_memory_bytes": total_mem,
        "cuda": torch.version.cuda,
        "preset": args.preset,
        "settings": vars(settings),
        "model": vars(cfg),
        "note": "predicted = MemoryEstimate.allocated (total less overhead); rel_error = (predicted - actual) / actual",
        "rows": rows,
    }
    if not args.no_save:
        save_result("memory_model", re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
