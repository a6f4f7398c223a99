"""LM-head cross-entropy: plain (full logits) against chunked, time and memory of forward+backward.

For two head geometries -- SmolLM-135M's (V 49,152, D 576, 8 x 2048 tokens) and the tiny
preset's (V 8,192, D 128, 2 x 1024 tokens) -- it runs ``flopwise.model.loss``:

- ``plain`` (the baseline): ``F.linear`` to the full (N, V) logits + float32 cross-entropy,
  what ``train/train_step.py`` does today;
- ``chunked`` (backward recomputes each chunk's logits, the default) at several ``chunk_tokens``;
- ``chunked, grads in forward`` (the forward-backward fused variant) at the default chunk;
- ``fused`` (Liger-Kernel) when it is installed and the device is CUDA;

each as one forward + backward (gradients w.r.t. hidden and weight, as in training), fp32
inputs under bf16 autocast by default. Recorded per contender:

- ``ms``: the fastest of ``--repeats`` rounds; the contenders take turns within each round;
- ``peak_mib``: peak memory above the level before the call (inputs excluded, gradients
  included). CUDA: ``torch.cuda.max_memory_allocated`` in a separate untimed pass. CPU: the
  peak resident set (VmHWM, reset through /proc/self/clear_refs) in a child process where
  glibc returns every block >= 1 MiB to the OS on free, so RSS follows the live tensors
  (that setting slows allocation, hence a separate process from the timed one);
- ``saved_mib``: bytes autograd saves for backward, i.e. held from forward to backward,
  each storage once and not counting storage shared with the inputs (hidden, weight);

and ratios to ``plain`` measured in the same run.

    python benchmarks/chunked_ce.py [--repeats 2] [--dtype bf16|fp32] [--tokens N]

Prints a table and writes benchmarks/results/chunked-ce-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch
from _results import cores as n_cores  # benchmarks/ is on sys.path when a script runs
from _results import cpu_label, save_result
from _run import run

from flopwise.model.loss import fused_linear_cross_entropy_available, linear_cross_entropy

GEOMETRIES = [  # name, vocab, d_model, tokens (micro-batch x seq)
    ("smollm-135m", 49152, 576, 8 * 2048),
    ("tiny", 8192, 128, 2 * 1024),
]
MiB = 2**20


def contenders(device: torch.device) -> list[tuple[str, dict]]:
    out = [("plain", dict(impl="plain"))]
    out += [(f"chunked {c}", dict(impl="chunked", chunk_tokens=c)) for c in (1024, 4096)]
    out.append(("chunked 4096, grads in forward", dict(impl="chunked", chunk_tokens=4096, grads_in_forward=True)))
    if fused_linear_cross_entropy_available(device):
        out.append(("fused (Liger)", dict(impl="fused")))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def inputs(V: int, D: int, N: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(N, D, device=device, generator=gen).requires_grad_()  # (N, D) like the final norm's output
    weight = (0.02 * torch.randn(V, D, device=device, generator=gen)).requires_grad_()  # (V, D), init_std 0.02
    targets = torch.randint(0, V, (N,), device=device, generator=gen)  # (N,)
    return hidden, weight, targets


def fwd_bwd(hidden, weight, targets, kw: dict, autocast: bool):
    """One forward + backward as the training step would run it; returns (loss, grads)."""
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(hidden, weight, targets, **kw)
    grads = torch.autograd.grad(loss / targets.numel(), (hidden, weight))  # the step divides by its tokens
    return loss.detach(), grads


# --------------------------------------------------------------------------- memory

def _malloc_returns_big_blocks() -> bool:
    """glibc: serve every block >= 1 MiB by mmap and unmap it on free (a fixed threshold, not
    the adaptive one), so a freed tensor leaves the resident set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MiB)) and bool(libc.mallopt(M_TRIM_THRESHOLD, MiB))
    except (OSError, AttributeError):
        return False


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(hidden, weight, targets, kw: dict, autocast: bool) -> tuple[int, int]:
    """(peak bytes above the level at entry, bytes saved for backward beyond the inputs' storage)."""
    device = hidden.device
    seen = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    saved = 0

    def pack(t):  # each storage once (nll_loss saves the log-softmax that log_softmax saved)
        nonlocal saved
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved += storage.nbytes()
        return t

    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, grads = fwd_bwd(hidden, weight, targets, kw, autocast)
    if device.type == "cuda":
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = _status_bytes("VmHWM") - base
    del grads
    return peak, saved


