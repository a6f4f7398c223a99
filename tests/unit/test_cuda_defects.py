"""CPU stand-ins for defects that would show on a CUDA machine (issue 15).

- The declared torch floor covers the newest torch API the code calls.
- DDP does not broadcast buffers every forward (the RoPE tables are the same on every
  rank), and ZeRO-1 keeps each rank's parameters in one bucket (one broadcast per rank).
- ``generate`` on fp32 weights runs whatever attention backend training chose: flash-attn
  refuses fp32, so a model configured for flash must fall back for sampling (the run's
  final ``write_sample`` crashed on a machine with flash-attn installed).
- The fused (Liger) loss under ``compile=model`` runs after the compiled forward, not inside
  the compiled step, where its host reads would break the graph.
- ``model.doc_mask`` + flash + compile: the documents are cut once per forward by an op the
  compiler does not look into, so the step stays one graph, reads the host once per forward
  rather than per layer, and does not recompile when the number of documents changes
  (flash-attn's varlen kernel stood in for by an op registered through ``torch.library``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn.functional as F
from helpers import assert_weights_close

from flopwise.config import ModelConfig
from flopwise.evaluate.generate import Sampling, generate
from flopwise.model import attention as A
from flopwise.model import build_model

ROOT = Path(__file__).resolve().parents[2]

# torch API -> the first torch release that has it (where the code calls it unguarded).
NEWER_API = {
    "get_total_norm": (2, 6),
    "clip_grads_with_norm_": (2, 6),
    "from torch.distributed.fsdp import": (2, 6),  # the public fully_shard / MixedPrecisionPolicy / FSDPModule
    "torch.get_autocast_dtype": (2, 4),
    "rms_norm": (2, 4),
    "torch.compiler.is_compiling": (2, 3),
}


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def test_the_declared_torch_floor_covers_the_api_the_code_calls():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [d for d in deps if re.match(r"torch\b", d)]
    floor = _version(re.search(r">=\s*([\d.]+)", torch_req).group(1))
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "flopwise").rglob("*.py"))
    used = {api: v for api, v in NEWER_API.items() if api in source}
    assert {"get_total_norm", "clip_grads_with_norm_", "from torch.distributed.fsdp import"} <= set(used)
    needed = max(used.values())
    assert floor >= needed, f"pyproject says {torch_req!r}; the code calls {sorted(used)} (needs >= {needed})"
    assert _version(torch.__version__) >= floor


# --------------------------------------------------------------------------- DDP / ZeRO-1 wrappers

@pytest.fixture
def one_rank_gloo(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tiny_run():
    from flopwise.config import RunConfig

    cfg = RunConfig()
    m = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
    return cfg, build_model(m, seed=0)


def test_ddp_does_not_broadcast_the_rope_buffers(one_rank_gloo):
    from flopwise.parallel.distributed import DistEnv
    from flopwise.parallel.strategy import apply_data_parallel

    cfg, model = _tiny_run()
    assert model.rope_cos.numel() > 0  # there are buffers it would broadcast
    for strategy in ("ddp", "zero1"):
        wrapped, _ = apply_data_parallel(model, strategy, DistEnv(world_size=1, backend="gloo"),
                                         torch.device("cpu"), cfg, None)
        assert wrapped.broadcast_buffers is False
        assert wrapped.require_forward_param_sync is True  # still the (no-op at 1 rank) param check


def test_zero1_keeps_each_ranks_parameters_in_one_bucket_and_steps_like_adamw(one_rank_gloo):
    from flopwise.config import OptimConfig
    from flopwise.parallel.strategy import zero1_optimizer
    from flopwise.train.optim import build_optimizer

    _, model = _tiny_run()
    _, ref = _tiny_run()
    ocfg = OptimConfig()
    zero = zero1_optimizer(build_optimizer(model, ocfg, torch.device("cpu")))
    plain = build_optimizer(ref, ocfg, torch.device("cpu"))
    assert zero.parameters_as_bucket_view is True
    (bucket,) = [b for dev in zero._buckets for b in dev]
    base = bucket.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in model.parameters())  # views of the bucket
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        for m, opt in ((model, zero), (ref, plain)):
            opt.zero_grad()
            m(idx).float().logsumexp(-1).mean().backward()
            opt.step()
    assert_weights_close(dict(model.named_parameters()), dict(ref.named_parameters()), what="zero1 vs AdamW")
    zero.consolidate_state_dict(to=0)  # what dist_checkpoint does before saving
    assert len(zero.state_dict()["state"]) == len(list(model.parameters()))


# --------------------------------------------------------------------------- generate vs flash-attn

class _FlashRefusesFp32:
    """flash-attn's behaviour as far as dtype goes: fp16/bf16 only (RuntimeError otherwise)."""

    def __init__(self):
        self.calls = 0

    def _check(self, q):
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        self.calls += 1

    def func(self, q, k, v, causal=False):  # (B, T, H|KV, hd)
        self._check(q)
        n_rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal)
        return out.transpose(1, 2)

    def varlen(self, *args, **kwargs):  # pragma: no cover - generate never passes documents
        raise AssertionError("no documents in generate")


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """flash "installed": kernels that refuse fp32, and availability as on a CUDA machine
    (usable for fp16/bf16 only)."""
    fake = _FlashRefusesFp32()
    kernels = A._FlashKernels("FA2", "stand-in", fake.func, fake.varlen)
    monkeypatch.setattr(A, "_flash_kernels", lambda device: kernels)
    real = A.available_backends

    def available(device, dtype):
        out = dict(real(device, dtype))
        out["flash"] = None if dtype in (torch.float16, torch.bfloat16) else "needs fp16/bf16"
        return out

    monkeypatch.setattr(A, "available_backends", available)
    return fake


