"""End to end on CPU: the trainer on a real (small) slice of the embedded corpus."""

import json
import math

import pytest
import torch
from helpers import assert_weights_close

from flopwise.checkpoints import latest_checkpoint, load_checkpoint
from flopwise.config import ConfigError, ModelConfig, build_config
from flopwise.model import build_model
from flopwise.train.checkpoint import save_checkpoint
from flopwise.train.optim import build_optimizer
from flopwise.train.train_step import forward_backward
from flopwise.train.trainer import train


def test_30_step_run_learns_and_writes_its_run_directory(tiny_overrides):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=30", "optim.lr=1e-2"])
    lines = []
    result = train(cfg, log=lines.append)
    out = "\n".join(lines)

    # It really learns: validation falls well below the uniform-entropy start.
    assert result.val_loss_start == pytest.approx(result.uniform_loss, abs=0.3)
    assert result.val_loss_end < result.val_loss_start - 1.0
    assert result.steps == 30 and result.tokens == 30 * 16 * 64

    run = result.run_dir
    assert build_config(config_file=run / "config.yaml") == cfg  # the resolved config, complete
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["val_loss"] == pytest.approx(result.val_loss_start)
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
    for r in train_rows:
        for key in ("step", "tokens", "loss", "lr", "grad_norm", "tok_per_s", "mfu", "step_time_s", "mem_rss_gb"):
            assert key in r, key
        assert r["mfu"] is None  # CPU: no peak, so n/a, never a guess
        assert r["eta_s"] >= 0
        assert math.isfinite(r["loss"]) and r["tok_per_s"] > 0
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 10, 20, 30]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]

    assert latest_checkpoint(run) == run / "checkpoints" / "step-0000030"
    first = (run / "samples.txt").read_text().splitlines()[0]
    assert first.startswith("--- prompt '") and "(the start of a validation document)" in first, first
    assert json.loads((run / "run.json").read_text())["result"]["steps"] == 30
    plan = json.loads((run / "plan.json").read_text())  # the plan, for plan-vs-actual later
    assert plan["tokens"] == result.tokens and plan["hours"] is None  # CPU: no peak, no time estimate
    assert plan["params"] == sum(p.numel() for p in build_model(cfg.model, device="meta").parameters())
    assert plan["batch"]["micro_batch"] == 8 and plan["batch"]["grad_accum"] == 2 and plan["memory_gb"] > 0

    # What the user sees: the summary, progress lines with every field, validation, the end.
    assert "params" in out and "FLOPs" in out and "tokens planned" in out and "precision float32" in out
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 6
    for field in ("tok ", "loss ", "lr ", "gnorm ", "tok/s", "mfu n/a", "rss ", "ms/step"):
        assert field in progress[-1], field
    assert "val loss" in out and "checkpoint" in out and "sample" in out


def test_a_finished_run_is_not_trained_again_and_a_changed_one_needs_fresh(tiny_overrides):
    overrides = tiny_overrides + ["train.max_steps=2", "eval.sample_tokens=0"]
    first = train(build_config(overrides=overrides), log=lambda s: None)
    metrics = first.run_dir / "metrics.jsonl"
    before = metrics.read_text()
    again = train(build_config(overrides=overrides), log=lambda s: None)  # resumes at its last step: nothing to do
    assert again.steps == 2 and metrics.read_text() == before
    with pytest.raises(ConfigError, match=r"train.seq_len is 32 in this configuration but 64 in the checkpoint "
                                          r".*step-0000002.*pass --fresh"):
        train(build_config(overrides=overrides + ["train.seq_len=32"]), log=lambda s: None)
    assert metrics.read_text() == before  # refused before touching anything


def test_data_vocabulary_larger_than_model_is_refused_before_training(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=2", "model.vocab_size=256",
                                                   "data.builtin_vocab_size=256"])
    cfg.data.builtin_vocab_size = 512  # bypass the config check: the data's own vocab is what counts
    with pytest.raises(ConfigError, match="vocabulary 512 but model.vocab_size is 256"):
        train(cfg, log=lambda s: None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _tiny_model_cfg():
    return ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                       max_seq_len=16)


