"""Does preflight predict the run that follows? `flopwise preflight` on a config, then
`flopwise train --config preflight.yaml` (the tuned configuration, as written), on this
machine, in the same invocation: the run's measured tokens/s against preflight's prediction.

The run's rate is the median of its logged windows after the first (which holds the compile
and the warm-up steps preflight also leaves out). A ratio near 1 means a trial times the step
the run takes; the goal is within 5% on a CPU.

    python benchmarks/preflight_vs_run.py [--repeats 3] [--steps 80] [KEY=VALUE ...]

Each repeat runs preflight and the run afresh (the pair back to back); the JSON records
every pair and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _results import cores, cpu_label, save_result
from _run import run

TINY = ["train.log_every=10", "eval.every=0", "eval.sample_tokens=0", "tracking.tensorboard=false",
        "train.checkpoint_every=0"]


def flopwise(*args: str, cwd: Path) -> str:
    ran = run([sys.executable, "-m", "flopwise", *args], cwd=cwd)
    if not ran.ok:
        sys.exit(ran.report(lines=60))
    return ran.stdout


def run_rate(run_dir: Path) -> tuple[float, list[float]]:
    """Median tokens/s of the run's logged windows after the first, and all of them."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tok_per_s"] for r in rows if r.get("tok_per_s") and r.get("step")]
    if len(rates) < 3:
        sys.exit(f"{run_dir}: only {len(rates)} logged windows; raise --steps")
    return statistics.median(rates[1:]), rates


def one_pair(work: Path, steps: int, overrides: list[str]) -> dict:
    out = work / "preflight"
    flopwise("preflight", "--out", str(out), "--budget-minutes", "5", *TINY, *overrides, cwd=work)
    report = json.loads((out / "preflight.json").read_text())
    predicted = report["prediction"]["tok_per_s"]
    run_dir = work / "run"
    flopwise("train", "--config", str(out / "preflight.yaml"), f"train.run_dir={run_dir}",
             f"train.max_steps={steps}", *TINY, *overrides, cwd=work)
    measured, windows = run_rate(run_dir)
    tuned = report.get("chosen") or {}
    return {"predicted_tok_per_s": predicted, "run_tok_per_s": measured, "ratio_run_over_predicted":
            measured / predicted, "run_windows": windows, "chosen": tuned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80, help="the run's steps (logged every 10)")
    ap.add_argument("--label", default="", help="added to the record's name (e.g. the code measured)")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for both preflight and the run")
    args = ap.parse_args()
    pairs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="flopwise-pvr-") as tmp:
            pair = one_pair(Path(tmp), args.steps, args.overrides)
        pairs.append(pair)
        print(f"repeat {i + 1}: predicted {pair['predicted_tok_per_s']:,.0f} tok/s, run {pair['run_tok_per_s']:,.0f}"
              f" tok/s: run/predicted {pair['ratio_run_over_predicted']:.3f}")
    ratio = statistics.median(p["ratio_run_over_predicted"] for p in pairs)
    print(f"median run/predicted over {len(pairs)} pairs: {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")
    save_result("preflight-vs-run", f"cpu{cores()}" + (f"-{args.label}" if args.label else ""), cpu_label(),
                {"label": args.label, "overrides": args.overrides, "run_steps": args.steps, "pairs": pairs,
                 "median_ratio_run_over_predicted": ratio})


if __name__ == "__main__":
    main()
