"""Training-batch loaders: assembly throughput and the share of a step spent waiting for data.

On the embedded corpus (Python's stdlib source, 8,192-token BPE, prepared once under
~/.cache/flopwise) and for two geometries -- the tiny preset's micro-batch (seq 128 x 16)
and seq 2048 x 8 -- it measures:

1. **Assembly throughput** (tokens/s put into ``(x, y)`` batches by ``next_batch()``,
   nothing else running) for ``RandomWindowLoader`` and ``EpochLoader``, prefetch off and
   on.  Baseline: plain numpy slicing of the *same* windows into an int64 buffer plus the
   ``x``/``y`` split, positions computed beforehand (no loader bookkeeping at all).
2. **Step share**: the tiny preset's model, one forward + backward per batch (as in
   ``flopwise.train.train_step.forward_backward``), timing ``next_batch()`` apart from the
   compute; the share is wait / (wait + compute).  Baseline: the same steps on batches
   assembled beforehand (no wait).  The ratio column is step time / baseline step time.

    python benchmarks/loader.py [--batches 300] [--steps 10] [--long-steps 2] [--rounds 2]

Prints a table and writes benchmarks/results/loader-<device>-<date>.json.  On a CUDA
machine the steps run on the GPU (batches copied from pinned memory, prefetch copies on
a side stream); assembly throughput always includes the copy to the step's device.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _results import cores as n_cores  # benchmarks/ is on sys.path when a script runs
from _results import cpu_label, save_result

from flopwise.config import build_config
from flopwise.data.builtin import prepare_builtin
from flopwise.data.datadir import DataDir
from flopwise.data.loader import LoaderOptions, make_loader
from flopwise.model import build_model
from flopwise.train.train_step import forward_backward


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_slicing(shards, plans, seq_len: int, device: torch.device) -> float:
    """Seconds to assemble ``plans`` (list of (shard, offset) arrays) with bare numpy slicing."""
    w = seq_len + 1
    t = time.perf_counter()
    for shard, offset in plans:
        buf = np.empty((len(shard), w), dtype=np.int64)
        for i, (s, o) in enumerate(zip(shard.tolist(), offset.tolist())):
            buf[i] = shards[s][o : o + w]
        tok = torch.from_numpy(buf)
        if device.type == "cuda":
            tok = tok.pin_memory().to(device, non_blocking=True)
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    sync(device)
    return time.perf_counter() - t


def loader_time(make, n: int, device: torch.device) -> float:
    loader = make()
    loader.next_batch()  # thread start, first memory-map touches
    t = time.perf_counter()
    for _ in range(n):
        loader.next_batch()
    sync(device)
    sec = time.perf_counter() - t
    if hasattr(loader, "close"):
        loader.close()
    return sec


def step_times(model, next_batch, steps: int, tokens: int, device: torch.device) -> tuple[float, float]:
    """(seconds waiting for next_batch, total seconds) over ``steps`` forward+backward steps."""
    x, y = next_batch()[:2]  # warm-up step, not timed
    forward_backward(model, [(x, y)], tokens)
    model.zero_grad(set_to_none=True)
    sync(device)
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next_batch()[:2]
        wait += time.perf_counter() - t
        forward_backward(model, [(x, y)], tokens)
        model.zero_grad(set_to_none=True)
    sync(device)
    return wait, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=300, help="batches per throughput measurement (seq 128)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per step-share round (seq 128)")
    ap.add_argument("--long-steps", type=int, default=2, help="training steps per round at seq 2048")
    ap.add_argument("--repeats", type=int, default=3, help="throughput: best of this many")
    ap.add_argument("--rounds", type=int, default=2, help="step share: best of this many rounds")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cores = n_cores()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        cpu_label(f"torch threads {torch.get_num_threads()}")

    dd = DataDir(prepare_builtin(Path("~/.cache/flopwise").expanduser(), vocab_size=8192, max_mb=0.0,
                                 log=lambda s: None))
    cfg = build_config("tiny")
    shards = dd.shards("train")
    print(f"data: {dd.path} · train {dd.num_tokens('train'):,} tokens · device {dev_name}")
    rows = []
    loaders = [("random", False), ("random", True), ("epoch", False), ("epoch", True)]

    def row(**kw):
        rows.append(kw)
        extra = f"{kw['wait_share'] * 100:>8.2f}%" if "wait_share" in kw else f"{'':>9}"
        rate = f"{kw['tok_per_s'] / 1e6:>9.2f}" if kw.get("tok_per_s") else f"{'':>9}"
        ms = f"{kw['step_ms']:>9.1f}" if "step_ms" in kw else f"{'':>9}"
        print(f"{kw['geometry']:<9} {kw['measure']:<10} {kw['what']:<34} {rate} {ms} {extra} {kw['ratio']:>7.3f}")

    print(f"{'geometry':<9} {'measure':<10} {'what':<34} {'Mtok/s':>9} {'ms/step':>9} {'wait':>9} {'ratio':>7}")
    for seq, mb, steps, n_batches in ((128, 16, args.steps, args.batches),
                                      (2048, 8, args.long_steps, max(20, args.batches // 8))):
        geo = f"{seq}x{mb}"
        tokens = seq * mb

        # -- 1. assembly throughput
        for mode in ("random", "epoch"):
            probe = make_loader(mode, dd, "train", LoaderOptions(seq, mb, seed=0))
            plans = [probe._draw() for _ in range(n_batches)]  # the windows the loader will read
            plain_slicing(shards, plans, seq, device)  # touch the pages once: every row then reads warm
            base = min(plain_slicing(shards, plans, seq, device) for _ in range(args.repeats))
            row(geometry=geo, measure="assembly", what=f"baseline: numpy slicing ({mode} windows)",
                tok_per_s=n_batches * tokens / base, seconds=base, batches=n_batches, ratio=1.0)
            for prefetch in (False, True):
                opts = LoaderOptions(seq, mb, seed=0, device=device, prefetch=prefetch)
                sec = min(loader_time(lambda: make_loader(mode, dd, "train", opts), n_batches, device)
                          for _ in range(args.repeats))
                row(geometry=geo, measure="assembly", what=f"{mode} loader, prefetch {'on' if prefetch else 'off'}",
                    mode=mode, prefetch=prefetch, tok_per_s=n_batches * tokens / sec, seconds=sec,
                    batches=n_batches, ratio=base / sec)

        # -- 2. share of a training step spent waiting for data.  The configurations take
        # turns for ``--rounds`` rounds and each keeps its fastest round, so a burst of
        # load from elsewhere on the machine does not land on one configuration only.
        mcfg = dataclasses.replace(cfg.model, max_seq_len=max(seq, cfg.model.max_seq_len))
        model = build_model(mcfg, device=device, seed=0)
        pre = make_loader("random", dd, "train", LoaderOptions(seq, mb, seed=0, device=device))
        ready = [pre.next_batch() for _ in range(steps + 1)]
        best: dict[tuple, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for key in [("baseline", False), *loaders]:
                if key[0] == "baseline":
                    it = iter(ready)
                    wait, total = step_times(model, lambda: next(it), steps, tokens, device)
                else:
                    opts = LoaderOptions(seq, mb, seed=0, device=device, prefetch=key[1])
                    loader = make_loader(key[0], dd, "train", opts)
                    wait, total = step_times(model, loader.next_batch, steps, tokens, device)
                    loader.close()
                if key not in best or total < best[key][1]:
                    best[key] = (wait, total)
        wait, total = best[("baseline", False)]
        base_step = total / steps
        row(geometry=geo, measure="step", what="baseline: batches assembled beforehand", step_ms=1000 * base_step,
            wait_ms=1000 * wait / steps, wait_share=wait / total, steps=steps, rounds=args.rounds, ratio=1.0)
        for mode, prefetch in loaders:
            wait, total = best[(mode, prefetch)]
            row(geometry=geo, measure="step", what=f"{mode} loader, prefetch {'on' if prefetch else 'off'}",
                mode=mode, prefetch=prefetch, step_ms=1000 * total / steps, wait_ms=1000 * wait / steps,
                wait_share=wait / total, steps=steps, rounds=args.rounds, ratio=total / steps / base_step)

    result = {
        "numpy": np.__version__,
        "data": {"path": str(dd.path), "train_tokens": dd.num_tokens("train"), "vocab_size": dd.vocab_size},
        "model": "tiny preset (max_seq_len raised to the sequence length), one forward+backward per batch",
        "baseline": {
            "assembly": "plain numpy slicing of the same windows into an int64 buffer + x/y split (ratio = "
                        "loader tokens/s / baseline tokens/s)",
            "step": "the same steps on batches assembled beforehand (ratio = step time / baseline step time)",
        },
        "rows": rows,
    }
    save_result("loader", "cuda" if device.type == "cuda" else f"cpu{cores}", dev_name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
