"""``flopwise plan --trace`` traces the step that was asked for and says what is predicted (issue 51).

- the flags that shape the step (``--precision``, ``--attention``, ``--checkpointing`` and its
  ``--checkpointing-every``, ``--loss``) reach the traced config; one the trace cannot take is
  refused in one line before anything is traced;
- the time and cost priced at the trace's predicted MFU say "predicted" and carry the range the
  prediction's held-out errors support (``prediction["band"]``), in the text and in ``--json``; an
  explicit ``--mfu`` beside a prediction is refused before the trace;
- the virtual preflight's budget (``preflight --dry-run --rank``) carries the same range.

The commands run in this process, as a user runs them (``flopwise.cli.main``). :func:`traces` keeps
each configuration's trace and records the config every dry run traced: the planned step and the
asked step are traced once each, through the fake-CUDA shim.
"""

from __future__ import annotations

import json

import pytest
from helpers import cli_once, traces_kept

from flopwise.plan import accuracy
from flopwise.tune import dryrun, virtual

PLAN = ("plan", "--model", "tiny", "--gpu", "h100", "--seq-len", "128", "--tokens", "1e9")
# each unlike the default step (bf16, flash/SDPA, no checkpointing, loss auto); --loss plain rather than chunked,
# whose compiled trace takes three times as long here; a small batch bounds the trace's fit search
ASKED = ("--precision", "fp16", "--attention", "eager", "--checkpointing", "selective", "--checkpointing-every", "3",
         "--loss", "plain", "--target-batch-tokens", "4096")
SHAPE = ["train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=16"]
RANK = ("preflight", "--dry-run", "--rank", "--preset", "tiny", "--gpu", "h100", "--price-per-gpu-hour", "3",
        "--tokens", "1000000000", *SHAPE)


@pytest.fixture(scope="module")
def traces(fake_cuda_shim):
    """``{"kept": {(config, request): result}, "traced": [config, ...]}``: each configuration's trace,
    kept (a dry run of one already traced gets a copy), and the config of every dry run asked for."""
    yield from traces_kept()


@pytest.fixture(scope="module")
def ran(traces):
    """``ran(*argv)``: ``flopwise ARGV``'s (status, stdout, stderr), run once per argv."""
    return cli_once()