def memory_rows(geometry: int, tokens: int, autocast: bool, repeats: int) -> dict[str, tuple[int, int]]:
    """Every contender's (peak, saved) for one geometry; the smallest peak over ``repeats``
    (one-time allocations such as thread pools or kernel scratch land on the first only)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, V, D, N = GEOMETRIES[geometry]
    hidden, weight, targets = inputs(V, D, tokens or N, device)
    out: dict[str, tuple[int, int]] = {}
    for _ in range(repeats):
        for label, kw in contenders(device):
            peak, saved = measure_memory(hidden, weight, targets, kw, autocast)
            out[label] = (min(peak, out[label][0]) if label in out else peak, saved)
    return out


def memory_in_child(geometry: int, args) -> tuple[dict, bool]:
    """CPU: run :func:`memory_rows` in a fresh process with the glibc setting applied."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", str(geometry),
           "--dtype", args.dtype, "--tokens", str(args.tokens), "--repeats", str(args.memory_repeats)]
    rec = json.loads(run(cmd).check().stdout.strip().splitlines()[-1])
    return {k: tuple(v) for k, v in rec["rows"].items()}, rec["malloc_tuned"]


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds; each contender keeps its fastest")
    ap.add_argument("--memory-repeats", type=int, default=1, help="memory rounds; each keeps its smallest peak")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: fp32 inputs under bf16 autocast (as in training); fp32: no autocast")
    ap.add_argument("--tokens", type=int, default=0, help="override N for every geometry (0: as listed)")
    ap.add_argument("--memory-child", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    autocast = args.dtype == "bf16"

    if args.memory_child >= 0:  # the CPU memory pass, in its own process
        tuned = _malloc_returns_big_blocks()
        rows = memory_rows(args.memory_child, args.tokens, autocast, args.memory_repeats)
        print(json.dumps({"malloc_tuned": tuned, "rows": rows}))
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cores = n_cores()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        cpu_label(f"torch threads {torch.get_num_threads()}")
    cands = contenders(device)
    print(f"device {dev_name} · {'fp32 inputs, bf16 autocast' if autocast else 'fp32'} · {args.repeats} timed rounds")
    print(f"{'geometry':<12} {'contender':<31} {'ms':>9} {'peak MiB':>9} {'saved MiB':>9} {'x time':>7} "
          f"{'x peak':>7} {'x saved':>8} {'loss rel diff':>13}")
    rows, malloc_tuned = [], None
    for gi, (name, V, D, N) in enumerate(GEOMETRIES):
        N = args.tokens or N
        if device.type == "cpu":  # first, while this process holds nothing big
            mem, malloc_tuned = memory_in_child(gi, args)
        hidden, weight, targets = inputs(V, D, N, device)
        if device.type == "cuda":
            for label, kw in cands:  # warm-up: cuBLAS handles, Triton compiles
                fwd_bwd(hidden, weight, targets, kw, autocast)
        best: dict[str, float] = {}
        loss: dict[str, float] = {}
        for _ in range(args.repeats):
            for label, kw in cands:  # the contenders take turns within each round
                sync(device)
                t0 = time.perf_counter()
                value, grads = fwd_bwd(hidden, weight, targets, kw, autocast)
                sync(device)
                sec = time.perf_counter() - t0
                del grads
                best[label] = min(sec, best.get(label, sec))
                loss[label] = value.item()
        del hidden, weight, targets
        if device.type == "cuda":
            mem = memory_rows(gi, args.tokens, autocast, args.memory_repeats)
        for label, kw in cands:
            peak, saved = mem[label]
            row = dict(geometry=name, vocab=V, d_model=D, tokens=N, contender=label, **kw,
                       ms=1000 * best[label], peak_mib=peak / MiB, saved_mib=saved / MiB,
                       time_ratio=best[label] / best["plain"], peak_ratio=peak / mem["plain"][0],
                       saved_ratio=saved / mem["plain"][1], loss=loss[label],
                       loss_rel_diff=abs(loss[label] - loss["plain"]) / abs(loss["plain"]))
            rows.append(row)
            print(f"{name:<12} {label:<31} {row['ms']:>9.1f} {row['peak_mib']:>9.1f} {row['saved_mib']:>9.2f} "
                  f"{row['time_ratio']:>7.3f} {row['peak_ratio']:>7.3f} {row['saved_ratio']:>8.4f} "
                  f"{row['loss_rel_diff']:>13.2e}")

    result = {
        "dtype": "float32 inputs under bf16 autocast" if autocast else "float32",
        "repeats": args.repeats,
        "measure": {
            "ms": "fastest forward + backward (gradients w.r.t. hidden and weight) over the timed rounds",
            "peak_mib": "peak memory above the level before the call, gradients included, smallest over the "
                        "memory rounds; " + ("torch.cuda.max_memory_allocated, untimed pass" if device.type == "cuda"
                                             else "peak RSS (VmHWM after /proc/self/clear_refs) in a child process, "
                                                  f"glibc mmap threshold fixed at 1 MiB: {malloc_tuned}"),
            "saved_mib": "bytes autograd saves for backward (saved_tensors_hooks), each storage once, not counting "
                         "storage shared with hidden or weight: what is held from the loss forward to its backward",
        },
        "baseline": "plain: F.linear to the full (N, V) logits + float32 F.cross_entropy, summed (ratio = contender / "
                    "plain, same run)",
        "rows": rows,
    }
    save_result("chunked-ce", "cuda" if device.type == "cuda" else f"cpu{cores}", dev_name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