def _tiny_lm(seed=3):
    return build_model(ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                                   max_seq_len=24), seed=seed)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_generate_on_fp32_weights_trained_with_flash_falls_back_to_sdpa(flash_on_cpu, use_cache):
    model, reference = _tiny_lm(), _tiny_lm()
    model.set_attention_backend("flash")  # what training under bf16 autocast chose
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=30, max_seq_len=24, sampling=Sampling(temperature=0.0),  # slides past the window
              use_cache=use_cache)
    out = generate(model, prompt, **kw)  # the old code: RuntimeError from the fp32-refusing kernel
    assert torch.equal(out, generate(reference, prompt, **kw))
    assert flash_on_cpu.calls == 0
    assert model.attention_backend == "flash" and all(b.attn.backend == "flash" for b in model.layers)


def test_generate_keeps_flash_when_it_computes_in_bf16(flash_on_cpu):
    model = _tiny_lm()
    model.set_attention_backend("flash")
    prompt = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, prompt, max_new_tokens=3, max_seq_len=24, sampling=Sampling(temperature=0.0))
    assert out.shape == (1, 7) and flash_on_cpu.calls > 0  # the prompt went through the "flash" kernel


@pytest.mark.slow  # compiles with inductor: 10 s on 2 cores
def test_the_fused_loss_runs_after_one_compiled_forward_instead_of_breaking_the_graph(monkeypatch):
    """A stand-in for Liger's kernel that reads the host as it does (``.item()``): compiled into
    the whole loss function it breaks the graph; after the compiled forward it does not."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from flopwise.model import loss as losses
    from flopwise.model.loss import make_loss_fn

    def liger_like(hidden, weight, targets, ignore_index=-100, reduction="sum", **_):
        rows = int((targets != ignore_index).sum().item())  # a host read, as the real kernel makes
        assert rows > 0
        return F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setattr(losses, "_liger_flce", lambda: liger_like)
    monkeypatch.setattr(losses, "fused_linear_cross_entropy_available", lambda device: True)
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=64, max_seq_len=16)
    model = build_model(cfg, seed=0)
    x = torch.randint(0, 64, (2, 16))
    want, _ = make_loss_fn(model, "plain")(x, x)
    torch._dynamo.reset()
    counters.clear()
    got, _ = make_loss_fn(model, "fused", compile_mode="default")(x, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def _varlen_eager(q, k, v, cu):
    """flash_attn_varlen_func's contract on CPU: (total, H|KV, hd) packed documents, causal in each."""
    bounds, n_rep = cu.tolist(), q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    parts = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                            is_causal=True).transpose(0, 1) for s, e in zip(bounds, bounds[1:]) if e > s]
    return torch.cat(parts)


