"""The throughput options through the real trainer on the small corpus (CPU)."""

import json

import pytest

from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=2"]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_memory_savers_muon_wsd_and_the_step_breakdown(tiny_overrides):
    cfg = build_config(overrides=tiny_overrides + QUIET + [
        "train.max_steps=10", "train.activation_checkpointing=selective", "train.loss=chunked",
        "train.loss_chunk_tokens=100", "optim.name=muon", "optim.schedule=wsd", "optim.decay_fraction=0.3",
        "train.profile=true", "train.profile_wait=1", "train.profile_warmup=1", "train.profile_active=2"])
    lines = []
    result = train(cfg, log=lines.append)
    out = "\n".join(lines)
    assert result.val_loss_end < result.val_loss_start - 0.3, out
    assert "activation checkpointing selective: 1 of 2 blocks" in out and "loss chunked, 100 tokens per chunk" in out
    assert "Muon lr 0.02" in out and "AdamW lr 0.003" in out and "WSD: linear decay over the last 30%" in out
    logged = [r for r in rows(result.run_dir) if r.get("loss") is not None]
    for r in logged:
        for key in ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_log_s"):
            assert r[key] >= 0, key
    assert any("data " in line and "fwd+bwd" in line for line in lines)
    lr = {r["step"]: r["lr"] for r in logged}  # warm-up 5 steps, stable, decay over steps 8-10
    assert lr[6] == pytest.approx(0.003) and lr[10] == pytest.approx(0.0003)
    assert list((result.run_dir / "profile").glob("*.json"))  # a TensorBoard-readable trace


@pytest.mark.slow
def test_batch_ramp_grows_the_steps_and_resumes(tiny_overrides):
    # micro-batch 8 x 64 = 512 tokens; full step 2 micro-batches; ramp from 1 over 4,096 tokens
    cfg = build_config(overrides=tiny_overrides + QUIET + [
        "train.max_steps=0", "train.max_tokens=12288", "train.batch_ramp_tokens=4096", "train.batch_ramp_start=1"])
    lines = []
    result = train(cfg, log=lines.append)
    assert result.tokens == 12288 and any("batch ramp 1 -> 2 micro-batches" in line for line in lines)
    tokens = [r["tokens"] for r in rows(result.run_dir) if r.get("loss") is not None]
    steps = [r["step"] for r in rows(result.run_dir) if r.get("loss") is not None]
    # early steps carry 512 tokens, later ones 1,024
    assert tokens[0] / steps[0] < tokens[-1] / steps[-1]
    assert result.steps < 12288 // 512


@pytest.mark.slow
def test_bf16_pure_trains_and_checkpoints_fp32(tiny_overrides):
    import torch

    from flopwise.checkpoints import latest_checkpoint

    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=4", "train.precision=bf16-pure"])
    result = train(cfg, log=lambda s: None)
    assert result.val_loss_end < result.val_loss_start
    state = torch.load(latest_checkpoint(result.run_dir) / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values())


def test_wsd_fitted_to_the_time_budget_stops_with_the_decay_finished(tiny_overrides, tick_clock):
    cfg = build_config(overrides=tiny_overrides + QUIET + [
        "train.max_steps=2000", "train.max_hours=0.005", "optim.schedule=wsd", "optim.fit_to_time=true",
        "optim.warmup_steps=2", "train.log_every=1"])
    result = train(cfg, log=lambda s: None, clock=tick_clock)  # 18 s of budget at 0.1 s a reading
    assert result.stopped == "the time budget is used with the decay finished"
    lrs = [r["lr"] for r in rows(result.run_dir) if r.get("lr") is not None]
    assert max(lrs) == pytest.approx(cfg.optim.lr)
    assert lrs[-1] < 0.5 * cfg.optim.lr  # well into the decay when the budget ran out


def test_explain_from_the_command_line(tiny_overrides, capsys):
    assert cli_main(["train", "--explain", *tiny_overrides]) == 0
    out = capsys.readouterr().out
    assert "explain: " in out and "graph(s)" in out and "graph break(s)" in out


def test_mfu_conventions_with_a_known_peak(tiny_overrides):
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=8", "train.peak_tflops=1",
                                                           "train.activation_checkpointing=full",
                                                           "train.warmup_log_steps=1"])
    result = train(cfg, log=lambda s: None)
    logged = [r for r in rows(result.run_dir) if r.get("mfu") is not None]
    assert logged
    from flopwise.plan.flops import flops_per_token, flops_per_token_6n, hardware_flops_per_token

    m, T = cfg.model, cfg.train.seq_len
    for r in logged:
        assert r["mfu_6n"] == pytest.approx(r["mfu"] * flops_per_token_6n(m) / flops_per_token(m, T))
        assert r["hfu"] == pytest.approx(r["mfu"] * hardware_flops_per_token(m, T, True) / flops_per_token(m, T))
