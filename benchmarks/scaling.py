"""Data-parallel scaling: tokens/s of each strategy at N ranks against one process, same run.

For every strategy (ddp, zero1, fsdp2) and every N in ``--nproc`` the same config is
launched with ``torchrun --standalone --nproc-per-node=N -m flopwise train`` and its
steady tokens/s (after the warm-up steps: ``run.json``'s result) is read back. The
baseline is one process with ``parallel.strategy=single``, run in the same invocation,
with the same micro-batch per process and the same threads per process (on a CPU each
rank gets ``--threads`` threads; on a GPU each rank gets a GPU). Reported:

- ``speedup`` = tokens/s(N ranks) / tokens/s(one process);
- ``efficiency`` = speedup / N (1.0 = linear scaling);
- ``overhead_1`` = tokens/s(strategy at 1 rank) / tokens/s(single): what the wrapper costs
  with nobody to talk to (a one-rank process group, NCCL on a GPU) -- the only scaling
  figure a one-GPU machine can give.

The global batch grows with N (micro-batch x accumulation x N) so every rank does the same
work per step as the single process: weak scaling, the way data parallelism is used.

    python benchmarks/scaling.py                         # CPU: 1 and 2 ranks, tiny preset
    python benchmarks/scaling.py --preset smollm-360m --nproc 1 2 4 8 --steps 30   # a GPU node

Writes benchmarks/results/scaling-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from _results import cores as n_cores  # benchmarks/ is on sys.path when a script runs
from _results import cpu_label, save_result
from _run import run


def launch(nproc: int | None, overrides: list[str], threads: int, timeout_s: float = 3600) -> float:
    """Steady tokens/s of one run (None: one plain process), killed after ``timeout_s``."""
    env = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "OMP_NUM_THREADS": str(threads)}
    if nproc is None:
        cmd = [sys.executable, "-m", "flopwise", "train", *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "flopwise", "train", *overrides]
    ran = run(cmd, env=env, timeout_s=timeout_s)
    if not ran.ok:
        raise SystemExit(f"{ran.report(lines=60)}\ncommand: {' '.join(cmd)}")
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("train.run_dir="))
    tps = json.loads((Path(run_dir) / "run.json").read_text())["result"]["tok_per_s"]
    return float(tps or 0.0)  # 0: a run too short to measure after its warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--strategies", nargs="+", default=["ddp", "zero1", "fsdp2"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=0, help="per rank (default: the preset's)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step on each rank")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    ap.add_argument("--repeats", type=int, default=2, help="baseline and contenders take turns this many times")
    ap.add_argument("overrides", nargs="*", help="more section.key=value overrides (e.g. data.path=...)")
    args = ap.parse_args()

    from flopwise.config import build_config

    cfg = build_config(preset=args.preset, overrides=args.overrides)
    micro = args.micro_batch or cfg.train.micro_batch_size
    cuda = torch.cuda.is_available()
    if cuda and max(args.nproc) > torch.cuda.device_count():
        raise SystemExit(f"--nproc {max(args.nproc)} but {torch.cuda.device_count()} GPU(s) here")
    with tempfile.TemporaryDirectory() as tmp:
        def overrides(name: str, strategy: str, n: int) -> list[str]:
            return ["--preset", args.preset, *args.overrides, f"train.max_steps={args.steps}", f"train.micro_batch_size={micro}",
                    f"train.global_batch_size={micro * args.accum * n}", f"parallel.strategy={strategy}",
                    "eval.every=0", "eval.sample_tokens=0", f"eval.windows={micro}", "tracking.tensorboard=false",
                    "train.log_every=5", f"train.run_dir={Path(tmp) / name}"]

        rows: dict[tuple[str, int], list[float]] = {}
        single: list[float] = []
        for r in range(args.repeats):  # turns: this machine's speed drifts within minutes
            single.append(launch(None, overrides(f"single-{r}", "single", 1), args.threads))
            for strategy in args.strategies:
                for n in args.nproc:
                    tps = launch(n, overrides(f"{strategy}-{n}-{r}", strategy, n), args.threads)
                    rows.setdefault((strategy, n), []).append(tps)
        base = max(single)
        out_rows = []
        print(f"one process (single): {base:,.0f} tok/s (best of {args.repeats})")
        print(f"{'strategy':>8} {'ranks':>5} {'tok/s':>10} {'per rank':>10} {'speedup':>8} {'efficiency':>10}")
        for (strategy, n), values in rows.items():
            tps = max(values)
            row = {"strategy": strategy, "ranks": n, "tok_per_s": tps, "tok_per_s_per_rank": tps / n,
                   "speedup": tps / base, "efficiency": tps / base / n, "runs": values}
            if n == 1:
                row["overhead_1"] = tps / base
            out_rows.append(row)
            print(f"{strategy:>8} {n:>5} {tps:>10,.0f} {tps / n:>10,.0f} {tps / base:>8.2f} {tps / base / n:>10.2f}")
    device = (torch.cuda.get_device_name(0) if cuda else
              f"{cpu_label()}, {args.threads} thread(s) per rank")
    tag = (torch.cuda.get_device_name(0).split()[-1].lower() if cuda else f"cpu{n_cores()}")
    save_result("scaling", tag, device, {
        "preset": args.preset,
        "micro_batch_per_rank": micro, "accum": args.accum, "steps": args.steps, "overrides": args.overrides,
        "baseline": {"strategy": "single", "tok_per_s": base, "runs": single},
        "rows": out_rows,
    })


if __name__ == "__main__":
    main()
