"""The virtual preflight (``flopwise preflight --dry-run --rank``, tune/virtual.py).

The ranking runs on hand-made results shaped like the dry run's worker's (kernel lists made by
hand, as tests/unit/test_steptime.py makes them), predicted by tune/predict.py: no trace. One
end-to-end run traces a tiny model's candidates through the fake-CUDA shim.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from flopwise.config import build_config
from flopwise.tune import virtual
from flopwise.tune.predict import predicted
from flopwise.tune.shim import compiler, ensure_shim
from flopwise.tune.virtual import AC, COMPILE, FP8, LOSS, MB, STRATEGY

CFG = build_config("tiny", overrides=["train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=16"])


def mm(m: int, n: int, k: int) -> dict:
    return {"kind": "mm", "op": "mm", "reads": [[1, 0]], "writes": [[2, 0]], "phase": "forward", "micro": 1,
            "host": 1, "m": m, "n": n, "k": k, "batch": 1, "dtype": "bfloat16"}


def result(micro_batch: int, peak_gib: float, work: int, compile: str = "model", strategy: str = "single",
           world: int = 1) -> dict:
    """A worker result (what tune/worker.py writes, as dry_run_batch hands it on): ``work`` matmuls
    of 4096³ each per micro-batch of ``micro_batch`` sequences of 128 tokens."""
    kernels = {"records": [mm(4096, 4096, 4096)] * work, "tail_host": 0, "traced_accum": 1, "run_accum": 1,
               "micro_batch": micro_batch, "seq_len": 128, "world": world}
    r = {"request": {"gpu": {"spec": "H100 SXM"}, "nproc_per_node": world}, "precision": "bf16",
         "compile": compile, "loss": "plain", "strategy": strategy, "micro_batch": micro_batch,
         "trace": {"kernels": kernels, "memory": {"peak_gib": peak_gib}, "flops": {}}}
    r["prediction"] = predicted(r, CFG)
    return r


def settings(micro_batch: int, ac: str = "none", compile: str = "model", strategy: str = "single") -> dict:
    return {MB: micro_batch, AC: ac, COMPILE: compile, LOSS: "plain", STRATEGY: strategy}


CAP = 72.0  # GiB: 90% of an H100's 80


def test_the_fastest_fitting_candidate_is_chosen_never_one_that_does_not_fit():
    # tokens per second: micro-batch sequences x 128 tokens over the time of `work` matmuls
    rows = [virtual.candidate(settings(8), result(8, 30.0, work=4), CAP),  # 1024 tok / 4 mm
            virtual.candidate(settings(16), result(16, 60.0, work=5), CAP),  # 2048 tok / 5 mm: fastest that fits
            virtual.candidate(settings(32), result(32, 90.0, work=6), CAP),  # 4096 tok / 6 mm: fastest, over cap
            virtual.candidate(settings(16, ac="full"), {"error": "RuntimeError: no", "where": "x.py:1"}, CAP)]
    assert [c["fits"] for c in rows] == [True, True, False, False]
    choice = virtual.choose(rows)
    assert choice is not None and choice["settings"] == settings(16)
    assert choice["runner_up"] == settings(8)
    rate = {c["settings"][MB]: c["prediction"]["tokens_per_s_per_gpu"] for c in rows[:3]}
    assert rate[32] > rate[16] > rate[8]  # the one over the cap would have won
    assert choice["margin"] == pytest.approx(rate[16] / rate[8] - 1)
    assert choice["margin"] == pytest.approx((2048 / 5) / (1024 / 4) - 1, rel=0.01)  # the step: its matmuls, ~
    assert [c["settings"][MB] for c in virtual.ranked(rows)] == [16, 8]
    lines = virtual.render({"gpu": "H100 SXM", "world": 1, "traces": 4, "seconds": 1.0, "candidates": rows,
                            "choice": choice, "budget": virtual.budget(choice, CFG, 1, tokens=10**9,
                                                                       price_per_gpu_hour=2.0)}, ["--preset", "tiny"])
    table = {tuple(ln.split()[:2]): ln for ln in lines if re.match(r"\s+\d+ ", ln)}
    assert "<- chosen" in table["16", "none"] and "the step fails" in table["16", "full"]
    assert "does not fit" in table["32", "none"] and "predicted" not in table["32", "none"]


def test_nothing_fits_nothing_is_chosen():
    assert virtual.choose([virtual.candidate(settings(8), result(8, 90.0, work=4), CAP)]) is None


def test_a_tie_between_compile_model_and_blocks_is_a_tie_and_goes_to_blocks_under_ddp():
    rows = [virtual.candidate(settings(8, compile=c, strategy="ddp"), result(8, 30.0, 4, c, "ddp", 2), CAP)
            for c in ("model", "blocks")]
    choice = virtual.choose(rows)
    assert choice["settings"][COMPILE] == "blocks" and choice["tied"] == [rows[0]["settings"]]
    assert choice["margin"] == pytest.approx(0.0)
    # alone (one rank, no wrapper), the same tie goes to the larger micro-batch, then no checkpointing first
    rows = [virtual.candidate(settings(8, ac="full"), result(8, 30.0, 4), CAP),
            virtual.candidate(settings(8), result(8, 30.0, 4), CAP)]
    assert virtual.choose(rows)["settings"][AC] == "none"
    # and where nothing else tells them apart, the configured settings
    rows = [virtual.candidate(settings(8, compile=c), result(8, 30.0, 4, c), CAP) for c in ("model", "blocks")]
    assert virtual.choose(rows, configured={COMPILE: "blocks"})["settings"][COMPILE] == "blocks"
    assert virtual.choose(rows, configured={COMPILE: "model"})["settings"][COMPILE] == "model"


def test_the_budget_is_priced_at_the_predicted_rate():
    choice = virtual.choose([virtual.candidate(settings(8), result(8, 30.0, work=4), CAP)])
    b = virtual.budget(choice, CFG, 1, tokens=10**9, price_per_gpu_hour=2.0)
    hours = 10**9 / choice["prediction"]["tokens_per_s"] / 3600
    assert b["hours"] == pytest.approx(hours) and b["cost"] == pytest.approx(2.0 * hours)
    afforded = virtual.budget(choice, CFG, 1, hours=2.0)  # --hours: the tokens it affords
    assert afforded["tokens"] == pytest.approx(2.0 * 3600 * choice["prediction"]["tokens_per_s"])


def test_candidates_are_what_a_preflight_tries():
    assert virtual.sweep_sizes(CFG, 1, 1024) == [1, 2, 4, 8, 16]  # up to the global batch
    assert virtual.sweep_sizes(CFG, 2, 6) == [1, 2, 4]  # 6 fits but 16 sequences do not split into 2 x 6
    assert virtual.sweep_sizes(CFG, 1, None) == []
    base = settings(8, strategy="ddp")
    found = virtual.variations(base, 2, "auto")
    assert {AC: "full"} in found and {LOSS: "chunked"} in found and {COMPILE: "blocks"} in found
    assert {COMPILE: "off"} not in found and {STRATEGY: "fsdp2"} in found and {STRATEGY: "ddp"} not in found
    assert {COMPILE: "off"} in virtual.variations(settings(8, compile="model"), 1, "off")
    assert not any(STRATEGY in v for v in virtual.variations(settings(8), 1, "auto"))
    # across nodes HSDP is a candidate too (sharded within a node, replicated across); on one node not
    assert {STRATEGY: "hsdp"} in virtual.variations(base, 16, "auto", nodes=2)
    assert {STRATEGY: "hsdp"} not in found
    assert {STRATEGY: "fsdp2"} in virtual.variations(settings(8, strategy="hsdp"), 16, "auto", nodes=2)


@pytest.fixture(scope="module")
def shim():
    if compiler() is None:
        pytest.skip("no C++ compiler: the dry run's shim cannot be built (install g++)")
    return ensure_shim()


def test_rank_command_end_to_end(shim, capsys, tmp_path):
    """The command docs/planning.md shows, run as written (the docs lane leaves it to this test:
    nine traces), its excerpt there checked against today's output, and its virtual.json."""
    import shlex

    from flopwise.cli import main

    sys.path.insert(0, str(Path(__file__).parent))
    from test_doc_commands import RANK_COMMAND, _excerpts, shape_problems

    assert main([*shlex.split(RANK_COMMAND)[1:], "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    today = captured.out + captured.err
    shown = [(page, line, lines) for page, line, command, lines in _excerpts() if command == RANK_COMMAND]
    assert shown, "docs/planning.md shows no excerpt of the virtual preflight"
    for page, line, lines in shown:
        assert not shape_problems(lines, today), (f"{page.name}:{line}", shape_problems(lines, today))

    v = json.loads((tmp_path / "virtual.json").read_text())["virtual"]
    assert v["gpu"] == "H100 SXM" and v["largest_fit"] and v["traces"] == len(v["candidates"])
    for c in v["candidates"]:
        assert set(c["settings"]) == {MB, AC, COMPILE, LOSS, STRATEGY, FP8} and "fits" in c and "peak_gib" in c
        assert c["prediction"]["predicted"], c
    assert {c["settings"][AC] for c in v["candidates"]} == {"none", "selective", "full"}
    assert {c["settings"][LOSS] for c in v["candidates"]} == {"plain", "chunked"}
    fp8 = [c for c in v["candidates"] if c["settings"][FP8]]  # torchao here (./install.sh test): an fp8 row
    assert len(fp8) == (1 if importlib.util.find_spec("torchao") else 0), fp8
    assert all(c["numerics"].startswith("changes numerics: fp8") for c in fp8) and not v["choice"]["settings"][FP8]
    same = [c for c in v["candidates"] if c["fits"] and not c["numerics"]]
    fastest = max(same, key=lambda c: c["prediction"]["tokens_per_s_per_gpu"])
    choice = v["choice"]
    assert choice["prediction"]["tokens_per_s_per_gpu"] >= (1 - virtual.TIE) * fastest["prediction"][
        "tokens_per_s_per_gpu"]
    assert choice["margin"] is not None and v["budget"]["hours"] > 0 and v["budget"]["cost"] > 0
    assert v["budget"]["tokens"] == 1_000_000_000

    # the text: every line with a figure of speed, time or cost says predicted
    lines = today.splitlines()
    figures = [ln for ln in lines if re.search(r"tok/s|tokens/s|\d ms|MFU|GPU-hours|\$", ln) and re.search(r"\d", ln)
               and not ln.startswith(("  tracing", "  micro "))]  # the table's header names a column fp8
    assert figures and all("predicted" in ln for ln in figures), [ln for ln in figures if "predicted" not in ln]
    run = next(ln for ln in lines if "run it with" in ln)
    assert run.count("train.micro_batch_size=") == 1 and f"train.micro_batch_size={choice['settings'][MB]}" in run


def test_rank_without_dry_run_is_refused_before_any_work(capsys):
    from flopwise.cli import main

    assert main(["preflight", "--rank", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("--rank" in ln and "--dry-run" in ln for ln in err), err  # as a configuration problem is listed


def test_a_batch_trace_that_does_not_finish_in_time_is_stopped_and_said(shim, tmp_path, monkeypatch):
    """dry_run_batch waits for each trace at most TIMEOUT_S after the one before it, then kills
    its tracing process and says which trace it was (it waited forever before). A 0.01 s limit:
    starting the process and importing torch alone take far longer."""
    from flopwise.tune import dryrun
    from flopwise.tune.dryrun import DryRunFailed, dry_run_batch

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(dryrun, "TIMEOUT_S", 0.01)
    with pytest.raises(DryRunFailed, match=r"trace 1 of 2 did not finish in 0.01 s"):
        dry_run_batch([CFG, CFG], "H100")
    assert not list(tmp_path.glob("flopwise-dryrun-*")), "the batch's trace directory was left behind"
