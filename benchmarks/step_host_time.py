"""Host time of one training step: flopwise's loop against a plain PyTorch loop, on a CPU.

The model is so small (1 layer, d_model 32, 2 x 16 tokens a step) that its arithmetic takes
little of a step: what is left is what the host does around it -- the work a GPU step waits on
when the model is small. Two contenders, same model, weights, batches, precision (float32)
and optimizer (fused AdamW, decay on matrices only), one thread, no compile:

- ``flopwise``: ``flopwise.train.trainer.train`` itself, as ``flopwise train`` runs it
  (``train_step``, the one-step-late read, the guard, the hooks that decide what is due).
  A step's time is the time between two consecutive steps' calls to the deadline's
  ``record_step`` (each loop iteration makes one), so it holds the whole iteration; steps that
  log or save are among them and the median leaves them out.
- ``plain``: what a competent user writes -- the same loader's ``next_batch()``, forward,
  float32 cross-entropy, backward, the learning rate set, ``optimizer.step()``,
  ``zero_grad(set_to_none=True)``, and the loss kept on the device (no ``.item()``).

Each round runs both contenders (taking turns: which goes first alternates), each for
``--steps`` steps after ``--warmup`` steps left out; the figure per contender is the median over
rounds of each round's median step (the fastest round's median is kept beside it: on a busy
machine it is the least disturbed). Each step is timed twice: in this process's CPU time -- the
host's work, which other processes sharing the cores do not lengthen: the figure compared -- and
in wall time. The ratio is flopwise / plain.

    python benchmarks/step_host_time.py [--steps 400] [--warmup 50] [--rounds 3] [--label before]

Prints a table and writes benchmarks/results/step-host-time-<label>-cpu<N>-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import cores, cpu_label, save_result  # benchmarks/ is on sys.path when a script runs

from flopwise.config import build_config
from flopwise.data.datadir import open_data_dir
from flopwise.data.loader import LoaderOptions, make_loader
from flopwise.model import build_model
from flopwise.train import stopping
from flopwise.train.optim import param_groups
from flopwise.train.trainer import train

CACHE = Path("~/.cache/flopwise").expanduser()
SHAPE = ["data.builtin_vocab_size=512", "data.builtin_max_mb=0.6", "model.vocab_size=512", "model.d_model=32",
         "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "model.max_seq_len=16",
         "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=2", "train.precision=float32",
         "train.compile=off", "train.threads=1", "train.device=cpu", "optim.fused=true", "eval.windows=4",
         "eval.every=0", "eval.sample_tokens=0", "train.checkpoint_every=0", "optim.warmup_steps=5"]


def config(steps: int, run_dir: Path):
    return build_config(overrides=[f"data.cache_dir={CACHE}", *SHAPE, f"train.max_steps={steps}",
                                   f"train.log_every={max(1, steps // 4)}", f"train.run_dir={run_dir}"])


def now() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a shared machine the CPU time is the host's
    work itself, which other processes taking turns on the cores do not lengthen."""
    return time.perf_counter(), time.process_time()


def gaps(stamps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps, stamps[1:])]


def flopwise_steps(steps: int, warmup: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds per loop iteration of ``flopwise.train.trainer.train``, warm-up left out."""
    stamps: list[tuple[float, float]] = []
    record = stopping.Deadline.record_step

    def stamped(self, step_s: float) -> None:
        stamps.append(now())
        record(self, step_s)

    stopping.Deadline.record_step = stamped  # type: ignore[method-assign]  # the loop's own once-a-step call
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train(config(warmup + steps + 1, Path(tmp) / "run"), log=lambda s: None, fresh=True)
    finally:
        stopping.Deadline.record_step = record  # type: ignore[method-assign]
    return gaps(stamps)[warmup:]


def plain_steps(steps: int, warmup: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds per step of a plain PyTorch loop over the same model, batches and optimizer."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(warmup + steps, Path(tmp) / "run")
    t, o = cfg.train, cfg.optim
    data = open_data_dir(cfg.data, log=lambda s: None)
    loader = make_loader(cfg.data.loader, data, "train", LoaderOptions(t.seq_len, t.micro_batch_size, seed=t.seed))
    model = build_model(cfg.model, device=torch.device("cpu"), seed=t.seed)
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            fused=True)
    losses = []
    stamps = [now()]
    for i in range(warmup + steps):
        for g in opt.param_groups:
            g["lr"] = o.lr * min(1.0, (i + 1) / o.warmup_steps)
        batch = loader.next_batch()
        x, y = batch[0], batch[1]
        logits = model(x) if len(batch) < 3 else model(x, batch[2])
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        stamps.append(now())
    torch.stack(losses).sum().item()  # used once, at the end, as a training script's log would
    return gaps(stamps)[warmup:]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="", help="a tag in the file name: before, after")
    args = ap.parse_args()
    torch.set_num_threads(1)
    contenders = {"flopwise": flopwise_steps, "plain": plain_steps}
    runs: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "wall": []} for k in contenders}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            steps = contenders[name](args.steps, args.warmup)
            runs[name]["wall"].append(statistics.median(w for w, _ in steps))
            runs[name]["cpu"].append(statistics.median(c for _, c in steps))
            print(f"round {r + 1}: {name:8s} CPU {1000 * runs[name]['cpu'][-1]:.3f} ms/step, "
                  f"wall {1000 * runs[name]['wall'][-1]:.3f} ms/step")
    ms = {k: {kind: 1000 * statistics.median(v) for kind, v in d.items()} for k, d in runs.items()}
    ratio = {kind: ms["flopwise"][kind] / ms["plain"][kind] for kind in ("cpu", "wall")}
    print(f"\n{'contender':10s} {'CPU ms/step':>12s} {'wall ms/step':>13s}   (medians of round medians)")
    for k, d in ms.items():
        print(f"{k:10s} {d['cpu']:12.3f} {d['wall']:13.3f}")
    fastest = min(runs["flopwise"]["cpu"]) / min(runs["plain"]["cpu"])
    print(f"fastest rounds' CPU ratio {fastest:.3f}")
    print(f"ratio flopwise / plain: CPU {ratio['cpu']:.3f}, wall {ratio['wall']:.3f}; flopwise's extra host time "
          f"{ms['flopwise']['cpu'] - ms['plain']['cpu']:.3f} ms/step (CPU)")
    tag = f"{args.label}-cpu{cores()}" if args.label else f"cpu{cores()}"
    save_result("step-host-time", tag, cpu_label("1 torch thread"), {
        "commit": commit(), "label": args.label, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds, "config": SHAPE,
        "rows": [{"contender": k, "cpu_ms_per_step": round(ms[k]["cpu"], 4),
                  "wall_ms_per_step": round(ms[k]["wall"], 4),
                  "cpu_ms_fastest_round": round(1000 * min(d["cpu"]), 4),
                  "cpu_ms_rounds": [round(1000 * v, 4) for v in d["cpu"]],
                  "wall_ms_rounds": [round(1000 * v, 4) for v in d["wall"]]} for k, d in runs.items()],
        "ratio_flopwise_to_plain_cpu": round(ratio["cpu"], 4),
        "ratio_flopwise_to_plain_wall": round(ratio["wall"], 4),
        "ratio_flopwise_to_plain_cpu_fastest_rounds": round(fastest, 4),
        "extra_cpu_ms_per_step": round(ms["flopwise"]["cpu"] - ms["plain"]["cpu"], 4),
    })


if __name__ == "__main__":
    main()
