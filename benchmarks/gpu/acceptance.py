"""One command that proves flopwise on a lent GPU: tests, throughput, predictions against runs.

Each step is a subprocess with its own timeout; its outcome (ok / failed / skipped, with the
reason) and what it measured go into ``<out>/gpu-acceptance-<device>-<date>.json`` with a short
Markdown summary beside it. A failure does not stop the steps after it. Without CUDA every
step is skipped and the script exits 0. The steps (``--list`` prints them with their timeouts):

1. ``gpu-tests``: ``pytest tests/gpu`` (CUDA training, DDP/ZeRO-1/FSDP2 at one NCCL rank);
2. ``train-<preset>``: the DEFAULT config (no throughput switches) of gpt2-124m, smollm-360m,
   llama3.2-1b and qwen3-moe-500m-a330m at seq 2048, one micro-batch per step: tokens/s, MFU,
   peak memory after warm-up (from metrics.jsonl), and the plan's predictions for it;
3. ``vs-hf-smollm-360m``: ``benchmarks/vs_hf.py`` (flopwise step vs transformers + compile);
4. ``memory-model``: plan.json's predicted memory against max_memory_allocated of step 2's runs
   (reads the run directories of this invocation: run it in the same call as step 2);
5. ``preflight-gpt2-124m`` then ``preflight-train-gpt2-124m``: preflight's predicted
   tokens/s (seq 2048, global batch 8) against the short run of its preflight.yaml;
6. ``host-syncs`` (torch.cuda.set_sync_debug_mode, per steady-state step) and ``explain``
   (``flopwise train --explain``: graphs, graph breaks);
7. ``compile-{off,blocks,model}`` and ``loss-{plain,chunked,fused}`` on gpt2-124m at seq 2048.

Every override set is checked with ``flopwise.config.build_config`` at start-up, so a typo
fails in the first second, before any GPU time is spent.

    PYTHONPATH=src python benchmarks/gpu/acceptance.py [--only STEP[,STEP]] [--list] [--out DIR]
    python benchmarks/gpu/acceptance.py --merge A.json B.json ... [--out DIR]   # join split runs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _run import run  # noqa: E402 - benchmarks/_run.py, the one subprocess runner

RESULTS = ROOT / "benchmarks" / "results"
TOTAL_BUDGET_S = 25 * 60  # the whole list on one H100
STEP_LIMIT_S = 9 * 60  # each step: a device call is at most 10 minutes
SEQ = 2048
MODEL_PRESETS = ("gpt2-124m", "smollm-360m", "llama3.2-1b", "qwen3-moe-500m-a330m")
TRAIN_STEPS = 20  # metrics rows at 5, 10, 15, 20; warm-up (compile) is excluded
QUIET = ["eval.every=0", "eval.sample_tokens=0", "eval.windows=16", "train.log_every=5",
         "tracking.tensorboard=false"]


@dataclass
class Step:
    """One acceptance step: ``argv`` run from the repository root (``None``: parse only),
    ``parse(ctx, stdout)`` turning its output and files into the recorded measurements."""

    name: str
    group: int  # the item of the acceptance list it answers (1-7)
    argv: list[str] | None
    timeout_s: int
    parse: Callable[["Context", str], dict[str, Any]] | None = None
    preset: str = ""  # with ``overrides``: the config build_config must accept
    overrides: list[str] = field(default_factory=list)
    needs: str = ""  # a module that must be importable ("" = none)
    what: str = ""


@dataclass
class Context:
    work: Path  # run directories and the data cache of this invocation
    results: dict[str, dict[str, Any]]  # step name -> record, filled as steps finish

    def run_dir(self, step: str) -> Path:
        return self.work / "runs" / step


# --------------------------------------------------------------------------- parsing

def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if "event" not in r and r.get("tok_per_s") is not None]


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _comparisons(run: Path) -> dict[str, Any]:
    """flopwise.report.compare on a run directory: plan / preflight / actual per quantity."""
    from flopwise.report.compare import compare
    from flopwise.report.runs import load_run

    out = {}
    for c in compare(load_run(run)):
        out[c.key] = {"plan": c.plan, "preflight": c.preflight, "actual": c.actual, "plan_error": c.plan_error,
                      "preflight_error": c.preflight_error, "comparable": c.comparable, "note": c.note}
    return out


def parse_train(ctx: Context, stdout: str, step: str) -> dict[str, Any]:
    run = ctx.run_dir(step)
    rows = _rows(run)
    if not rows:
        raise RuntimeError(f"no metrics rows in {run / 'metrics.jsonl'}")
    steady = rows[1:] or rows  # the first window holds compilation and warm-up
    record = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
    out = {"steps_measured": [r["step"] for r in steady],
           "tok_per_s": _mean([r.get("tok_per_s") for r in steady]),
           "mfu": _mean([r.get("mfu") for r in steady]),
           "step_time_s": _mean([r.get("step_time_s") for r in steady]),
           "mem_peak_gb": max((r.get("mem_peak_gb") or 0) for r in rows) or None,
           "mem_reserved_gb": max((r.get("mem_reserved_gb") or 0) for r in rows) or None,
           "result": record.get("result"), "precision": record.get("precision")}
    chosen = [ln.strip() for ln in stdout.splitlines()
              if re.match(r"\s+(device|model|attention|speed|batch|plan|optimizer|parallel)\b", ln)]
    out["startup"] = chosen[:12]
    try:
        out["predicted_vs_actual"] = _comparisons(run)
    except Exception as e:  # noqa: BLE001 -- the measurement stands without it
        out["predicted_vs_actual"] = f"n/a: {e}"
    return out


def parse_pytest(ctx: Context, stdout: str) -> dict[str, Any]:
    tail = [ln for ln in stdout.splitlines() if ln.strip()][-1:] or [""]
    return {"summary": tail[0]}


def parse_vs_hf(ctx: Context, stdout: str) -> dict[str, Any]:
    files = sorted(RESULTS.glob("vs-hf-*.json"), key=lambda p: p.stat().st_mtime)
    out: dict[str, Any] = {"stdout_tail": stdout.splitlines()[-6:]}
    if files and files[-1].stat().st_mtime >= ctx.results.get("_started", {}).get("t", 0):
        out["json"] = json.loads(files[-1].read_text())
        out["file"] = str(files[-1].relative_to(ROOT))
    return out


def parse_memory(ctx: Context, stdout: str) -> dict[str, Any]:
    rows = {}
    for preset in MODEL_PRESETS:
        name = f"train-{preset}"
        r = ctx.results.get(name)
        if not r or r.get("status") != "ok":
            rows[preset] = f"n/a: {name} {r.get('status') if r else 'not run in this invocation'}"
            continue
        mem = (r.get("measured", {}).get("predicted_vs_actual") or {})
        mem = mem.get("memory_gb") if isinstance(mem, dict) else None
        rows[preset] = {"predicted_gb": mem and mem["plan"], "max_memory_allocated_gb": mem and mem["actual"],
                        "error": mem and mem["plan_error"]}
    if not any(isinstance(v, dict) for v in rows.values()):
        raise RuntimeError("no train-<preset> step succeeded in this invocation")
    return {"presets": rows}


def parse_preflight(ctx: Context, stdout: str) -> dict[str, Any]:
    out_dir = ctx.run_dir("preflight-gpt2-124m")
    pre = json.loads((out_dir / "preflight.json").read_text())
    return {"preflight_yaml": str(out_dir / "preflight.yaml"),
            "stdout_tail": stdout.splitlines()[-8:], "keys": sorted(pre)[:30]}


def parse_preflight_train(ctx: Context, stdout: str) -> dict[str, Any]:
    return parse_train(ctx, stdout, "preflight-train-gpt2-124m")


def parse_syncs(ctx: Context, stdout: str) -> dict[str, Any]:
    line = [ln for ln in stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def parse_explain(ctx: Context, stdout: str) -> dict[str, Any]:
    lines = [ln.rstrip() for ln in stdout.splitlines()]
    head = next((ln for ln in lines if ln.startswith("explain:")), "")
    m = re.search(r"(\d+) graph\(s\), (\d+) graph break\(s\)", head)
    return {"graphs": int(m.group(1)) if m else None, "graph_breaks": int(m.group(2)) if m else None,
            "report": [ln for ln in lines if ln.startswith(("explain", "  break", "  no graph", "  recompile"))][:30]}


# --------------------------------------------------------------------------- the steps

def _train_argv(preset: str, overrides: list[str], extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "flopwise", "train", "--preset", preset, *(extra or []), *overrides]


def steps(work: Path) -> list[Step]:
    """The acceptance list, in order. ``work`` holds run directories and the data cache."""
    cache = f"data.cache_dir={work / 'cache'}"
    data = [cache, "data.builtin_max_mb=8"]  # ~2M tokens: enough 2048-token windows, prepared in seconds

    def run_dir(name: str) -> str:
        return f"train.run_dir={work / 'runs' / name}"

    def one_micro(preset: str) -> list[str]:  # the preset's own micro-batch, one per optimizer step
        from flopwise.config import build_config

        mb = build_config(preset=preset).train.micro_batch_size
        return [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}"]

    def seq(preset: str) -> list[str]:
        return [f"train.seq_len={SEQ}"] + (["model.max_seq_len=2048"] if preset == "gpt2-124m" else [])

    out = [Step("gpu-tests", 1, [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"], 130,
                parse_pytest, what="pytest tests/gpu: CUDA train, ddp/zero1/fsdp2 at one NCCL rank")]
    budget = {"gpt2-124m": 80, "smollm-360m": 100, "llama3.2-1b": 130, "qwen3-moe-500m-a330m": 100}
    for preset in MODEL_PRESETS:
        name = f"train-{preset}"
        ov = [*data, *seq(preset), *one_micro(preset), f"train.max_steps={TRAIN_STEPS}", *QUIET, run_dir(name)]
        out.append(Step(name, 2, _train_argv(preset, ov, ["--fresh"]), budget[preset],
                        lambda ctx, so, n=name: parse_train(ctx, so, n), preset, ov,
                        what=f"default config of {preset} at seq {SEQ}: tok/s, MFU, peak memory"))
    # Two processes (flopwise, then the honest transformers loop), each compiling its model once:
    # the flex_attention variant is a third compile that does not fit this step's budget
    # (run `benchmarks/vs_hf.py --preset smollm-360m --sizes preset` on its own for it).
    hf_args = ["--sizes", "preset", "--rounds", "2", "--repeats", "1", "--contenders", "flopwise,hf"]
    out.append(Step("vs-hf-smollm-360m", 3, [sys.executable, "benchmarks/vs_hf.py", "--preset", "smollm-360m",
                                             *hf_args], 150, parse_vs_hf,
                    needs="transformers", what="flopwise step / transformers+compile step, same model and batches"))
    out.append(Step("memory-model", 4, None, 5, parse_memory,
                    what="plan.json memory vs max_memory_allocated of the train-* runs above"))
    # gpt2-124m: it compiles fastest, and the global batch of 8 leaves 4 micro-batch trials (1, 2, 4, 8)
    pf_dir = work / "runs" / "preflight-gpt2-124m"
    pf = [*data, *seq("gpt2-124m"), "train.micro_batch_size=8", "train.global_batch_size=8", *QUIET]
    out.append(Step("preflight-gpt2-124m", 5, [sys.executable, "-m", "flopwise", "preflight", "--preset",
                                               "gpt2-124m", "--tokens", "100000000", "--warmup", "1", "--steps", "3",
                                               "--out", str(pf_dir), *pf],
                    210, parse_preflight, "gpt2-124m", pf, what="flopwise preflight: fit micro-batch, predict tok/s"))
    pft = [f"train.max_steps={TRAIN_STEPS}", "train.max_tokens=0", *QUIET, run_dir("preflight-train-gpt2-124m")]
    out.append(Step("preflight-train-gpt2-124m", 5,
                    [sys.executable, "-m", "flopwise", "train", "--config", str(pf_dir / "preflight.yaml"), "--fresh",
                     *pft], 90, parse_preflight_train, "gpt2-124m", pft,
                    what="a short run of preflight.yaml: predicted vs measured tok/s"))
    sy = [cache, "data.builtin_max_mb=8", "eval.every=0", "eval.sample_tokens=0", "eval.windows=16",
          "tracking.tensorboard=false"]
    out.append(Step("host-syncs", 6, [sys.executable, "benchmarks/gpu/sync_probe.py", "--short", "10", "--long", "30",
                                      "--run-dir", str(work / "runs" / "host-syncs"), "--", "--preset", "tiny", *sy],
                    80, parse_syncs, "tiny", sy + ["train.max_steps=30", "train.log_every=300"],
                    what="host syncs per steady-state step (set_sync_debug_mode), tiny preset"))
    ex = [*data, f"train.seq_len={SEQ}", "train.compile=model", *QUIET, run_dir("explain")]
    out.append(Step("explain", 6, _train_argv("smollm-360m", ex, ["--explain"]), 60, parse_explain,
                    "smollm-360m", ex, what="flopwise train --explain: graphs and graph breaks"))
    base = [*data, *seq("gpt2-124m"), *one_micro("gpt2-124m"), "train.max_steps=15", *QUIET]
    for knob, values in (("compile", ("off", "blocks", "model")), ("loss", ("plain", "chunked", "fused"))):
        for v in values:
            name = f"{knob}-{v}"
            ov = [*base, f"train.{knob}={v}", run_dir(name)]
            out.append(Step(name, 7, _train_argv("gpt2-124m", ov, ["--fresh"]), 60,
                            lambda ctx, so, n=name: parse_train(ctx, so, n), "gpt2-124m", ov,
                            needs="liger_kernel" if v == "fused" else "",
                            what=f"gpt2-124m seq {SEQ}, train.{knob}={v} (the rest default)"))
    return out


def validate(plan: list[Step]) -> list[str]:
    """Every step's overrides through build_config; the timeout budget. Problems, or []."""
    from flopwise.config import ConfigError, build_config

    problems = []
    for s in plan:
        if s.preset or s.overrides:
            try:
                build_config(preset=s.preset or None, overrides=list(s.overrides))
            except ConfigError as e:
                problems.append(f"{s.name}: {e}")
        if s.timeout_s > STEP_LIMIT_S:
            problems.append(f"{s.name}: timeout {s.timeout_s}s over {STEP_LIMIT_S}s")
    total = sum(s.timeout_s for s in plan)
    if total > TOTAL_BUDGET_S:
        problems.append(f"timeouts sum to {total}s, over {TOTAL_BUDGET_S}s")
    return problems


