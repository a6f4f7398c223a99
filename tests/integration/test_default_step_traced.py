"""The step a default ``train`` takes on a GPU, traced on fake tensors (the dry run): under ZeRO-1
``train.compile=auto`` compiles each block, with no graph break (DDP and FSDP2: the dry-run
matrix, tests/integration/test_dryrun.py); and ``flopwise
plan --model PRESET --gpu GPU`` plans that step -- compiled where auto compiles, its loss and
attention as auto resolves them there -- within 10% of the traced memory and at the traced FLOPs.
Every figure here is traced, none measured: two tracing processes, a few minutes on 2 cores."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from flopwise.cli import main, planned_step_config
from flopwise.config import build_config
from flopwise.tune.dryrun import dry_run_batch
from flopwise.tune.shim import compiler

RANKS = 8
# ZeRO-1's default step; the dry-run matrix's "ddp auto" and "fsdp2 auto" rows hold DDP and FSDP2 to
# the same (blocks, no break), so they are not traced a second time here
WRAPPERS = ("zero1",)
# (preset, GPU, GPUs, plan's flags): one process compiles the whole model (the plain loss inside
# its graph); at eight ranks auto picks a wrapper and compiles blocks (the chunked loss outside them)
PLANNED = [("tiny", "a100", 1, ("--seq-len", "256")), ("smollm-135m", "h100", RANKS, ())]
MEMORY_BOUND = 0.10


def plan_of(preset: str, gpu: str, gpus: int, flags: tuple[str, ...]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--model", preset, "--gpu", gpu, "--gpus", str(gpus), "--json", *flags]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def traced() -> dict[str, tuple[dict | None, dict]]:
    """name -> (the plan, or None, and the trace of its step): the planned steps, and at 8 ranks of
    an H100 tiny's default step under each wrapper (traced with smollm-135m's, in one process)."""
    if compiler() is None:
        pytest.skip("no C++ compiler: the dry run's shim cannot be built (install g++)")
    plans = {f"{p} {g} x{n}": plan_of(p, g, n, flags) for p, g, n, flags in PLANNED}
    wrapped = {w: build_config(preset="tiny", overrides=["train.seq_len=128", "train.micro_batch_size=2",
                                                         f"train.global_batch_size={2 * RANKS}",
                                                         f"parallel.strategy={w}"]) for w in WRAPPERS}
    out: dict[str, tuple[dict | None, dict]] = {}
    for (preset, gpu, gpus, _), (name, plan) in zip(PLANNED, plans.items()):
        cfgs = [planned_step_config({"preset": preset, "overrides": []}, plan, gpus)]
        if gpus == RANKS and gpu == "h100":
            cfgs += list(wrapped.values())
        results = dry_run_batch(cfgs, gpu=gpu, nproc_per_node=gpus)
        out[name] = (plan, results[0])
        out.update({w: (None, r) for w, r in zip(wrapped, results[1:])})
    return out


def _breaks(name: str, r: dict) -> list[str]:
    """What is wrong with a compiled default step: an error, a break, a recompile, or graphs that change."""
    if "error" in r:
        return [f"{name}: the step fails: {r['error']} at {r.get('where')}"]
    steps = r["trace"]["compiled"]["per_step"]
    if any(s["graph_breaks"] for s in steps) or steps[-1]["graphs"] != steps[0]["graphs"] or \
            r["trace"]["compiled"]["recompile_reasons"]:
        return [f"{name}: compile {r['compile']}: {steps}, breaks {r['trace']['compiled']['break_reasons']}, "
                f"recompiles {r['trace']['compiled']['recompile_reasons']}"]
    return []


@pytest.mark.slow
def test_auto_compiles_blocks_with_no_graph_break_under_each_wrapper(traced):
    problems = [p for w in WRAPPERS for p in _breaks(w, traced[w][1])]
    assert not problems, "\n".join(problems)
    for w in WRAPPERS:
        r = traced[w][1]
        assert (r["strategy"], r["compile"]) == (w, "blocks"), (w, r["strategy"], r["compile"])
        assert r["speed"]["compile"].startswith(f"auto -> blocks (CUDA under {w}: one graph per block"), r["speed"]


@pytest.mark.slow
def test_plan_without_a_config_plans_the_step_a_default_train_takes(traced):
    """plan's compile, loss, memory and FLOPs against the dry run's compiled trace of its step."""
    problems = []
    for name, (plan, r) in traced.items():
        if plan is None:
            continue
        problems += _breaks(name, r)
        defaults, settings = plan["defaults"], plan["memory"]["settings"]
        assert defaults["compile"].startswith(f"auto -> {r['compile']} ("), (name, defaults, r["compile"])
        assert (settings["loss"], settings["compiled"]) == (r["loss"], True), (name, settings, r["loss"])
        traced_peak = r["trace"]["memory"]["peak_gib"]  # the compiled step's, as the run takes it
        off = plan["memory"]["total"] / traced_peak - 1
        if abs(off) > MEMORY_BOUND:
            problems.append(f"{name}: plan {plan['memory']['total']:.2f} GiB vs traced {traced_peak:.2f} GiB "
                            f"({100 * off:+.1f}%)")
        f, tokens = r["trace"]["flops"], plan["batch"]["tokens_per_step"] / r["world"]
        per_token = (f["matmul"] + f["attention_model"]) * f["per_step_scale"] / tokens
        assert plan["flops_per_token"] == pytest.approx(per_token, rel=1e-6), name
    assert not problems, "\n".join(problems)
    one, eight = (traced[f"{p} {g} x{n}"] for p, g, n, _ in PLANNED)
    assert (one[1]["compile"], one[1]["loss"], eight[1]["compile"], eight[1]["loss"]) == (
        "model", "plain", "blocks", "chunked")
