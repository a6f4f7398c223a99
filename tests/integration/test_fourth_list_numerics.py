"""Issue 54 (the fourth list), item 7: strategies ranked across unlike numerics.

Under bf16 autocast, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` makes the residual stream
bf16 where DDP and ZeRO-1 keep it fp32: part of a predicted FSDP2 "win" is a precision change. The
virtual preflight now marks such a row, shows it, and never chooses it by itself -- as the ladder
keeps fp8 only when asked. The ranking runs on hand-made worker results (as
test_virtual_preflight.py makes them): no trace."""

from __future__ import annotations

from test_virtual_preflight import CAP, result, settings

from flopwise.plan.memory import MemorySettings, _dtypes, numerics_change, residual_bytes
from flopwise.tune import virtual
from flopwise.tune.virtual import STRATEGY


def rows(world: int = 8) -> list[dict]:
    """ddp and zero1 at 4 matmuls a micro-batch; fsdp2 predicted faster (3 matmuls): the issue's case."""
    return [virtual.candidate(settings(8, strategy="ddp"), result(8, 30.0, 4, strategy="ddp", world=world), CAP),
            virtual.candidate(settings(8, strategy="zero1"), result(8, 29.0, 4, strategy="zero1", world=world), CAP),
            virtual.candidate(settings(8, strategy="fsdp2"), result(8, 20.0, 3, strategy="fsdp2", world=world), CAP)]


def test_one_rule_for_the_residual_stream_shared_with_the_memory_model():
    assert residual_bytes("ddp", "bf16") == 4 and residual_bytes("zero1", "fp16") == 4
    assert residual_bytes("fsdp2", "bf16") == 2 and residual_bytes("fsdp2", "float32") == 4
    assert residual_bytes("ddp", "bf16-pure") == 2
    for strategy in ("ddp", "zero1", "fsdp2", "single"):
        for precision in ("bf16", "fp16", "float32", "bf16-pure"):
            s = MemorySettings(precision=precision, strategy=strategy)
            assert _dtypes(s)["residual"] == residual_bytes(strategy, precision), (strategy, precision)
    assert numerics_change("fsdp2", "ddp", "bf16").startswith("changes numerics: a bf16 residual stream where ddp")
    assert numerics_change("ddp", "fsdp2", "bf16").startswith("changes numerics: a fp32 residual stream where fsdp2")
    assert numerics_change("zero1", "ddp", "bf16") == "" and numerics_change("fsdp2", "ddp", "float32") == ""


def test_a_faster_strategy_that_changes_numerics_is_shown_but_not_chosen_by_itself():
    candidates = rows()
    virtual.mark_numerics(candidates, "ddp", "bf16")
    assert [bool(c["numerics"]) for c in candidates] == [False, False, True]
    choice = virtual.choose(candidates)
    assert choice["settings"][STRATEGY] in ("ddp", "zero1"), choice["settings"]
    assert choice["runner_up"][STRATEGY] in ("ddp", "zero1"), choice["runner_up"]
    v = {"world": 8, "gpu": "H100 SXM", "traces": 3, "seconds": 1.0, "candidates": candidates, "choice": choice,
         "budget": virtual.budget(choice, virtual.with_settings(_cfg(), choice["settings"]), 8, tokens=10**9),
         "nproc_per_node": 8, "nnodes": 1}
    text = "\n".join(virtual.render(v, ["--preset", "tiny"]))
    fsdp2 = next(line for line in text.splitlines() if " fsdp2 " in line and "predicted" in line)
    assert "100.0%" in fsdp2 and "changes numerics: a bf16 residual stream" in fsdp2 and "not chosen" in fsdp2, text
    note = next(line for line in text.splitlines() if line.startswith("  not chosen: "))
    assert "predicted over the choice" in note and "set parallel.strategy=fsdp2" in note, note
    assert "parallel.strategy=fsdp2" not in next(line for line in text.splitlines() if "run it with" in line)


def test_configured_fsdp2_is_the_numerics_then_and_at_float32_nothing_changes():
    candidates = rows()
    virtual.mark_numerics(candidates, "fsdp2", "bf16")
    assert virtual.choose(candidates)["settings"][STRATEGY] == "fsdp2"
    candidates = rows()
    virtual.mark_numerics(candidates, "ddp", "float32")
    assert virtual.choose(candidates)["settings"][STRATEGY] == "fsdp2"  # the same numbers: the fastest wins


def test_when_only_another_numerics_fits_nothing_is_chosen_and_the_way_to_accept_it_is_said():
    candidates = [virtual.candidate(settings(8, strategy="ddp"), result(8, 90.0, 4, strategy="ddp", world=8), CAP),
                  virtual.candidate(settings(8, strategy="fsdp2"), result(8, 20.0, 3, strategy="fsdp2", world=8), CAP)]
    virtual.mark_numerics(candidates, "ddp", "bf16")
    assert virtual.choose(candidates) is None
    v = {"world": 8, "gpu": "H100 SXM", "traces": 2, "seconds": 1.0, "candidates": candidates, "choice": None,
         "budget": None}
    text = "\n".join(virtual.render(v, []))
    assert "nothing to choose" in text and "with the configured numerics" in text, text
    assert "nothing else fits: " in text and "set parallel.strategy=fsdp2" in text, text


def _cfg():
    from test_virtual_preflight import CFG

    return CFG


def test_the_measured_ladder_never_keeps_a_strategy_of_other_numerics_by_itself():
    from flopwise.tune.ladder import data_parallel_rungs

    cfg = _cfg()
    rungs = data_parallel_rungs(cfg, "bf16", "ddp")
    by_kind = {numerics: [o["parallel.strategy"] for o in options] for name, options, numerics in rungs
               if name == "strategy"}
    assert by_kind == {"same": ["zero1"], "residual": ["fsdp2"]}, rungs
    assert all(numerics == "same" for name, _, numerics in data_parallel_rungs(cfg, "float32", "ddp"))


def test_auto_says_when_the_strategy_it_picks_changes_numerics():
    from flopwise.config import build_config
    from flopwise.parallel.distributed import DistEnv
    from flopwise.parallel.strategy import resolve_strategy

    cfg = build_config("smollm-360m", overrides=["parallel.strategy=auto", "train.micro_batch_size=4",
                                                 "train.global_batch_size=256", "train.seq_len=2048"])
    env = DistEnv(rank=0, local_rank=0, world_size=8, backend="gloo", launched="test")
    import torch

    s = resolve_strategy(cfg, env, torch.device("cpu"), "bf16", "plain", capacity=21 * 2**30)  # 18.9 GiB: fsdp2 only
    assert s.name == "fsdp2" and "changes numerics: a bf16 residual stream where ddp keeps it fp32" in s.why, s
