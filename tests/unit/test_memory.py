"""The memory model (flopwise.plan.memory) against real bytes on CPU.

* States (params, grads, AdamW): exact, tensor by tensor.
* Activations + logits: the bytes autograd saves during forward + loss, measured with
  ``saved_tensors_hooks`` (storages deduplicated, parameters and buffers excluded), plus
  the logits tensor the caller holds. Tolerance ACT_TOL = 2% (the model is exact on torch
  2.13 CPU today; the margin is for kernel changes across torch versions).
* Peak of a whole step (forward, loss, backward, AdamW) measured by torch's
  ``MemTracker`` (a dispatch-mode tracker of every storage): PEAK_TOL = 2% without
  checkpointing, CKPT_PEAK_TOL = 12% with (the model adds the recomputed block and the
  worst backward moment conservatively; tiny models with a small vocabulary are the
  worst case).

CPU vs CUDA: on CPU the default SDPA kernel is flash-attention-for-CPU, which saves
q, k, v, out and a float32 logsumexp like CUDA's flash kernel; SDPBackend.MATH is the
"eager" case (bf16 upcast to fp32, (B, H, T, T) float32 probabilities saved) on both.
CPU autocast casts the same ops (linear, SDPA) to bf16 as CUDA autocast for this model.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from flopwise.config import ModelConfig, OptimConfig
from flopwise.model import build_model
from flopwise.model.loss import loss_sum
from flopwise.plan.flops import param_counts
from flopwise.plan.memory import (
    GIB,
    MemorySettings,
    estimate,
    max_micro_batch,
    n_param_tensors,
    outer_state_bytes,
    outer_sync_bytes,
    state_bytes,
)
from flopwise.train.optim import build_optimizer
from flopwise.train.wrap import apply_activation_checkpointing

ACT_TOL = 0.02
PEAK_TOL = 0.02
CKPT_PEAK_TOL = 0.12

CPU = torch.device("cpu")


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=256)
    return ModelConfig(**{**base, **kw})


CONFIGS = {
    "gqa-tied": tiny(),
    "mha-untied": tiny(n_kv_heads=4, tie_embeddings=False),
    "mqa-qknorm": tiny(n_kv_heads=1, qk_norm=True, arch="qwen3"),
    "qknorm-headdim": tiny(qk_norm=True, arch="qwen3", head_dim=32, tie_embeddings=False),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _one_step(model, cfg, B=2, T=16):
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    y = torch.randint(0, cfg.vocab_size, (B, T))
    loss_sum(model(idx), y).backward()


# --------------------------------------------------------------------------- states: exact

@pytest.mark.parametrize("name", ["gqa-tied", "mha-untied", "qknorm-headdim"])
def test_fp32_states_are_exact(name):
    cfg = CONFIGS[name]
    model = build_model(cfg)
    opt = build_optimizer(model, OptimConfig(), CPU)
    _one_step(model, cfg)
    opt.step()
    params = [p for p in model.parameters()]
    real_params = sum(_nbytes(p) for p in params)
    real_grads = sum(_nbytes(p.grad) for p in params)
    moments = sum(_nbytes(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    steps = sum(_nbytes(s["step"]) for s in opt.state.values())  # 0-d float32 per tensor
    assert all(s["step"].dim() == 0 for s in opt.state.values())

    n = param_counts(cfg)["total"]
    settings = MemorySettings(precision="float32")
    st = state_bytes(n, settings)  # a raw parameter count: no step counters
    assert st["params"] == real_params
    assert st["grads"] == real_grads
    assert st["optimizer"] == moments
    assert st["master"] == 0
    # with the tensor count (what estimate() does) the `step` counters are included exactly
    assert len(params) == n_param_tensors(cfg)
    assert steps == 4 * n_param_tensors(cfg)
    est = estimate(cfg, 2, 16, settings)
    assert (est.params, est.grads, est.optimizer) == (real_params, real_grads, moments + steps)


def test_bf16_parameters_adamw_state_follows_param_dtype():
    """torch's AdamW allocates exp_avg/exp_avg_sq with zeros_like(param): bf16 for bf16
    parameters. precision="bf16-pure" without master weights models exactly that."""
    cfg = CONFIGS["gqa-tied"]
    model = build_model(cfg).to(torch.bfloat16)
    opt = build_optimizer(model, OptimConfig(), CPU)
    _one_step(model, cfg)
    opt.step()
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    real = {
        "params": sum(_nbytes(p) for p in model.parameters()),
        "grads": sum(_nbytes(p.grad) for p in model.parameters()),
        "optimizer": sum(_nbytes(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq", "step")),
    }
    est = estimate(cfg, 2, 16, MemorySettings(precision="bf16-pure", master_weights=False))
    assert {k: getattr(est, k) for k in real} == real
    assert est.master == 0
    # a mixed-precision optimizer (fp32 master + fp32 moments) is 16 bytes/param, not 8
    n = param_counts(cfg)["total"]
    assert sum(state_bytes(n, MemorySettings(precision="bf16-pure")).values()) == 16 * n
    assert sum(state_bytes(n, MemorySettings(precision="bf16-pure", master_weights=False)).values()) == 8 * n
    assert state_bytes(n, MemorySettings(precision="bf16-pure", master_weights=False, optimizer_dtype="fp32"))[
        "optimizer"] == 8 * n


def test_sharding_divides_the_right_terms():
    n = 1_000_003  # not divisible: sharded terms round up
    one = state_bytes(n, MemorySettings(precision="bf16-pure"))
    assert one == {"params": 2 * n, "grads": 2 * n, "optimizer": 8 * n, "master": 4 * n}
    assert state_bytes(n, MemorySettings(precision="bf16-pure", strategy="ddp", n_gpus=8)) == one
    z = state_bytes(n, MemorySettings(precision="bf16-pure", strategy="zero1", n_gpus=8))
    assert z == {"params": 2 * n, "grads": 2 * n, "optimizer": -(-8 * n // 8), "master": -(-4 * n // 8)}
    f = state_bytes(n, MemorySettings(precision="bf16-pure", strategy="fsdp2", n_gpus=8))
    assert f == {k: -(-v // 8) for k, v in one.items()}
    # with accumulation FSDP2 keeps the earlier micro-batches' gradients unsharded, in fp32,
    # until the step's last backward reduce-scatters them (traced: tests/integration/test_dryrun.py)
    acc = state_bytes(n, MemorySettings(precision="bf16-pure", strategy="fsdp2", n_gpus=8, grad_accum=2))
    assert acc == {**f, "grads": 4 * n}
    assert state_bytes(n, MemorySettings(strategy="fsdp2", n_gpus=1, grad_accum=4))["grads"] == 4 * n  # one rank
    # DDP without gradient_as_bucket_view keeps a second copy of the gradients in its buckets
    nb = state_bytes(n, MemorySettings(strategy="ddp", n_gpus=2, ddp_bucket_view=False))
    assert nb["grads"] == 2 * 4 * n

    cfg = tiny(n_layers=4)
    single = estimate(cfg, 4, 64, MemorySettings())
    fsdp = estimate(cfg, 4, 64, MemorySettings(strategy="fsdp2", n_gpus=4))
    assert fsdp.params == -(-single.params // 4) and fsdp.fsdp_buffers > 0
    assert fsdp.weight_copies == 0  # gathered weights are already bf16 (MixedPrecisionPolicy)
    assert estimate(cfg, 4, 64, MemorySettings(strategy="ddp", n_gpus=4)).total == single.total


def test_diloco_adds_the_outer_state_to_the_inner_strategys():
    """DiLoCo per rank: the inner strategy's over the group, plus the anchor (fp32, 4 B/param)
    and the outer Nesterov momentum (fp32, 4 B) for the whole run, and at a sync the fp32
    pseudo-gradient and its all-reduce buffer (outer_dtype: 4 or 2 B; bf16 also its fp32 mean)
    beyond the step's freed activations; all sharded over the group under fsdp2 inside."""
    n = 1_000_003  # not divisible by 8: sharded terms round up
    ddp = state_bytes(n, MemorySettings(strategy="ddp", n_gpus=16))
    dil = state_bytes(n, MemorySettings(strategy="diloco", n_gpus=16, group_size=8))
    assert dil == {**ddp, "outer": (4 + 4) * n}
    bf16 = MemorySettings(strategy="diloco", n_gpus=16, group_size=8, outer_dtype="bf16")
    assert outer_sync_bytes(n, bf16) == (4 + 2 + 4) * n
    assert outer_sync_bytes(n, MemorySettings(strategy="diloco", n_gpus=16, group_size=8)) == (4 + 4) * n
    # fsdp2 inside: the inner states are fsdp2's over the group's 8 ranks (not the 16 of the world)
    # and so is the outer state
    fsdp8 = state_bytes(n, MemorySettings(strategy="fsdp2", n_gpus=8))
    dil_f = state_bytes(n, MemorySettings(strategy="diloco", n_gpus=16, group_size=8, inner_strategy="fsdp2"))
    assert dil_f == {**fsdp8, "outer": -(-8 * n // 8)}
    assert outer_sync_bytes(n, replace(bf16, inner_strategy="fsdp2")) == -(-10 * n // 8)
    assert outer_state_bytes(n, MemorySettings(strategy="fsdp2", n_gpus=8)) == 0  # only diloco has one
    # group_size 0: the whole world is one group
    assert MemorySettings(strategy="diloco", n_gpus=4).group_ranks == 4
    assert MemorySettings(strategy="diloco", n_gpus=4, group_size=8).group_ranks == 4

    # the whole estimate: exactly the inner strategy's plus the outer state, plus what a sync
    # needs beyond the activations, logits and temporaries the step freed
    cfg = tiny(n_layers=4)
    p = param_counts(cfg)["total"]
    for inner, k, micro in (("ddp", 4, 4), ("fsdp2", 4, 4), ("ddp", 4, 0)):
        alone = estimate(cfg, micro, 64, MemorySettings(strategy=inner, n_gpus=k, grad_accum=2))
        both = estimate(cfg, micro, 64, MemorySettings(strategy="diloco", n_gpus=8, group_size=k,
                                                       inner_strategy=inner, grad_accum=2))
        shard = (lambda x: x) if inner == "ddp" else (lambda x: -(-x // k))
        freed = alone.activations + alone.logits + alone.transient
        outer = shard(8 * p) + max(0, shard(8 * p) - freed)
        assert both.outer == outer and both.total == alone.total + outer, (inner, micro, both.outer, outer)
        assert (both.params, both.grads, both.optimizer, both.fsdp_buffers) == (
            alone.params, alone.grads, alone.optimizer, alone.fsdp_buffers)
        assert both.gb()["outer"] == pytest.approx(outer / GIB) and "outer" not in alone.gb()
    with pytest.raises(ValueError, match="inner_strategy"):
        state_bytes(10, MemorySettings(strategy="diloco", n_gpus=2, inner_strategy="zero1"))
    with pytest.raises(ValueError, match="outer_dtype"):
        state_bytes(10, MemorySettings(strategy="diloco", n_gpus=2, outer_dtype="fp8"))


def test_well_known_figure_16_bytes_per_param():
    """1.2B parameters, bf16 autocast + fp32 AdamW: 4 (param) + 4 (grad) + 8 (m, v) = 16 bytes
    per parameter = 19.2e9 bytes = 17.9 GiB of states, before any activation."""
    st = state_bytes(1_200_000_000, MemorySettings(precision="bf16"))
    assert sum(st.values()) == 16 * 1_200_000_000
    assert sum(st.values()) / GIB == pytest.approx(17.88, abs=0.01)
    # ZeRO-1 on 8 GPUs: 4 + 4 + 8/8 = 9 bytes/param
    z = state_bytes(1_200_000_000, MemorySettings(strategy="zero1", n_gpus=8))
    assert sum(z.values()) == 9 * 1_200_000_000


# --------------------------------------------------------------------------- activations: measured

def _saved_bytes(model, cfg, B, T, amp=False, math=False, dtype=torch.bfloat16) -> int:
    """Bytes of every storage autograd saves in forward + loss, plus the logits the caller
    holds (train/train_step.py keeps them until backward ends); parameters and buffers excluded."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    kernel = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
    autocast = torch.autocast("cpu", dtype=dtype) if amp else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernel:
        with autocast:
            logits = model(idx)
        loss_sum(logits, y)
    seen[logits.untyped_storage().data_ptr()] = logits.untyped_storage().nbytes()
    return sum(seen.values())


def _checkpoint_blocks(model, blocks=None) -> None:
    """torch.utils.checkpoint (non-reentrant, as train/wrap.py) around each block, or the
    given ones (flopwise.plan.flops.checkpointed_blocks: what train.activation_checkpointing picks)."""
    for i, block in enumerate(model.layers):
        if blocks is None or i in blocks:
            block.forward = (lambda f: lambda x, *rest: checkpoint(f, x, *rest, use_reentrant=False))(block.forward)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["fp32-sdpa", "fp32-eager", "amp-sdpa", "amp-eager"])
def test_saved_activations_match_the_model(name, mode):
    cfg = CONFIGS[name]
    model = build_model(cfg)
    amp, math = mode.startswith("amp"), mode.endswith("eager")
    settings = MemorySettings(precision="bf16" if amp else "float32", attention="eager" if math else "sdpa")
    for B, T in ((2, 32), (3, 96)):
        real = _saved_bytes(model, cfg, B, T, amp=amp, math=math)
        est = estimate(cfg, B, T, settings)
        # under autocast the saved tensors include the bf16 weight copies linear keeps
        predicted = est.activations + est.logits + est.weight_copies
        assert predicted == pytest.approx(real, rel=ACT_TOL), (name, mode, B, T, est.per_layer_terms)


@pytest.mark.parametrize("math", [False, True])
def test_fp16_autocast_is_modelled_as_fp16_not_float32(math):
    """train.precision=fp16 is float16 autocast over fp32 weights: 2-byte activations and
    weight copies like bf16 autocast, fp32 parameters, gradients and AdamW state."""
    cfg = CONFIGS["mqa-qknorm"]
    model = build_model(cfg)
    est = estimate(cfg, 2, 64, MemorySettings(precision="fp16", attention="eager" if math else "sdpa"))
    real = _saved_bytes(model, cfg, 2, 64, amp=True, math=math, dtype=torch.float16)
    assert est.activations + est.logits + est.weight_copies == pytest.approx(real, rel=ACT_TOL)
    bf16 = estimate(cfg, 2, 64, MemorySettings(precision="bf16", attention="eager" if math else "sdpa"))
    fp32 = estimate(cfg, 2, 64, MemorySettings(precision="float32", attention="eager" if math else "sdpa"))
    assert est.total == bf16.total < fp32.total
    assert (est.params, est.grads, est.optimizer) == (fp32.params, fp32.grads, fp32.optimizer)


@pytest.mark.parametrize("math", [False, True])
def test_pure_bf16_saved_activations(math):
    cfg = CONFIGS["qknorm-headdim"]
    model = build_model(cfg).to(torch.bfloat16)
    model.reset_rope()  # the trainer keeps RoPE tables in float32
    real = _saved_bytes(model, cfg, 2, 64, math=math)
    est = estimate(cfg, 2, 64, MemorySettings(precision="bf16-pure", attention="eager" if math else "sdpa"))
    assert est.weight_copies == 0
    assert est.activations + est.logits == pytest.approx(real, rel=ACT_TOL)


@pytest.mark.parametrize("amp", [False, True])
def test_checkpointed_saved_activations(amp):
    """With each block checkpointed, forward saves the block inputs (and embedding, final
    norm, loss); the model's `activations` adds one recomputed block (the backward peak)."""
    cfg = tiny(n_layers=3)
    model = build_model(cfg)
    _checkpoint_blocks(model)
    settings = MemorySettings(precision="bf16" if amp else "float32", activation_checkpointing="full")
    for B, T in ((2, 32), (2, 128)):
        real = _saved_bytes(model, cfg, B, T, amp=amp)
        est = estimate(cfg, B, T, settings)
        head_copy = 2 * cfg.vocab_size * cfg.d_model if amp else 0  # the head linear is not checkpointed
        assert est.activations - est.per_layer + est.logits + head_copy == pytest.approx(real, rel=ACT_TOL)
        full = estimate(cfg, B, T, MemorySettings(precision=settings.precision))
        assert est.activations < full.activations


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("every", [2, 3])
def test_selective_checkpointing_saved_activations(amp, every):
    """Selective: blocks 0, k, 2k, ... keep only their input, the others everything (and,
    under autocast, their weight copies); the model adds one recomputed block."""
    from flopwise.plan.flops import checkpointed_blocks

    cfg = tiny(n_layers=4)
    blocks = checkpointed_blocks(cfg.n_layers, "selective", every)
    model = build_model(cfg)
    _checkpoint_blocks(model, blocks)
    settings = MemorySettings(precision="bf16" if amp else "float32", activation_checkpointing="selective",
                              activation_checkpointing_every=every)
    counts = param_counts(cfg)
    block_copies = 2 * (counts["attention"] + counts["mlp"]) // cfg.n_layers if amp else 0
    for B, T in ((2, 32), (2, 128)):
        real = _saved_bytes(model, cfg, B, T, amp=amp)
        est = estimate(cfg, B, T, settings)
        # saved in forward: all but the recomputed block's activations and weight copies
        predicted = est.activations - est.per_layer + est.logits + est.weight_copies - block_copies
        assert predicted == pytest.approx(real, rel=ACT_TOL)
        none = estimate(cfg, B, T, MemorySettings(precision=settings.precision))
        full = estimate(cfg, B, T, MemorySettings(precision=settings.precision, activation_checkpointing="full"))
        assert full.activations < est.activations < none.activations


def test_per_layer_terms_by_hand():
    """One block, fp32, sdpa, D=64, H=4, KV=2, hd=16, F=160, B*T=64 tokens."""
    cfg = tiny()
    t = estimate(cfg, 2, 32, MemorySettings(precision="float32")).per_layer_terms
    N = 64
    assert t["attn_norm"] == t["mlp_norm"] == N * (4 * 64 + 4 + 4 * 64 + 4 * 64)  # x, rstd, y, linear input
    assert t["qkv"] == N * 4 * (64 + 2 * 32)
    assert t["q_k_rotated"] == N * 4 * (64 + 32)
    assert t["attn_out"] == N * 4 * 64
    assert t["logsumexp"] == N * 4 * 4
    assert t["swiglu"] == N * 4 * 4 * 160
    eager = estimate(cfg, 2, 32, MemorySettings(precision="float32", attention="eager")).per_layer_terms
    assert eager["probs"] == 2 * 4 * 32 * 32 * 4  # (B, H, T, T) float32


# --------------------------------------------------------------------------- peak of a whole step

def _peak_bytes(cfg, B, T, amp=False, math=False, ckpt="none") -> int:
    from flopwise.plan.flops import checkpointed_blocks

    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model = build_model(cfg)
    if ckpt == "selective_op":  # the per-op policy is train/wrap.py's
        apply_activation_checkpointing(model, ckpt)
    elif ckpt != "none":
        _checkpoint_blocks(model, checkpointed_blocks(cfg.n_layers, ckpt, 2))
    opt = build_optimizer(model, OptimConfig(), CPU)
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    y = torch.randint(0, cfg.vocab_size, (B, T))

    def step():
        with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
                logits = model(idx)
            s = loss_sum(logits, y)
            (s / (B * T)).backward()
            del logits, s
        opt.step()
        opt.zero_grad(set_to_none=False)  # grads stay resident, as with gradient accumulation

    step()  # AdamW state exists from here on
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")[CPU]
    return next(v for k, v in snap.items() if str(k).endswith("TOTAL") or str(k).endswith("Total"))


@pytest.mark.parametrize("mode", ["fp32-sdpa", "amp-sdpa", "amp-eager"])
@pytest.mark.parametrize("ckpt", ["none", "full", "selective", "selective_op"])
def test_total_matches_the_measured_peak(mode, ckpt):
    cfg = tiny(vocab_size=1024, qk_norm=True, arch="qwen3")
    amp, math = mode.startswith("amp"), mode.endswith("eager")
    B, T = 2, 128
    real = _peak_bytes(cfg, B, T, amp=amp, math=math, ckpt=ckpt)
    est = estimate(cfg, B, T, MemorySettings(precision="bf16" if amp else "float32",
                                             attention="eager" if math else "sdpa",
                                             activation_checkpointing=ckpt))
    tol = CKPT_PEAK_TOL if ckpt != "none" else PEAK_TOL
    assert est.total == pytest.approx(real, rel=tol)
    if ckpt != "none":
        assert est.total >= real * (1 - 0.05)  # an upper bound, or nearly


# --------------------------------------------------------------------------- max_micro_batch

def test_max_micro_batch_respects_headroom_and_is_monotone():
    cfg = tiny()
    s = MemorySettings(precision="float32")
    one = estimate(cfg, 1, 128, s).total
    assert max_micro_batch(cfg, 128, int(one / 0.9) - 1000, s) == 0  # nothing fits
    mem = 64 * 2**20
    b = max_micro_batch(cfg, 128, mem, s)
    assert b > 0
    assert estimate(cfg, b, 128, s).total <= 0.9 * mem < estimate(cfg, b + 1, 128, s).total
    assert max_micro_batch(cfg, 128, mem, s, headroom=0.5) <= b
    results = [max_micro_batch(cfg, 128, m * 2**20, s) for m in (8, 16, 32, 64, 128)]
    assert results == sorted(results)
    assert max_micro_batch(cfg, 128, 2**40, s, limit=64) == 64  # capped by limit
    # checkpointing lets a larger micro-batch fit
    assert max_micro_batch(cfg, 128, mem, MemorySettings(precision="float32", activation_checkpointing="full")) > b


def test_max_micro_batch_hand_computed():
    """Totals are affine in the micro-batch: fixed + B * per_sequence, so the answer is
    floor((headroom * memory - fixed) / per_sequence)."""
    cfg = tiny()
    s = MemorySettings(precision="float32")
    e1, e2 = estimate(cfg, 1, 64, s).total, estimate(cfg, 2, 64, s).total
    per_seq = e2 - e1
    fixed = e1 - per_seq
    assert estimate(cfg, 7, 64, s).total == fixed + 7 * per_seq
    memory = 100 * 2**20
    assert max_micro_batch(cfg, 64, memory, s) == int((0.9 * memory - fixed) // per_seq)


def test_smollm_360m_at_2048_on_80_gib():
    """The canonical case: SmolLM-360M, seq 2048, bf16 autocast, on an 80 GiB GPU."""
    from flopwise.config import build_config

    cfg = build_config(preset="smollm-360m").model
    est = estimate(cfg, 8, 2048, MemorySettings())
    assert est.params == 4 * 361_821_120 and est.states == pytest.approx(16 * 361_821_120, abs=1024)
    # logits: bf16 (2) + fp32 log-softmax (4) bytes x B*T*V, and 8 x B*T*V loss temporaries
    assert est.logits >= 6 * 8 * 2048 * 49152 and est.transient == 8 * 8 * 2048 * 49152
    b = max_micro_batch(cfg, 2048, 80 * GIB, MemorySettings())
    assert 4 <= b < 64
    assert est.gb()["total"] == pytest.approx(est.total / GIB)


# --------------------------------------------------------------------------- API hygiene

def test_settings_are_validated():
    with pytest.raises(ValueError, match="precision"):
        estimate(tiny(), 1, 16, MemorySettings(precision="fp8"))
    with pytest.raises(ValueError, match="strategy"):
        state_bytes(10, MemorySettings(strategy="zero3"))


def test_module_does_not_import_torch():
    code = "import sys, flopwise.plan.memory; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_moe_is_modelled_analytically():
    dense = tiny()
    moe = tiny(n_experts=8, moe_top_k=2, moe_ffn_hidden=80)
    t = estimate(moe, 2, 64, MemorySettings()).per_layer_terms
    assert "experts" in t and "router" in t and "swiglu" not in t
    assert t["experts"] == 2 * 64 * 2 * (2 * 64 + 2 * 4 * 80)  # top-2: gathered input + SwiGLU, bf16
    assert estimate(moe, 2, 64, MemorySettings()).params > estimate(dense, 2, 64, MemorySettings()).params