# --------------------------------------------------------------------------- running

def device_info() -> tuple[str, str, dict[str, Any]]:
    """(device name, file tag, versions); 'cpu' when there is no CUDA."""
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "triton", "flash_attn", "liger_kernel", "torchao"):
        spec = importlib.util.find_spec(mod)
        if spec is None:
            versions[mod] = None
            continue
        try:
            from importlib.metadata import version

            versions[mod] = version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001
            versions[mod] = "installed"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        versions["cuda"] = torch.version.cuda
        tag = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        return name, tag, versions
    return "cpu (no CUDA)", "cpu", versions


def run_step(s: Step, ctx: Context, cuda: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"name": s.name, "item": s.group, "what": s.what, "timeout_s": s.timeout_s,
                           "argv": [str(a) for a in s.argv] if s.argv else None}
    if not cuda:
        return {**rec, "status": "skipped", "reason": "no CUDA"}
    if s.needs and importlib.util.find_spec(s.needs) is None:
        return {**rec, "status": "skipped", "reason": f"{s.needs} is not installed on this machine"}
    t0 = time.perf_counter()
    stdout = ""
    if s.argv:
        env = {"PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        ran = run(s.argv, env=env, cwd=ROOT, timeout_s=s.timeout_s)  # a timeout ends torchrun ranks, compile workers
        if ran.timed_out:
            return {**rec, "status": "failed", "reason": ran.reason, "wall_s": round(ran.elapsed_s, 1),
                    "stdout_tail": ran.stdout.splitlines()[-15:]}
        rec["wall_s"] = round(ran.elapsed_s, 1)
        if not ran.ok:
            return {**rec, "status": "failed", "reason": ran.reason,
                    "stdout_tail": ran.stdout.splitlines()[-15:], "stderr_tail": ran.stderr.splitlines()[-25:]}
        stdout = ran.stdout
    try:
        measured = s.parse(ctx, stdout) if s.parse else {}
    except Exception as e:  # noqa: BLE001 -- recorded, the next step runs
        return {**rec, "status": "failed", "reason": f"parse: {type(e).__name__}: {e}",
                "stdout_tail": stdout.splitlines()[-15:]}
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return {**rec, "status": "ok", "measured": measured}


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "n/a"
    if pct:
        return f"{100 * x:.1f}%"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# GPU acceptance: {doc['device']} ({doc['date']})", "",
             f"torch {doc['versions'].get('torch')}, CUDA {doc['versions'].get('cuda')}, "
             f"commit {doc.get('commit') or 'n/a'}. Steps run: {doc.get('only') or 'all'}.", "",
             "| step | status | tok/s | MFU | peak GiB | wall s | note |", "|---|---|---|---|---|---|---|"]
    for r in doc["steps"]:
        m = r.get("measured") or {}
        note = r.get("reason", "")
        if r["name"] == "memory-model" and m:
            note = "; ".join(f"{p}: {_fmt(v['predicted_gb'])} predicted vs {_fmt(v['max_memory_allocated_gb'])} GiB"
                             for p, v in m["presets"].items() if isinstance(v, dict))
        elif r["name"] == "host-syncs" and m:
            note = f"{m.get('syncs_per_step')} syncs/step"
        elif r["name"] == "explain" and m:
            note = f"{m.get('graphs')} graph(s), {m.get('graph_breaks')} break(s)"
        elif r["name"] == "gpu-tests" and m:
            note = m.get("summary", "")
        elif r["name"].startswith("vs-hf") and m.get("json"):
            rows = m["json"].get("results", m["json"].get("rows", []))
            ratios = [x.get("ratio") for x in rows if isinstance(x, dict)]
            note = f"ratio flopwise/HF {', '.join(_fmt(x) for x in ratios if x is not None) or 'see JSON'}"
        elif isinstance(m.get("predicted_vs_actual"), dict):
            tps = m["predicted_vs_actual"].get("tok_per_s") or {}
            if tps.get("preflight") is not None:
                note = (f"preflight predicted {_fmt(tps['preflight'])} tok/s "
                        f"(error {_fmt(tps['preflight_error'], True)})")
        lines.append(f"| {r['name']} | {r['status']} | {_fmt(m.get('tok_per_s'))} | {_fmt(m.get('mfu'), True)} | "
                     f"{_fmt(m.get('mem_peak_gb'))} | {r.get('wall_s', '')} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-acceptance-{doc['tag']}-{doc['date']}"
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md.write_text(markdown(doc))
    return js, md


def merge(files: list[Path]) -> dict[str, Any]:
    """Join the records of split invocations (``--only``): later files win per step, in list order."""
    docs = [json.loads(Path(f).read_text()) for f in files]
    by_name: dict[str, dict[str, Any]] = {}
    for d in docs:
        for r in d["steps"]:
            if r["status"] != "skipped" or r["name"] not in by_name:
                by_name[r["name"]] = r
    order = [s.name for s in steps(Path("/tmp"))]
    doc = {**docs[-1], "only": "merged: " + ", ".join(str(f) for f in files)}
    doc["steps"] = sorted(by_name.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else 99)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated step names (or item numbers 1-7); default all")
    ap.add_argument("--list", action="store_true", help="print the steps with their timeouts and exit")
    ap.add_argument("--out", default=None,
                    help="where the JSON and Markdown go (default benchmarks/results; without CUDA, nowhere "
                         "unless given, as every GPU benchmark here)")
    ap.add_argument("--work", default="", help="run directories and data cache (default: a temporary directory)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join split runs' JSON and exit")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))

    if args.merge:
        doc = merge([Path(f) for f in args.merge])
        js, md = write(doc, Path(args.out or RESULTS))
        print(markdown(doc) + f"wrote {js}\nwrote {md}")
        return 0

    work = Path(args.work or tempfile.mkdtemp(prefix="flopwise-acceptance-"))
    plan = steps(work)
    problems = validate(plan)
    if problems:
        print("acceptance: the step list is invalid:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    if args.list:
        for s in plan:
            print(f"{s.group}  {s.name:<30} {s.timeout_s:>4}s  {s.what}")
        print(f"total {sum(s.timeout_s for s in plan)}s (budget {TOTAL_BUDGET_S}s, each <= {STEP_LIMIT_S}s)")
        return 0
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        names = {s.name for s in plan}
        unknown = [w for w in wanted if w not in names and not (w.isdigit() and 1 <= int(w) <= 7)]
        if unknown:
            print(f"acceptance: unknown step(s) {unknown}; --list shows them", file=sys.stderr)
            return 2
        plan = [s for s in plan if s.name in wanted or str(s.group) in wanted]

    import torch

    cuda = torch.cuda.is_available()
    name, tag, versions = device_info()
    try:
        commit = run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout_s=10).stdout.strip()
    except OSError:  # no git here
        commit = ""
    ctx = Context(work=work, results={"_started": {"t": time.time()}})
    doc: dict[str, Any] = {"benchmark": "gpu_acceptance", "date": date.today().isoformat(), "device": name,
                           "tag": tag, "versions": versions, "commit": commit, "only": args.only,
                           "cuda": cuda, "work": str(work), "steps": []}
    out = Path(args.out) if args.out else (RESULTS if cuda else None)
    if not cuda:
        print("acceptance: no CUDA device here: every step is skipped"
              + ("" if out else " and nothing is written (--out DIR writes the record anyway)"))
    t0 = time.perf_counter()
    for s in plan:
        if cuda:
            print(f"[{time.perf_counter() - t0:6.0f}s] {s.name} (limit {s.timeout_s}s) ...", flush=True)
        rec = run_step(s, ctx, cuda)
        ctx.results[s.name] = rec
        doc["steps"].append(rec)
        if cuda:
            print(f"    {rec['status']}" + (f": {rec['reason']}" if rec.get("reason") else ""), flush=True)
        if out:
            write(doc, out)  # after every step: a killed call still leaves what it measured
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    if out:
        js, md = write(doc, out)
        print(markdown(doc) + f"wrote {js}\nwrote {md}")
    else:
        print(markdown(doc))
    failed = [r["name"] for r in doc["steps"] if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
