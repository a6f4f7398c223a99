"""The fast defaults: what ``auto`` becomes for compile and the loss, decided per device and
printed with the reason. CUDA decisions are taken for ``torch.device("cuda")`` with the GPU's
memory given, so they are checked here without one; the graph they produce is traced on CPU."""

import pytest
import torch

from flopwise.config import build_config
from flopwise.model import build_model
from flopwise.model.loss import make_loss_fn
from flopwise.train.defaults import resolve_compile, resolve_speed
from flopwise.train.trainer import train
from flopwise.train.wrap import explain

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
GiB = 2**30


def test_compile_auto_is_the_whole_model_on_cuda_and_off_on_a_cpu():
    assert resolve_compile("auto", CUDA)[0] == "model"
    assert resolve_compile("auto", CPU)[0] == "off"
    assert resolve_compile("blocks", CUDA) == ("blocks", "")  # asked for: kept, nothing to explain


def test_on_cuda_the_loss_is_plain_inside_the_graph_while_the_logits_fit():
    cfg = build_config(preset="smollm-360m", overrides=["train.seq_len=2048", "train.micro_batch_size=8"])
    resolved, notes = resolve_speed(cfg, CUDA, "bf16", 1, total_bytes=80 * GiB)
    assert (resolved.train.compile, resolved.train.loss) == ("model", "plain")
    assert notes == {"compile": "auto -> model (CUDA: forward, LM head and loss as one graph)",
                     "loss": "auto -> plain (inside the compiled graph)"}
    assert (cfg.train.compile, cfg.train.loss) == ("auto", "auto")  # the run's config.yaml keeps auto


def test_on_cuda_the_chunked_loss_only_where_the_memory_model_says_the_logits_do_not_fit():
    cfg = build_config(preset="smollm-360m", overrides=["train.seq_len=2048", "train.micro_batch_size=16"])
    resolved, notes = resolve_speed(cfg, CUDA, "bf16", 1, total_bytes=16 * GiB)
    assert (resolved.train.compile, resolved.train.loss) == ("model", "chunked")
    assert "no full logits: with full logits the memory model's peak is" in notes["loss"]
    assert "> 90% of 16 GiB" in notes["loss"]


def test_explicit_choices_are_kept_and_cpu_defaults_stay_eager_and_chunked():
    cfg = build_config(preset="tiny", overrides=["train.loss=plain", "train.compile=off"])
    resolved, notes = resolve_speed(cfg, CUDA, "bf16", 1, total_bytes=80 * GiB)
    assert (resolved.train.compile, resolved.train.loss, notes) == ("off", "plain", {})
    resolved, notes = resolve_speed(build_config(preset="tiny"), CPU, "float32", 1)
    assert (resolved.train.compile, resolved.train.loss) == ("off", "chunked")
    assert notes["compile"].startswith("auto -> off (CPU")


def test_the_default_cuda_graph_is_one_graph_without_breaks():
    """What CUDA compiles by default (the whole loss, plain), traced on CPU: one graph."""
    cfg = build_config(preset="tiny", overrides=["train.seq_len=64"])
    resolved, _ = resolve_speed(cfg, CUDA, "bf16", 1, total_bytes=80 * GiB)
    model = build_model(resolved.model, device=CPU, seed=0)
    loss_fn = make_loss_fn(model, resolved.train.loss, resolved.train.loss_chunk_tokens)
    x = torch.randint(0, resolved.model.vocab_size, (2, 64))
    report = explain(lambda a, b: loss_fn(a, b)[0], x, x)
    assert (report["graphs"], report["graph_breaks"]) == (1, 0), report["reasons"]


@pytest.mark.slow
def test_the_start_up_summary_says_what_auto_became_and_why(tiny_overrides):
    lines = []
    train(build_config(overrides=tiny_overrides + ["train.max_steps=1", "eval.sample_tokens=0"]), log=lines.append)
    speed = [line for line in lines if "auto ->" in line]
    assert any("compile auto -> off (CPU" in line for line in speed), lines
    assert any("loss auto -> chunked (not compiled: fewer passes and no full logits), 1024 tokens per chunk" in line
               for line in speed), lines
