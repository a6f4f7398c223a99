"""DiLoCo against DDP: the same model on the same tokens, its validation loss, the bytes sent
across worker groups and tokens/s.

For every N in ``--nproc`` (default 2 and 4 processes on CPU, ``torchrun --standalone``) the
baseline is ``parallel.strategy=ddp`` over N ranks; the contenders are
``parallel.strategy=diloco`` with 2 worker groups of N/2 ranks (DDP inside each), one per
``--contenders`` entry H:lr:momentum -- by default H = 10 and 50 with the paper's outer
Nesterov SGD (lr 0.7, momentum 0.9), and H = 50 with momentum 0.5, which did better on this
small model. Every run takes the same number of steps of the same global batch from the
same loader positions (ranks draw by their global rank), so the tokens are equal; the held-out
set is the same (``eval.windows``, held constant).

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

``--global-batch`` and ``--lr`` (the inner AdamW's, ddp's alike) take several values and run
every combination. A fair verdict compares each method at its best learning rate for the batch:
ddp's best rises with the batch, and a baseline left at the preset's rate flatters DiLoCo.

    python benchmarks/diloco.py                       # CPU: tiny preset, 300 steps, N = 2 and 4
    python benchmarks/diloco.py --steps 600 --contenders 50:0.7:0.9 100:0.7:0.9
    python benchmarks/diloco.py --nproc 4 --global-batch 32 128 --lr 3e-3 6e-3 --contenders 50:0.7:0.5

At a real token budget (issue 53): ``--tokens-per-param 20`` sets the steps from the model's
parameters, ``--groups 2 4`` runs DiLoCo with M groups of N/M ranks each, and ``--work DIR``
keeps every run's directory: a run already finished there is read back, not run again, and one
cut short (a killed benchmark, the end of a session) resumes from its latest checkpoint
(``--checkpoint-every``). So an hours-long comparison can be run piece by piece:

    python benchmarks/diloco.py --work ~/diloco-20tpp --tokens-per-param 20 --checkpoint-every 500 \
        model.d_model=96 ... --nproc 2 --groups 2 --lr 4.2e-3 --diloco-lr 4.2e-3 6e-3 --contenders 30:0.7:0.5

``--diloco-lr`` gives DiLoCo inner rates of its own, each against the one ddp at ``--lr``: at 20
tokens per parameter DiLoCo's best rate was 1.4x ddp's (docs/distributed.md has the records).

Writes benchmarks/results/diloco-<device>-<date>.json (``--json-out`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
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


def finished(run_dir: Path, steps: int) -> dict | None:
    """run.json of a run in ``run_dir`` that trained all ``steps`` (a --work directory's), or None."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return record if (record.get("result") or {}).get("steps") == steps else None


def wall_s(record: dict) -> float:
    """Seconds the run took, over every start of it (a --work run resumed across calls has several):
    a start that ended records its wall time; one that was killed, only its log rows' clock
    (``elapsed_s`` restarts at each start), so its last row's stands for it."""
    starts = record.get("starts") or []
    clocks: list[float] = []  # the last elapsed_s of each start's rows
    for line in (Path(record["result"]["run_dir"]) / "metrics.jsonl").read_text().splitlines():
        t = json.loads(line).get("elapsed_s")
        if t is None:
            continue
        if not clocks or t < clocks[-1]:
            clocks.append(t)
        clocks[-1] = t
    return sum(float(s["wall_time_s"]) if s.get("wall_time_s") is not None else (clocks[i] if i < len(clocks) else 0.0)
               for i, s in enumerate(starts))


def compare(args, tmp: Path, n: int, batch: int, lr: float, n_params: int) -> list[dict]:
    """ddp at one inner learning rate and every contender at each of ``--diloco-lr`` (default:
    the same), at N processes and one global batch."""
    micro = batch // n

    def launch_run(name: str, lr: float, *extra: str) -> tuple[dict, float]:
        done = finished(tmp / name, args.steps)
        if done is not None:  # --work: finished before, read back
            print(f"{name}: finished in {tmp / name}, read back")
            return done, float(done["result"]["tok_per_s"] or 0.0)
        tps = launch(n, ["--preset", args.preset, *args.overrides, f"train.max_steps={args.steps}",
                         f"train.micro_batch_size={micro}", f"train.global_batch_size={batch}",
                         f"optim.lr={lr}",
                         "eval.every=0", "eval.sample_tokens=0", f"eval.windows={args.val_windows}",
                         "tracking.tensorboard=false", "train.log_every=10",
                         f"train.checkpoint_every={args.checkpoint_every}", "train.keep_checkpoints=2",
                         f"train.run_dir={tmp / name}", *extra], args.threads, args.timeout_h * 3600)
        return json.loads((tmp / name / "run.json").read_text()), tps

    run, tps = launch_run(f"ddp-{n}-b{batch}-lr{lr:g}", lr, "parallel.strategy=ddp")
    base = run["result"]
    same = {"nproc": n, "global_batch": batch, "steps": args.steps}
    ddp_bytes = n * 4 * n_params * args.steps
    rows = [{"strategy": "ddp", **same, "inner_lr": lr, "val_loss": base["val_loss_end"], "tok_per_s": tps,
             "wall_s": wall_s(run), "tokens": base["tokens"],
             "cross_group_bytes": ddp_bytes, "cross_group_bytes_per_token": ddp_bytes / base["tokens"],
             "bytes_counted": "N x 4 x P per step (DDP's gradient all-reduce)"}]
    print(f"ddp    N={n} batch {batch} lr {lr:g}: val {base['val_loss_end']:.4f} · "
          f"{ddp_bytes / 2**20:,.1f} MiB across · {tps:,.0f} tok/s · {wall_s(run):,.0f} s")
    groups_here = [m for m in args.groups if n % m == 0 and m > 1 and args.group_size in (0, n // m)]
    runs = [(m, c, d) for m in groups_here for d in args.diloco_lr or [lr] for c in args.contenders]
    for groups, contender, dlr in runs:
        h, olr, mu = int(contender.split(":")[0]), *map(float, contender.split(":")[1:])
        size = n // groups
        name = f"diloco-{n}-b{batch}-lr{dlr:g}-m{groups}-h{h}-lr{olr:g}-mu{mu:g}"
        run, tps = launch_run(name, dlr, "parallel.strategy=diloco", f"parallel.group_size={size}",
                              f"parallel.inner_steps={h}", f"parallel.outer_lr={olr}", f"parallel.outer_momentum={mu}")
        res, last = run["result"], last_row(tmp / name)
        sent = last["outer_bytes_total"]
        in_group = n * 4 * n_params * args.steps if size > 1 else 0  # DDP inside each group
        assert res["tokens"] == base["tokens"], (res["tokens"], base["tokens"])
        rows.append({"strategy": "diloco", **same, "inner_lr": dlr, "ddp_lr": lr, "groups": groups, "group_size": size,
                     "inner_steps": h,
                     "outer_lr": olr, "outer_momentum": mu, "val_loss": res["val_loss_end"],
                     "val_loss_vs_ddp": res["val_loss_end"] / base["val_loss_end"], "tok_per_s": tps,
                     "wall_s": wall_s(run), "tokens": res["tokens"], "outer_steps": last["outer_steps"],
                     "cross_group_bytes": sent,
                     "cross_group_bytes_per_token": sent / res["tokens"], "fewer_bytes_than_ddp": ddp_bytes / sent,
                     "in_group_bytes": in_group, "bytes_counted": "the run's outer_bytes_total (metrics.jsonl)"})
        off = 100 * (res["val_loss_end"] / base["val_loss_end"] - 1)
        print(f"diloco N={n} M={groups} batch {batch} lr {dlr:g} H={h} outer {olr:g}/{mu:g}: "
              f"val {res['val_loss_end']:.4f} "
              f"({off:+.2f}% vs ddp) · {sent / 2**20:,.2f} MiB across ({ddp_bytes / sent:.0f}x fewer) · "
              f"{tps:,.0f} tok/s · {wall_s(run):,.0f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--contenders", nargs="+", default=["10:0.7:0.9", "50:0.7:0.9", "50:0.7:0.5"],
                    help="DiLoCo runs as H:outer_lr:outer_momentum")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, nargs="+", default=[32], help="sequences per step over all ranks")
    ap.add_argument("--lr", type=float, nargs="+", default=None,
                    help="inner (AdamW) learning rates, each for ddp and DiLoCo alike (default: the preset's)")
    ap.add_argument("--diloco-lr", type=float, nargs="+", default=None,
                    help="DiLoCo's inner learning rates, each against ddp at every --lr (default: ddp's own)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    ap.add_argument("--groups", type=int, nargs="+", default=[2], help="DiLoCo's worker groups M (of N/M ranks)")
    ap.add_argument("--group-size", type=int, default=0,
                    help="only the M of --groups with this many ranks per group at each N (0: every M dividing N)")
    ap.add_argument("--tokens-per-param", type=float, default=0.0,
                    help="train this many tokens per parameter (sets the steps; 0: --steps)")
    ap.add_argument("--work", default="", help="keep the runs here: finished ones are read back, others resume")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="steps between a run's checkpoints (resume points)")
    ap.add_argument("--timeout-h", type=float, default=12.0, help="a run still going after this long is stopped")
    ap.add_argument("--val-windows", type=int, default=VAL_WINDOWS, help="held-out windows (the same set for all)")
    ap.add_argument("--json-out", default="", help="write the record here instead of benchmarks/results/")
    ap.add_argument("overrides", nargs="*", help="more section.key=value overrides (e.g. data.path=...)")
    args = ap.parse_args()

    from flopwise.config import build_config
    from flopwise.plan.flops import param_counts

    cfg = build_config(preset=args.preset, overrides=args.overrides)
    n_params = param_counts(cfg.model)["total"]
    if args.tokens_per_param:
        per_step = max(args.global_batch) * cfg.train.seq_len  # the largest batch's steps; smaller ones train less
        args.steps = max(1, round(args.tokens_per_param * n_params / per_step))
        print(f"{args.tokens_per_param:g} tokens/parameter of {n_params:,}: {args.steps} steps")
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        tmp.mkdir(parents=True, exist_ok=True)
        for n in args.nproc:
            for batch in args.global_batch:
                for lr in args.lr or [cfg.optim.lr]:
                    rows += compare(args, tmp, n, batch, lr, n_params)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"{cpu_label()}, {args.threads} thread(s) per rank"
    tag = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else f"cpu{n_cores()}"
    result = {"preset": args.preset, "params": n_params, "steps": args.steps, "overrides": args.overrides,
              "tokens_per_param": args.tokens_per_param or None, "outer_dtype": "fp32", "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"benchmark": "diloco", "device": device, **result}, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    else:
        save_result("diloco", tag, device, result)


if __name__ == "__main__":
    main()
