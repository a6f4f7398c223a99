"""Throughput features on CPU: checkpointing, compile, explain, recompile watch, timers,
profiler-off, precision modes."""

import pytest
import torch
import torch.nn.functional as F
from helpers import grads_of
from helpers import token_batch as batch

from flopwise.config import ConfigError, ModelConfig, build_config
from flopwise.measure.timing import StepTimer, _NoProfiler, format_breakdown, profiler
from flopwise.model import build_model
from flopwise.model.loss import make_loss_fn
from flopwise.train import precision as precision_mod
from flopwise.train.wrap import RecompileWatch, apply_activation_checkpointing, explain, wrap_model


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=128, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                                 max_seq_len=32), **kw})




@pytest.mark.parametrize("mode,k,expected", [("full", 2, [0, 1, 2, 3]), ("selective", 2, [0, 2]),
                                             ("selective", 3, [0, 3])])
def test_activation_checkpointing_gives_equal_gradients_and_keeps_names(mode, k, expected):
    ref = build_model(tiny(), seed=1)
    loss_a, ga = grads_of(ref)
    model = build_model(tiny(), seed=1)
    names = list(model.state_dict())
    assert apply_activation_checkpointing(model, mode, k) == expected
    assert list(model.state_dict()) == names  # checkpoints and exports see the same names
    loss_b, gb = grads_of(model)
    assert torch.equal(loss_a, loss_b)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=0, atol=0)


def test_checkpointing_saves_less_for_backward(saved_bytes):
    def saved(model):
        x, y = batch(T=32)
        return saved_bytes(lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward())

    plain = saved(build_model(tiny(), seed=2))
    model = build_model(tiny(), seed=2)
    apply_activation_checkpointing(model, "full")
    assert saved(model) < 0.7 * plain


@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.slow
def test_compiled_and_eager_give_the_same_loss_and_gradients(how):
    cfg = build_config(overrides=[f"train.compile={how}"])
    ref = build_model(tiny(), seed=3)
    loss_a, ga = grads_of(ref)
    model = build_model(tiny(), seed=3)
    wrap_model(model, cfg.train)
    loss_fn = make_loss_fn(model, "plain", compile_mode="default" if how == "model" else None)
    loss_b, gb = grads_of(model, loss_fn)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5)


def test_explain_reports_graphs_and_breaks():
    model = build_model(tiny(), seed=4)
    x, _ = batch()
    report = explain(model, x)
    assert report["graphs"] >= 1 and report["graph_breaks"] == len(report["reasons"])

    def breaks(x):
        y = x * 2
        print("", end="")  # a graph break: print is not traced
        return y + 1

    assert explain(breaks, torch.randn(3))["graph_breaks"] >= 1


def test_recompiles_after_warm_up_are_reported():
    watch = RecompileWatch(True)
    try:
        f = torch.compile(lambda x: x * 3 + 1, dynamic=False)
        f(torch.randn(4))
        watch.arm()
        f(torch.randn(4))
        assert watch.check() is None  # same shapes: no recompile
        f(torch.randn(7))  # a new shape mid-training
        warning = watch.check()
        assert warning is not None and "recompilation" in warning and "performance bug" in warning
    finally:
        watch.close()
    assert RecompileWatch(False).check() is None


def test_profiler_off_is_a_null_context(tmp_path):
    p = profiler(False, tmp_path, 1, 1, 1)
    assert isinstance(p, _NoProfiler)
    with p as prof:
        prof.step()
    assert not any(tmp_path.iterdir())


def test_profiler_writes_a_trace(tmp_path):
    with profiler(True, tmp_path / "profile", 0, 1, 1) as prof:
        for _ in range(3):
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.step()
    assert list((tmp_path / "profile").glob("*.json"))


def test_step_timer_splits_a_step(monkeypatch):
    from types import SimpleNamespace

    from flopwise.measure import timing

    now = [0.0]  # a fake clock: the test says how long each part took, whatever the machine's load

    def spend(seconds):
        now[0] += seconds

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    timer = StepTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.part("fwd_bwd"):
            for _b in timer.timed_batches(lambda: spend(0.002), 2):
                spend(0.003)
        with timer.part("optim"):
            spend(0.002)
        timer.end_step(0.02)
    parts = timer.window()
    assert parts["time_data_s"] == pytest.approx(0.004)  # 2 fetches of 2 ms per step
    assert parts["time_fwd_bwd_s"] == pytest.approx(0.006)  # the part's 10 ms less its data time
    assert parts["time_optim_s"] == pytest.approx(0.002)
    assert "data" in format_breakdown(parts, 0.02) and timer.steps == 0


def test_precision_modes():
    cpu = torch.device("cpu")
    assert precision_mod.resolve("auto", cpu).name == "float32"
    assert precision_mod.resolve("bf16", cpu).autocast_dtype == torch.bfloat16
    p = precision_mod.resolve("bf16-pure", cpu)
    assert p.param_dtype == torch.bfloat16 and p.autocast_dtype is None
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        precision_mod.resolve("fp16", cpu)
    with pytest.raises(ConfigError, match="fp8=true needs a CUDA GPU"):
        precision_mod.apply_fp8(build_model(tiny()), cpu)


def test_bf16_pure_keeps_fp32_masters():
    model = build_model(tiny(), seed=5)
    mw = precision_mod.MasterWeights(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in mw.master.parameters())
    assert model.rope_cos.dtype == torch.float32  # buffers stay float32
    opt = torch.optim.AdamW(mw.master.parameters(), lr=1e-3)
    x, y = batch()
    F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
    mw.grads_to_master()
    assert all(p.grad is None for p in model.parameters()) and all(p.grad.dtype == torch.float32
                                                                   for p in mw.master.parameters())
    before = [p.detach().clone() for p in mw.master.parameters()]
    opt.step()
    mw.master_to_model()
    for p, m, b in zip(model.parameters(), mw.master.parameters(), before):
        assert torch.equal(p, m.to(torch.bfloat16))
        assert not torch.equal(m, b)  # the fp32 copy moved by updates smaller than bf16 resolution too


def test_memory_model_of_the_chunked_loss_matches_what_autograd_saves(saved_bytes):
    from flopwise.model.loss import linear_cross_entropy
    from flopwise.plan.memory import MemorySettings, _logits_bytes, estimate

    cfg = tiny(vocab_size=4096, d_model=64)
    model = build_model(cfg)
    x, y = batch(B=4, T=32, V=4096)
    hidden = model.forward_hidden(x)
    saved = saved_bytes(lambda: linear_cross_entropy(hidden.flatten(0, 1), model.head_weight, y.flatten(),
                                                     impl="chunked", chunk_tokens=64, grads_in_forward=True))
    predicted = _logits_bytes(cfg, 4, 32, MemorySettings(precision="float32", loss="chunked"))
    targets = 4 * 32 * 8  # int64 targets, counted by the model, not seen as a saved tensor
    assert saved == predicted - targets
    plain = estimate(cfg, 4, 32, MemorySettings(precision="float32"))
    chunked = estimate(cfg, 4, 32, MemorySettings(precision="float32", loss="chunked", loss_chunk_tokens=64))
    assert chunked.logits < plain.logits and chunked.transient < plain.transient


def test_the_cpu_overhead_is_printed_as_the_lower_bound_it_is():
    parts = {"time_data_s": 0.001, "time_fwd_bwd_s": 0.06, "time_optim_s": 0.01, "time_log_s": 0.0,
             "cpu_overhead": 0.25}
    assert format_breakdown(parts, 0.1).endswith("cpu overhead ≥25%")
