"""Chunked linear cross-entropy (flopwise.model.loss) against the plain F.linear + F.cross_entropy path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from flopwise.config import ModelConfig
from flopwise.model import build_model
from flopwise.model import loss as losses
from flopwise.model.loss import (
    chunked_cross_entropy,
    fused_linear_cross_entropy_available,
    linear_cross_entropy,
    loss_sum,
    plain_linear_cross_entropy,
)

N, D, V = 200, 24, 300
MODES = [pytest.param(False, id="recompute"), pytest.param(True, id="grads-in-forward")]


def make(n=N, d=D, v=V, dtype=torch.float32, ignore_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()  # (N, D)
    weight = (torch.randn(v, d, generator=g) / d**0.5).to(dtype).requires_grad_()  # (V, D)
    targets = torch.randint(0, v, (n,), generator=g)  # (N,)
    if ignore_every:
        targets[::ignore_every] = -100
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets, scale=0.37, **kw):
    """Loss and d(scale * loss)/d(hidden, weight); a non-unit scale checks grad_output is applied."""
    loss = fn(hidden, weight, targets, **kw)
    gh, gw = torch.autograd.grad(loss * scale, (hidden, weight))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("grads_in_forward", MODES)
@pytest.mark.parametrize("chunk", [3, 50, 64, N, 1000])  # 50 divides N, 3 and 64 do not, 1000 > N
def test_matches_plain_float32(chunk, grads_in_forward):
    hidden, weight, targets = make()
    ref = loss_and_grads(plain_linear_cross_entropy, hidden, weight, targets)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=chunk,
                         grads_in_forward=grads_in_forward)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)


def test_plain_is_loss_sum_of_the_logits():
    hidden, weight, targets = make(ignore_every=3)
    logits = torch.nn.functional.linear(hidden, weight)
    torch.testing.assert_close(plain_linear_cross_entropy(hidden, weight, targets), loss_sum(logits, targets),
                               rtol=0, atol=0)


@pytest.mark.parametrize("grads_in_forward", MODES)
def test_ignore_index_rows_add_nothing(grads_in_forward):
    hidden, weight, targets = make(ignore_every=3)
    ref = loss_and_grads(plain_linear_cross_entropy, hidden, weight, targets)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=37,
                         grads_in_forward=grads_in_forward)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ignored = targets == -100
    assert torch.all(got[1][ignored] == 0)  # exactly zero, not merely small
    # The same loss as over the kept rows alone.
    keep = ~ignored
    alone = chunked_cross_entropy(hidden[keep], weight, targets[keep], chunk_tokens=37)
    torch.testing.assert_close(got[0], alone.detach(), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("grads_in_forward", MODES)
def test_all_ignored_and_other_ignore_index(grads_in_forward):
    hidden, weight, targets = make(n=10)
    loss, gh, gw = loss_and_grads(chunked_cross_entropy, hidden, weight, torch.full_like(targets, -100),
                                  grads_in_forward=grads_in_forward)
    assert loss.item() == 0.0 and torch.all(gh == 0) and torch.all(gw == 0)
    targets[:4] = 7  # ignore_index=7: those four rows drop out
    ref = plain_linear_cross_entropy(hidden, weight, targets, ignore_index=7)
    torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, 3, ignore_index=7), ref)


def test_leading_dims_are_flattened():
    hidden, weight, targets = make(n=24)
    a = chunked_cross_entropy(hidden.reshape(4, 6, D), weight, targets.reshape(4, 6), chunk_tokens=5)
    torch.testing.assert_close(a, plain_linear_cross_entropy(hidden, weight, targets))


@pytest.mark.parametrize("grads_in_forward", MODES)
def test_bf16_autocast_matches_plain_under_the_same_autocast(grads_in_forward):
    hidden, weight, targets = make(n=512, d=64, v=1024, ignore_every=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads(plain_linear_cross_entropy, hidden, weight, targets)
        got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=100,
                             grads_in_forward=grads_in_forward)
    fp32 = loss_and_grads(plain_linear_cross_entropy, hidden, weight, targets)
    # The matmul really ran in bf16: the result is far closer to plain-under-autocast than to fp32.
    assert (got[0] - ref[0]).abs() <= 0.1 * (ref[0] - fp32[0]).abs()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-2)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.float32  # gradients land in the inputs' dtype
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()  # bf16 rounding of d(logits) and the products


def test_pure_bf16_inputs_without_autocast():
    hidden, weight, targets = make(n=128, d=32, v=512, dtype=torch.bfloat16)
    ref = loss_and_grads(plain_linear_cross_entropy, hidden, weight, targets)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=48)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-2)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


@pytest.mark.parametrize("grads_in_forward", MODES)
def test_tied_embedding_accumulates_both_gradients(grads_in_forward):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (3, 20), generator=g)
    targets = torch.randint(0, V, (3, 20), generator=g)
    proj = torch.randn(D, D, generator=g) / D**0.5

    def grads(loss_fn, **kw):
        torch.manual_seed(0)
        emb = nn.Embedding(V, D)
        hidden = torch.tanh(emb(idx) @ proj)  # (3, 20, D): the embedding is used in the forward ...
        loss = loss_fn(hidden, emb.weight, targets, **kw)  # ... and as the head
        loss.backward()
        return loss.detach(), emb.weight.grad

    ref = grads(plain_linear_cross_entropy)
    got = grads(chunked_cross_entropy, chunk_tokens=16, grads_in_forward=grads_in_forward)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    # The embedding path really contributed: the head's share alone is a different gradient.
    torch.manual_seed(0)
    emb = nn.Embedding(V, D)
    hidden = torch.tanh(emb(idx) @ proj).detach()
    head_only = torch.autograd.grad(chunked_cross_entropy(hidden, emb.weight, targets, 16), emb.weight)[0]
    assert not torch.allclose(head_only, got[1], atol=1e-4)


@pytest.mark.parametrize("grads_in_forward", MODES)
def test_saves_o_n_plus_vd_not_n_times_v(grads_in_forward, saved_bytes):
    n, d, v = 2048, 16, 2048  # N x V = 4M floats against N x D + V x D = 64k
    hidden, weight, targets = make(n=n, d=d, v=v)
    plain = saved_bytes(lambda: plain_linear_cross_entropy(hidden, weight, targets))
    chunked = saved_bytes(lambda: chunked_cross_entropy(hidden, weight, targets, chunk_tokens=256,
                                                        grads_in_forward=grads_in_forward))
    assert plain >= 4 * n * v  # the float32 log-softmax
    if grads_in_forward:  # grad_hidden (N, D) + grad_weight (V, D), float32
        assert chunked == 4 * n * d + 4 * v * d
    else:  # hidden (N, D) + weight (V, D) + targets (N,) int64 + logsumexp (N,) float32
        assert chunked == 4 * n * d + 4 * v * d + 8 * n + 4 * n
    assert chunked < plain / 4


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("grads_in_forward", MODES)
def test_full_logits_never_exist_even_transiently(grads_in_forward):
    n, d, v, chunk = 1024, 16, 1024, 128
    hidden, weight, targets = make(n=n, d=d, v=v)
    with LargestTensor() as plain:
        plain_linear_cross_entropy(hidden, weight, targets).backward()
    with LargestTensor() as chunked:
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk, grads_in_forward=grads_in_forward).backward()
    assert plain.numel >= n * v
    assert chunked.numel <= chunk * v  # one chunk's logits is the largest thing ever made


def test_grads_in_forward_skipped_without_grad_mode_and_second_backward_refused(saved_bytes):
    hidden, weight, targets = make()
    with torch.no_grad():
        nothing = saved_bytes(lambda: chunked_cross_entropy(hidden, weight, targets, grads_in_forward=True))
        loss = chunked_cross_entropy(hidden, weight, targets, grads_in_forward=True)
    assert nothing == 0 and not loss.requires_grad
    torch.testing.assert_close(loss, plain_linear_cross_entropy(hidden, weight, targets).detach())
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=64, grads_in_forward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):  # the held gradients were scaled in place: never reused silently
        loss.backward()


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_only_one_input_requires_grad(which):
    hidden, weight, targets = make()
    (hidden if which == "weight" else weight).requires_grad_(False)
    x = hidden if which == "hidden" else weight
    ref = torch.autograd.grad(plain_linear_cross_entropy(hidden, weight, targets), x)[0]
    got = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, chunk_tokens=64), x)[0]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("tied", [True, False])
def test_training_step_with_forward_hidden_matches_model_logits(tied):
    cfg = tiny(tie_embeddings=tied)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, cfg.vocab_size, (3, 33), generator=g)
    y = torch.randint(0, cfg.vocab_size, (3, 33), generator=g)
    y[0, :5] = -100
    step_tokens = y.numel()

    def step(use_chunked: bool):
        model = build_model(cfg, seed=0)
        if use_chunked:
            s = linear_cross_entropy(model.forward_hidden(x), model.head_weight, y, impl="chunked", chunk_tokens=20)
        else:
            s = loss_sum(model(x), y)
        (s / step_tokens).backward()
        return s.detach(), {n: p.grad for n, p in model.named_parameters()}

    (ref_loss, ref_grads), (loss, grads) = step(False), step(True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_step_under_bf16_autocast():
    cfg = tiny()
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    y = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)

    def step(use_chunked: bool):
        model = build_model(cfg, seed=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if use_chunked:
                s = chunked_cross_entropy(model.forward_hidden(x), model.head_weight, y, chunk_tokens=24)
            else:
                s = loss_sum(model(x), y)
        (s / y.numel()).backward()
        return s.detach(), model.tok_emb.weight.grad

    (ref_loss, ref_grad), (loss, grad) = step(False), step(True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-3)
    assert (grad - ref_grad).abs().max() <= 2e-2 * ref_grad.abs().max()


def test_impl_selection_on_cpu():
    hidden, weight, targets = make(n=32)
    assert not fused_linear_cross_entropy_available("cpu")
    ref = plain_linear_cross_entropy(hidden, weight, targets)
    for impl in ("auto", "chunked", "plain"):
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, impl=impl, chunk_tokens=7), ref)
    with pytest.raises(RuntimeError, match="fused"):
        linear_cross_entropy(hidden, weight, targets, impl="fused")
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, targets, impl="triton")


def test_fused_path_calls_liger_by_keyword(monkeypatch):
    """The Liger path cannot run here (CPU, not installed): check its wiring with a stand-in."""
    calls = []

    def fake_liger(input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                   label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None):
        calls.append(dict(ignore_index=ignore_index, reduction=reduction, accum_dtype=accum_dtype,
                          contiguous=input.is_contiguous(), shape=tuple(input.shape)))
        return plain_linear_cross_entropy(input, weight, target, ignore_index).to(torch.bfloat16)

    monkeypatch.setattr(losses, "_liger_flce", lambda: fake_liger)
    monkeypatch.setattr(losses, "fused_linear_cross_entropy_available", lambda device: True)
    hidden, weight, targets = make(n=24, ignore_every=4)
    loss = linear_cross_entropy(hidden.reshape(4, 6, D), weight, targets.reshape(4, 6))  # auto -> fused
    assert calls == [dict(ignore_index=-100, reduction="sum", accum_dtype=torch.float32, contiguous=True,
                          shape=(24, D))]
    assert loss.dtype == torch.float32


def test_bad_arguments():
    hidden, weight, targets = make(n=8)
    with pytest.raises(TypeError):  # outside autocast, as F.linear, both dtypes must agree
        chunked_cross_entropy(hidden.double(), weight, targets)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, targets[:5])


@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo's own tracing
@pytest.mark.parametrize("grads_in_forward", MODES)
def test_traces_under_torch_compile_fullgraph(grads_in_forward):
    """``compile=model`` puts the head and loss inside one compiled graph: no graph break."""
    hidden, weight, targets = make(n=60, ignore_every=7)
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w, t: chunked_cross_entropy(h, w, t, 16, grads_in_forward=grads_in_forward),
                       backend="aot_eager", fullgraph=True)
    got = loss_and_grads(fn, hidden, weight, targets)
    ref = loss_and_grads(plain_linear_cross_entropy, hidden, weight, targets)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
