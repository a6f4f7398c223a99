"""The kernel log (tune/kernels.py) reads each attention kernel's shapes in that kernel's own
layout: SDPA's ops take (batch, heads, tokens, head_dim), the raw flash and memory-efficient
kernels (batch, tokens, heads, head_dim), and the varlen flash kernel (tokens, heads, head_dim)
with the longest sequence given apart. Real aten ops on fake CUDA tensors, as the dry run runs them."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flopwise.tune.kernels import KernelLog

B, T, H, KV, D = 2, 256, 8, 2, 64


def _attention_records(call) -> list[dict]:
    """The attention records of ``call()``, which makes its fake CUDA tensors and calls one op."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        log = KernelLog()
        with log:
            call()
    return [r for r in log.records if r["kind"] == "attn"]


def _shape(r: dict) -> tuple:
    return r["batch"], r["heads"], r["kv_heads"], r["q_len"], r["k_len"], r["head_dim"], r["causal"]


def _bf16(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)


def test_sdpa_ops_are_read_as_batch_heads_tokens():
    [r] = _attention_records(lambda: torch.ops.aten._scaled_dot_product_efficient_attention(
        _bf16(B, H, T, D), _bf16(B, KV, T, D), _bf16(B, KV, T, D), None, False, is_causal=True))
    assert (r["kernel"], r["way"]) == ("efficient", "fwd")
    assert _shape(r) == (B, H, KV, T, T, D, True)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_raw_kernels_are_read_as_batch_tokens_heads(kernel):
    def call():
        q, kv = _bf16(B, T, H, D), _bf16(B, T, KV, D)
        if kernel == "flash":
            torch.ops.aten._flash_attention_forward(q, kv, kv, None, None, T, T, 0.0, True, False)
        else:  # custom_mask_type 1: causal from the top left
            torch.ops.aten._efficient_attention_forward(q, kv, kv, None, None, None, None, None, 0.0, 1)
    [r] = _attention_records(call)
    assert r["kernel"] == kernel
    assert _shape(r) == (B, H, KV, T, T, D, True), f"read {_shape(r)}"


def test_a_varlen_flash_call_is_priced_as_sequences_of_its_longest_length():
    total, longest = B * T, T // 2
    def call():
        q, kv = _bf16(total, H, D), _bf16(total, KV, D)
        cu = torch.empty(5, device="cuda", dtype=torch.int32)
        torch.ops.aten._flash_attention_forward(q, kv, kv, cu, cu, longest, longest, 0.0, True, False)
    [r] = _attention_records(call)
    assert _shape(r) == (total // longest, H, KV, longest, longest, D, True), f"read {_shape(r)}"


def test_a_matmul_is_recorded_with_its_shape_and_torchs_flop_count():
    def call():
        x, w, b = _bf16(64, 96), _bf16(96, 160), _bf16(160)
        torch.addmm(b, x, w)
        torch.bmm(_bf16(3, 64, 96), _bf16(3, 96, 160))
    with FakeTensorMode(allow_non_fake_inputs=True):
        log = KernelLog()
        with log:
            call()
    mm = [(r["op"], r["m"], r["n"], r["k"], r["batch"], r["flops"]) for r in log.records if r["kind"] == "mm"]
    assert mm == [("addmm", 64, 160, 96, 1, 2 * 64 * 160 * 96), ("bmm", 64, 160, 96, 3, 3 * 2 * 64 * 160 * 96)]


def test_cudnn_attention_is_read_with_its_shapes_and_causality():
    """The kernel SDPA runs first on sm90/sm100 from torch 2.11's wheels: forward and backward
    recorded as cuDNN's, (batch, heads, tokens, head_dim), GQA's key heads kept apart."""
    def call():  # the backward op called as autograd calls it (the engine itself needs a real CUDA device)
        q, kv = _bf16(B, H, T, D), _bf16(B, KV, T, D)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kv, kv, None, True, 0.0, True, False)
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            out[0], q, kv, kv, out[0], out[1], out[6], out[7], None, None, None, T, T, 0.0, True)
    records = _attention_records(call)
    assert [(r["kernel"], r["way"]) for r in records] == [("cudnn", "fwd"), ("cudnn", "bwd")]
    assert {_shape(r) for r in records} == {(B, H, KV, T, T, D, True)}