# Opaque to the compiler, as flash-attn's own registered ops are: a forward and a backward op.
@torch.library.custom_op("flopwise_test::varlen_attention", mutates_args=())
def _varlen_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    return _varlen_eager(q, k, v, cu)


@torch.library.custom_op("flopwise_test::varlen_attention_backward", mutates_args=())
def _varlen_stand_in_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention backward written out (a custom op's body runs below autograd)."""
    bounds, n_rep = cu.tolist(), q.shape[1] // k.shape[1]
    gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, e in zip(bounds, bounds[1:]):
        if e == s:
            continue
        qs = q[s:e].transpose(0, 1)  # (H, L, hd)
        ks, vs = (t[s:e].transpose(0, 1).repeat_interleave(n_rep, 0) for t in (k, v))  # (H, L, hd)
        scale = q.shape[-1] ** -0.5
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        probs = (qs @ ks.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)  # (H, L, L)
        go = grad[s:e].transpose(0, 1)  # (H, L, hd)
        dp = go @ vs.transpose(1, 2)
        ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
        gq[s:e] = (ds @ ks * scale).transpose(0, 1)
        fold = lambda t: t.unflatten(0, (k.shape[1], n_rep)).sum(1).transpose(0, 1)  # noqa: E731 - (L, KV, hd)
        gk[s:e] = fold(ds.transpose(1, 2) @ qs * scale)
        gv[s:e] = fold(probs.transpose(1, 2) @ go)
    return gq, gk, gv


@_varlen_stand_in.register_fake
def _(q, k, v, cu):
    return torch.empty_like(q)


@_varlen_stand_in_backward.register_fake
def _(grad, q, k, v, cu):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return (*_varlen_stand_in_backward(grad, *ctx.saved_tensors), None)


_varlen_stand_in.register_autograd(_backward, setup_context=_save)


@pytest.mark.parametrize("how", ["model", "blocks"])
def test_doc_mask_with_flash_compiles_to_one_graph_whatever_the_number_of_documents(monkeypatch, how):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from flopwise.config import TrainConfig
    from flopwise.model.loss import make_loss_fn
    from flopwise.train.wrap import wrap_model

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True):
        assert causal and cu_q is cu_k and max_q == max_k
        return _varlen_stand_in(q, k, v, cu_q)

    kernels = A._FlashKernels("FA2", "stand-in", None, varlen)
    monkeypatch.setattr(A, "_flash_kernels", lambda device: kernels)
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32,
                      doc_mask=True)
    flash, sdpa = build_model(cfg, seed=0), build_model(cfg, seed=0)
    flash.set_attention_backend("flash")
    gen = torch.Generator().manual_seed(0)
    batches = []
    for n_docs in (2, 5, 9):  # a different number of documents (and longest document) in every batch
        x = torch.randint(0, 96, (2, 32), generator=gen)
        cuts = torch.randperm(31, generator=gen)[: n_docs - 1] + 1
        doc_ids = torch.zeros(2, 32, dtype=torch.long)
        for c in cuts.tolist():
            doc_ids[:, c:] += 1
        batches.append((x, x, doc_ids))
    torch._dynamo.reset()
    counters.clear()
    wrap_model(flash, TrainConfig(compile=how))
    compiled = make_loss_fn(flash, "plain", compile_mode="default" if how == "model" else None)
    graphs = []
    for x, y, d in batches:
        got, _ = compiled(x, y, d)
        got.backward()
        want, _ = make_loss_fn(sdpa, "plain")(x, y, d)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert_weights_close({n: p.grad for n, p in flash.named_parameters()},
                         {n: p.grad for n, p in sdpa.named_parameters()}, rel=1e-4, what="flash varlen vs sdpa")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 3, f"graphs compiled after each batch: {graphs}"  # none later
