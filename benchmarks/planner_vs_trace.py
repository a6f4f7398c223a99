"""The planner's memory against the dry run's trace, for every preset on an 80 GB and a 24 GB GPU.

Not a speed benchmark: a table of **traced** figures (fake tensors; nothing runs on a GPU),
for docs/planning.md. For each preset at its own sequence length, as a CUDA run of it would
take the step (compile, loss and attention as ``auto`` resolves them on that GPU, one GPU):

- the planner's largest micro-batch under 90% of the GPU's memory (``plan.memory.max_micro_batch``,
  modelling the step as it runs: compiled) and the trace's (``flopwise preflight --dry-run``'s
  search, which traces eager steps: an upper bound of the compiled step's memory);
- at micro-batch 1, the planner's peak against the traced eager peak and the compiled one.

    python benchmarks/planner_vs_trace.py [--gpus h100,l4] [--presets smollm-135m,...]

Writes benchmarks/results/planner-vs-trace-traced-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys

from _results import save_result  # benchmarks/ is on sys.path when a script runs

from flopwise.config import build_config, preset_names
from flopwise.plan.budget import memory_settings_for_run
from flopwise.plan.memory import max_micro_batch
from flopwise.tune.dryrun import dry_run, gpu_spec

HEADROOM = 0.9


def one(preset: str, gpu: str) -> dict:
    spec = gpu_spec(gpu)
    cfg = build_config(preset, overrides=["train.micro_batch_size=1", "train.global_batch_size=2"])
    result = dry_run(cfg, gpu=gpu, headroom=HEADROOM, log=lambda s: None)
    cfg.train.compile = result["compile"]  # as auto resolved it on that GPU: the planner models the compiled step
    settings = memory_settings_for_run(cfg, result["precision"], result["loss"], result["strategy"], 1)
    planned_max = max_micro_batch(cfg.model, cfg.train.seq_len, spec.memory_bytes, settings, headroom=HEADROOM)
    t = result["trace"]
    return {"preset": preset, "gpu": spec.name, "seq_len": cfg.train.seq_len, "compile": result["compile"],
            "loss": result["loss"], "planned_max_micro_batch": planned_max,
            "traced_max_micro_batch": result["fit"]["micro_batch"], "fit_confirmed": result["fit"]["confirmed"],
            "planned_gib_at_1": result["plan"]["total"], "traced_eager_gib_at_1": round(t["eager_memory"]["peak_gib"], 3),
            "traced_compiled_gib_at_1": round(t["compiled"]["memory"]["peak_gib"], 3) if t.get("compiled") else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="h100,l4")
    p.add_argument("--presets", default=",".join(n for n in preset_names() if n != "tiny"))
    a = p.parse_args()
    rows = []
    print("| preset | GPU | seq | compile, loss | largest micro-batch: planner / trace | at 1: planner / traced eager / "
          "compiled (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for gpu in a.gpus.split(","):
        for preset in a.presets.split(","):
            r = one(preset, gpu)
            rows.append(r)
            compiled = f"{r['traced_compiled_gib_at_1']:.2f}" if r["traced_compiled_gib_at_1"] is not None else "-"
            print(f"| {preset} | {r['gpu']} | {r['seq_len']} | {r['compile']}, {r['loss']} | "
                  f"{r['planned_max_micro_batch']} / {r['traced_max_micro_batch']} | {r['planned_gib_at_1']:.2f} / "
                  f"{r['traced_eager_gib_at_1']:.2f} / {compiled} |", flush=True)
    save_result("planner-vs-trace", "traced", "traced on fake tensors (no GPU ran)", {"rows": rows, "headroom": HEADROOM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