def ok(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 0, err[-3000:]
    return out


def row(text: str, label: str) -> str:
    """The line of the plan's table whose label is ``label``."""
    return next(ln for ln in text.splitlines() if ln.strip().startswith(label + " "))


def test_the_traced_step_is_the_one_asked_for(ran, traces):
    plan = json.loads(ok(ran(*PLAN, *ASKED, "--trace", "--json")))
    cfg = traces["traced"][-1]
    t = cfg.train
    assert (t.precision, cfg.model.attention, t.activation_checkpointing, t.activation_checkpointing_every,
            t.loss) == ("fp16", "eager", "selective", 3, "plain")
    # the trace ran that step: the worker's own account of it
    trace = plan["trace"]
    assert trace["precision"] == "fp16" and trace["loss"] == "plain" and not trace["trace"]["sdpa_kernels"]
    # and the plan priced it: the same settings in its memory, its time at that trace's predicted MFU
    s = plan["memory"]["settings"]
    assert (s["precision"], s["attention"], s["activation_checkpointing"], s["activation_checkpointing_every"],
            s["loss"]) == ("fp16", "eager", "selective", 3, "plain")
    assert plan["mfu"] == pytest.approx(trace["prediction"]["mfu"], rel=1e-6)
    text = ok(ran(*PLAN, *ASKED, "--trace"))
    step = next(ln for ln in text.split("trace of the planned step", 1)[1].splitlines() if "step " in ln)
    assert "fp16" in step and "no SDPA" in step and "flash" not in step, step


def test_a_flag_the_trace_cannot_take_is_refused_in_one_line_before_any_trace(monkeypatch, capsys):
    from flopwise.cli import main

    def no_trace(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(dryrun, "_trace", no_trace)
    monkeypatch.setattr(dryrun, "ensure_shim", no_trace)
    cases = {("--loss", "fused"): "--loss fused",
             ("--precision", "bf16-pure", "--no-master-weights"): "--no-master-weights",
             ("--mfu", "0.3"): "--mfu"}
    for flags, named in cases.items():
        assert main([*PLAN, "--trace", *flags]) == 2, flags
        got = capsys.readouterr()
        err = got.err.strip().splitlines()
        assert len(err) == 1 and named in err[0] and "--trace" in err[0], (flags, err)
        assert got.out == "", flags
    # without --trace the same flags plan as before
    for flags in cases:
        assert main([*PLAN, *flags, "--json"]) == 0, flags
        capsys.readouterr()


def test_an_explicit_mfu_prices_a_trace_that_predicts_nothing(ran):
    """On a GPU the step model has no constants for (a V100: no bf16 tensor rate; the L4 had none
    before issue 52) the trace still shows the step and its memory, and the assumed --mfu prices
    the run, as the note says: --mfu is not refused there."""
    argv = ("plan", "--model", "tiny", "--gpu", "v100", "--dtype", "fp16", "--seq-len", "128", "--tokens", "1e9",
            "--trace")
    code, out, err = ran(*argv, "--mfu", "0.3", "--json")
    assert code == 0, err[-3000:]
    plan = json.loads(out)
    assert not plan["trace"]["prediction"]["predicted"] and plan["trace"]["fit"]["micro_batch"]
    assert plan["mfu"] == 0.3 and plan["mfu_source"] == "assumed" and "band" not in plan
    note = [ln for ln in err.splitlines() if "no step time predicted" in ln]
    assert len(note) == 1 and "V100" in note[0] and "assumed MFU 30% (--mfu)" in note[0], err
    assert "predicted" not in row(ok(ran(*argv, "--mfu", "0.3")), "wall time")


def test_every_figure_from_the_prediction_says_predicted_with_its_range(ran):
    priced = (*PLAN, "--trace", "--price-per-gpu-hour", "2")
    plan = json.loads(ok(ran(*priced, "--json")))
    p = plan["trace"]["prediction"]
    b = plan["band"]
    assert p["predicted"] and p["band"]["low"] == b["low"] and p["band"]["high"] == b["high"]
    assert b["cases"] == p["band"]["cases"] and b["regime"] == p["band"]["regime"]
    for key in ("hours", "gpu_hours", "cost"):
        assert b[key] == pytest.approx([plan[key] * b["low"], plan[key] * b["high"]], rel=1e-6), key
    text = ok(ran(*priced))
    for label in ("wall time", "GPU-hours", "cost"):
        line = row(text, label)
        assert "predicted" in line and "likely" in line, line
    assert accuracy.band_text(b) in text

    # --hours: the wall time is the user's; the tokens it affords are the predicted figure, with their range
    afforded = json.loads(ok(ran(*PLAN[:-2], "--hours", "2", "--trace", "--json")))
    ab = afforded["band"]
    assert ab["tokens"] == pytest.approx([afforded["tokens"] / ab["high"], afforded["tokens"] / ab["low"]], rel=1e-6)
    assert ab.get("hours") is None and afforded["hours"] == 2
    text = ok(ran(*PLAN[:-2], "--hours", "2", "--trace"))
    tokens = row(text.split("FLOPs", 1)[1], "tokens")
    assert "predicted" in tokens and "likely" in tokens, tokens
    assert "predicted" not in row(text, "GPU-hours")  # hours × GPUs, both the user's


def test_the_virtual_preflights_budget_carries_the_range(ran, monkeypatch):
    """Its first candidate is traced (the configured settings); the sweep's batch traces are stood in
    for by none: the choice is that candidate, and its budget is what the range is of."""
    monkeypatch.setattr(virtual, "dry_run_batch", lambda cfgs, **kwargs: [])
    v = json.loads(ok(ran(*RANK, "--json")))["virtual"]
    b, band = v["budget"], v["choice"]["prediction"]["band"]
    r = b["band"]
    assert (r["low"], r["high"], r["cases"]) == (band["low"], band["high"], band["cases"])
    for key in ("hours", "gpu_hours", "cost"):
        assert r[key] == pytest.approx([b[key] * band["low"], b[key] * band["high"]], rel=1e-6), key
    text = ok(ran(*RANK))
    line = next(ln for ln in text.splitlines() if "predicted time for" in ln)
    assert "likely" in line, line
    assert accuracy.band_text(r) in text
