"""Host syncs per training step: ``flopwise train`` under ``torch.cuda.set_sync_debug_mode("warn")``.

Runs the same short training twice (``--short`` and ``--long`` steps, logging only at the end)
and counts the "called a synchronizing CUDA operation" warnings of each; the difference over
the extra steps is the steady-state count per step (start-up, the final evaluation and the
checkpoint cancel out). Prints one JSON line: ``{"syncs_per_step": ..., "short": n, "long": n}``.

    PYTHONPATH=src python benchmarks/gpu/sync_probe.py --short 10 --long 30 -- --preset tiny KEY=VALUE...
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings


def count_syncs(train_args: list[str]) -> int:
    import torch

    from flopwise.cli import main as cli_main

    seen = 0

    def show(message, category, filename, lineno, file=None, line=None):
        nonlocal seen
        if "synchroniz" in str(message):
            seen += 1

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    rc = cli_main(["train", *train_args])
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    if rc not in (0, None):
        raise SystemExit(f"flopwise train exited {rc}")
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", type=int, default=10)
    ap.add_argument("--long", type=int, default=30)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then flopwise train arguments")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    counts = {}
    for label, steps in (("short", args.short), ("long", args.long)):
        counts[label] = count_syncs(rest + [f"train.max_steps={steps}", f"train.log_every={10 * args.long}",
                                            f"train.run_dir={args.run_dir}-{label}", "--fresh"])
    per_step = (counts["long"] - counts["short"]) / (args.long - args.short)
    print(json.dumps({"syncs_per_step": per_step, **counts, "steps": [args.short, args.long]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