def test_gradient_accumulation_matches_one_big_batch():
    mcfg = _tiny_model_cfg()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, mcfg.vocab_size, (8, 17), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    grads = []
    for k in (1, 2, 4):  # one batch of 8, 2 x 4, 4 x 2
        model = build_model(mcfg, device="cpu", seed=0)
        micro = [(x[i : i + 8 // k], y[i : i + 8 // k]) for i in range(0, 8, 8 // k)]
        loss = forward_backward(model, micro, step_tokens=y.numel())
        grads.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss1, g1) = grads[0]
    for k, (loss_k, gk) in zip((2, 4), grads[1:]):
        assert loss_k == pytest.approx(loss1, rel=1e-6)
        # the sums run in another order: 2.3e-7 of each gradient's norm at most here (no AdamW
        # to amplify it, so a tighter bound than tests/helpers.py's WEIGHT_REL)
        assert_weights_close(gk, g1, rel=1e-5, what=f"gradients of {k} micro-batches vs 1")


def test_checkpoint_round_trip(tmp_path):
    mcfg = _tiny_model_cfg()
    model = build_model(mcfg, device="cpu", seed=1)
    opt = build_optimizer(model, build_config().optim, torch.device("cpu"))
    x = torch.randint(0, mcfg.vocab_size, (2, 9))
    forward_backward(model, [(x[:, :-1], x[:, 1:])], step_tokens=16)
    opt.step()
    path = save_checkpoint(tmp_path, 7, model, opt, {"tokens": 123}, "model: {}\n")
    assert path.name == "step-0000007" and not list(path.parent.glob(".tmp-*"))

    model2 = build_model(mcfg, device="cpu", seed=2)
    opt2 = build_optimizer(model2, build_config().optim, torch.device("cpu"))
    state = load_checkpoint(path, model2, opt2)
    assert state == {"step": 7, "tokens": 123}
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][key], s2["state"][k][key])


def test_epoch_loader_trains_and_checkpoints_its_position(tiny_overrides):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=6", "data.loader=epoch", "eval.sample_tokens=0"])
    lines = []
    result = train(cfg, log=lines.append)
    assert any("loader epoch (" in line and "epochs)" in line for line in lines)
    state = json.loads((latest_checkpoint(result.run_dir) / "state.json").read_text())
    assert state["loader"]["mode"] == "epoch" and state["loader"]["global_sample_position"] == 6 * 16


ARCHITECTURES = {
    "gpt2": ["model.arch=gpt2", "model.norm=layernorm", "model.norm_bias=true", "model.mlp=gelu",
             "model.pos_emb=learned", "model.attn_bias=true", "model.mlp_bias=true", "model.n_kv_heads=4"],
    "qwen3-moe-docmask": ["model.arch=qwen3_moe", "model.qk_norm=true", "model.n_experts=4", "model.moe_top_k=2",
                          "model.moe_ffn_hidden=64", "model.moe_z_loss_coef=0.001", "model.doc_mask=true"],
    "custom-relu2-eager": ["model.arch=custom", "model.mlp=relu2", "model.pos_emb=none", "model.attention=eager"],
}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_other_architectures_train_and_export(name, tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ARCHITECTURES[name] + ["train.max_steps=12", "optim.lr=1e-2",
                                                                         "eval.every=0"])
    lines = []
    result = train(cfg, log=lines.append)
    out = "\n".join(lines)
    assert result.val_loss_end < result.val_loss_start - 0.5, out
    assert ("  attention  eager (reference" in out) if "eager" in name else ("  attention  auto -> sdpa" in out)
    assert (result.run_dir / "tokenizer.json").is_file()
    if cfg.model.arch == "custom":
        return
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from flopwise.model.io import export_hf, load_model

    export_hf(result.run_dir, tmp_path / "hf", log=lambda s: None)
    ours, _ = load_model(result.run_dir)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), rtol=1e-4, atol=1e-4)
