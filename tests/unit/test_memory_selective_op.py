"""The memory model under train.activation_checkpointing=selective_op (flopwise.plan.memory):
what each block keeps (its input, the outputs of its matmuls and attention kernel) by hand, and
against the bytes alive after a real forward on CPU, counted by torch's ``MemTracker``. (The
saved-tensor hooks test_memory.py counts with do not see these: the checkpoint's own hooks take
the block's saved tensors, and the policy's cache holds the kept outputs.) The peak of a whole
step is in test_memory.py's test_total_matches_the_measured_peak."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flopwise.config import ModelConfig
from flopwise.model import build_model
from flopwise.model.loss import loss_sum
from flopwise.plan.memory import MemorySettings, estimate, max_micro_batch, selective_op_layer_terms
from flopwise.train.wrap import apply_activation_checkpointing

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
CPU = torch.device("cpu")


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=256)
    return ModelConfig(**{**base, **kw})


def test_kept_terms_by_hand():
    """One block, fp32, sdpa, D=64, H=4, KV=2, hd=16, F=160, B*T=64 tokens: the input and the
    cached outputs of wqkv, the attention kernel, wo, w_gate_up and w_down."""
    N = 64
    t = selective_op_layer_terms(tiny(), 2, 32, MemorySettings(precision="float32",
                                                              activation_checkpointing="selective_op"))
    assert t == {"block_input": N * 4 * 64, "qkv": N * 4 * (64 + 2 * 32), "attn_out": N * 4 * 64,
                 "logsumexp": N * 4 * 4, "attn_proj_out": N * 4 * 64, "mlp_up": N * 4 * 2 * 160,
                 "mlp_down": N * 4 * 64}
    # bf16 autocast: 2-byte matmul outputs over the float32 residual stream
    amp = selective_op_layer_terms(tiny(), 2, 32, MemorySettings(activation_checkpointing="selective_op"))
    assert amp["block_input"] == N * 4 * 64 and amp["qkv"] == N * 2 * 128 and amp["logsumexp"] == N * 4 * 4
    # compiled, the partitioner keeps only what backward reads: not w_down's output
    compiled = selective_op_layer_terms(tiny(), 2, 32, MemorySettings(precision="float32", compiled=True,
                                                                      activation_checkpointing="selective_op"))
    assert compiled == {k: v for k, v in t.items() if k != "mlp_down"}
    # SDPA's math backend: its two bmm outputs, float32, the (B, H, T, T) scores among them
    math = selective_op_layer_terms(tiny(), 2, 32, MemorySettings(attention="eager",
                                                                  activation_checkpointing="selective_op"))
    assert math["scores"] == 2 * 4 * 32 * 32 * 4 and math["attn_out"] == N * 4 * 64 and "logsumexp" not in math
    gelu = selective_op_layer_terms(tiny(mlp="gelu"), 2, 32, MemorySettings(activation_checkpointing="selective_op"))
    assert gelu["mlp_up"] == N * 2 * 160  # w_up's output; the activation is recomputed from it


def _forward_bytes(model, cfg, B, T, amp: bool, math: bool) -> int:
    """Bytes allocated by forward + loss and still alive before backward (MemTracker)."""
    def total(snap) -> int:
        return next(v for k, v in snap[CPU].items() if str(k).lower().endswith("total"))

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model)
    with tracker, sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        before = total(tracker.get_tracker_snapshot())
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            logits = model(idx)
        s = loss_sum(logits, y)
        alive = total(tracker.get_tracker_snapshot()) - before
        s.backward()
    return alive + idx.numel() * 8  # the token ids the embedding saves were made before the tracker


@pytest.mark.parametrize("mode", ["fp32-sdpa", "amp-sdpa", "amp-eager"])
@pytest.mark.parametrize("name", ["gqa-tied", "qknorm-untied"])
def test_forward_keeps_what_the_model_says(mode, name):
    """Alive after forward + loss: the plain step's activations with each block's saved set
    replaced by selective_op's kept terms, plus the logits (and, under autocast, the head's
    weight copy: the head is outside the blocks)."""
    cfg = {"gqa-tied": tiny(), "qknorm-untied": tiny(qk_norm=True, arch="qwen3", tie_embeddings=False)}[name]
    amp, math = mode.startswith("amp"), mode.endswith("eager")
    model = build_model(cfg)
    apply_activation_checkpointing(model, "selective_op")
    base = MemorySettings(precision="bf16" if amp else "float32", attention="eager" if math else "sdpa")
    op = MemorySettings(**{**base.__dict__, "activation_checkpointing": "selective_op"})
    for B, T in ((2, 32), (2, 128)):
        real = _forward_bytes(model, cfg, B, T, amp, math)
        plain = estimate(cfg, B, T, base)
        kept = sum(selective_op_layer_terms(cfg, B, T, op).values())
        head_copy = 2 * cfg.vocab_size * cfg.d_model if amp else 0
        predicted = plain.activations - cfg.n_layers * (plain.per_layer - kept) + plain.logits + head_copy
        assert predicted == pytest.approx(real, rel=0.02), (name, mode, B, T)


def test_between_full_and_none_and_no_matmul_recompute():
    cfg = tiny(n_layers=4)
    for precision in ("float32", "bf16"):
        est = {ckpt: estimate(cfg, 4, 128, MemorySettings(precision=precision, activation_checkpointing=ckpt))
               for ckpt in ("none", "full", "selective_op")}
        assert est["full"].activations < est["selective_op"].activations < est["none"].activations
        # autocast copies: the head's and, at the peak, one block's recompute (as under full)
        assert est["selective_op"].weight_copies == est["full"].weight_copies
    op = MemorySettings(precision="float32", activation_checkpointing="selective_op")
    assert op.recomputed_blocks(4) == 0  # no block recomputes its matmuls: the budget's HFU adds nothing
    mem = 64 * 2**20
    sizes = [max_micro_batch(cfg, 128, mem, MemorySettings(precision="float32", activation_checkpointing=c))
             for c in ("none", "selective_op", "full")]
    assert sizes == sorted(sizes) and sizes[0] < sizes[1]
