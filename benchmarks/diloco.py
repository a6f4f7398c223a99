"""DiLoCo against DDP: the same model on the same tokens, its validation loss, the bytes sent
across worker groups and tokens/s.

For every N in ``--nproc`` (default 2 and 4 processes on CPU, ``torchrun --standalone``) the
baseline is ``parallel.strategy=ddp`` over N ranks; the contenders are
``parallel.strategy=diloco`` with 2 worker groups of N/2 ranks (DDP inside each), one per
``--contenders`` entry H:lr:momentum -- by default H = 10 and 50 with the paper's outer
Nesterov SGD (lr 0.7, momentum 0.9), and H = 50 with momentum 0.5, which did better on this
small model. Every run takes the same number of steps of the same global batch from the
same loader positions (ranks draw by their global rank), so the tokens are equal; the held-out
set is the same (``eval.batches`` x micro-batch windows, held constant).

Bytes are the **payload all-reduced across groups, summed over ranks** -- what a slow link
between the groups carries (a ring all-reduce sends 2(n-1)/n of its payload):

- ddp: every rank all-reduces its whole fp32 gradient with every other rank once per step
  (DDP's buckets hold every trainable parameter; ``no_sync`` keeps accumulation local):
  N x 4 x P bytes per step, computed from P;
- diloco: what the run itself counted (``outer_bytes_total`` in metrics.jsonl): once per H
  steps each rank sends its 1/(N/2) slice of the pseudo-gradient to its peer in the other
  group. DiLoCo's in-group all-reduce (on the fast link, every step) is listed apart.

Reported: final validation loss and its ratio to ddp's, cross-group bytes and the ratio
ddp/diloco, tokens/s (``run.json``: after warm-up). On a 2-core CPU the 4-process runs share
2 cores, so their tokens/s says little about a real cluster; the loss and the bytes do.

    python benchmarks/diloco.py                       # CPU: tiny preset, 300 steps, N = 2 and 4
    python benchmarks/diloco.py --steps 600 --contenders 50:0.7:0.9 100:0.7:0.9

Writes benchmarks/results/diloco-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from _results import cores as n_cores  # benchmarks/ is on sys.path when a script runs
from _results import cpu_label, save_result
from scaling import launch

VAL_WINDOWS = 256  # held-out windows, the same set at every micro-batch size


def last_row(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--contenders", nargs="+", default=["10:0.7:0.9", "50:0.7:0.9", "50:0.7:0.5"],
                    help="DiLoCo runs as H:outer_lr:outer_momentum")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    ap.add_argument("overrides", nargs="*", help="more section.key=value overrides (e.g. data.path=...)")
    args = ap.parse_args()

    from flopwise.config import build_config
    from flopwise.plan.flops import param_counts

    cfg = build_config(preset=args.preset, overrides=args.overrides)
    n_params = param_counts(cfg.model)["total"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nproc:
            def overrides(name: str, *extra: str, micro: int = args.global_batch // n) -> list[str]:
                return ["--preset", args.preset, *args.overrides, f"train.max_steps={args.steps}",
                        f"train.micro_batch_size={micro}", f"train.global_batch_size={args.global_batch}",
                        "eval.every=0", "eval.sample_tokens=0", f"eval.batches={VAL_WINDOWS // micro}",
                        "tracking.tensorboard=false", "train.log_every=10", "train.checkpoint_every=0",
                        f"train.run_dir={Path(tmp) / name}", *extra]

            base_dir = Path(tmp) / f"ddp-{n}"
            tps = launch(n, overrides(f"ddp-{n}", "parallel.strategy=ddp"), args.threads)
            base = json.loads((base_dir / "run.json").read_text())["result"]
            tokens = base["tokens"]
            ddp_bytes = n * 4 * n_params * args.steps
            rows.append({"strategy": "ddp", "nproc": n, "val_loss": base["val_loss_end"], "tok_per_s": tps,
                         "tokens": tokens, "cross_group_bytes": ddp_bytes, "cross_group_bytes_per_token":
                         ddp_bytes / tokens, "bytes_counted": "N x 4 x P per step (DDP's gradient all-reduce)"})
            print(f"ddp    N={n}: val {base['val_loss_end']:.4f} · {ddp_bytes / 2**20:,.1f} MiB across · "
                  f"{tps:,.0f} tok/s")
            for contender in args.contenders:
                h, lr, mu = int(contender.split(":")[0]), *map(float, contender.split(":")[1:])
                name = f"diloco-{n}-h{h}-lr{lr:g}-m{mu:g}"
                tps = launch(n, overrides(name, "parallel.strategy=diloco", f"parallel.group_size={n // 2}",
                                          f"parallel.inner_steps={h}", f"parallel.outer_lr={lr}",
                                          f"parallel.outer_momentum={mu}"), args.threads)
                res = json.loads((Path(tmp) / name / "run.json").read_text())["result"]
                last = last_row(Path(tmp) / name)
                sent = last["outer_bytes_total"]
                in_group = n * 4 * n_params * args.steps if n > 2 else 0  # DDP inside each group of N/2
                rows.append({"strategy": "diloco", "nproc": n, "groups": 2, "group_size": n // 2, "inner_steps": h,
                             "outer_lr": lr, "outer_momentum": mu,
                             "val_loss": res["val_loss_end"],
                             "val_loss_vs_ddp": res["val_loss_end"] / base["val_loss_end"],
                             "tok_per_s": tps, "tokens": res["tokens"], "outer_steps": last["outer_steps"],
                             "cross_group_bytes": sent, "cross_group_bytes_per_token": sent / res["tokens"],
                             "fewer_bytes_than_ddp": ddp_bytes / sent, "in_group_bytes": in_group,
                             "bytes_counted": "the run's outer_bytes_total (metrics.jsonl)"})
                assert res["tokens"] == tokens, (res["tokens"], tokens)
                off = 100 * (res["val_loss_end"] / base["val_loss_end"] - 1)
                print(f"diloco N={n} H={h} lr {lr:g} m {mu:g}: val {res['val_loss_end']:.4f} ({off:+.2f}% vs ddp) · "
                      f"{sent / 2**20:,.2f} MiB across ({ddp_bytes / sent:.0f}x fewer) · {tps:,.0f} tok/s")
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"{cpu_label()}, {args.threads} thread(s) per rank"
    tag = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else f"cpu{n_cores()}"
    save_result("diloco", tag, device, {
        "preset": args.preset, "params": n_params, "steps": args.steps, "global_batch": args.global_batch,
        "overrides": args.overrides, "outer_dtype": "fp32", "rows": rows})


if __name__ == "__main__":
    main()
