"""The dry run's predicted step time against public GPU training measurements (issue 42).

Every calibration case of ``shared/reference/gpu-measurements.md`` (llm-foundry MF-a..l,
flash-attention FA-1..5, llm.c LC-1..4, TinyLlama TL-1, torchtitan TT-6) as a flopwise
configuration: the model's shape by overrides on a preset, sequence length, micro-batch,
global batch (micro-batch x accumulation x GPUs), precision, activation checkpointing,
strategy, compile, the GPU, GPUs per node, nodes and the link between nodes. Each is traced
(``flopwise preflight --dry-run``: fake tensors, nothing runs on a GPU) and the step-time
model's **predicted** tokens/s per GPU is set against the source's **measured** one.

The prediction is of flopwise's own step for that configuration; where the source's stack
does something flopwise does not (its own CUDA kernels, fused LayerNorm/MLP/cross-entropy,
Apex AdamW), the case's ``differs`` lines say what and how the prediction treats it. One
difference is priced rather than ignored: where the source ran an attention kernel whose speed
was measured on its GPU (FlashAttention v1 in the FlashAttention repository's figures), the
traced SDPA flash kernels are predicted at that kernel's speed (``attention_as``); each row also
carries the ratio with flopwise's own kernel (``ratio_flopwise_attention``).

    python benchmarks/predict_vs_public.py [--case MF-a LC-1 ...] [--list] [--json-out PATH]

Writes benchmarks/results/predict-vs-public-traced-<date>.json (or PATH) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _results import save_result  # benchmarks/ is on sys.path when a script runs

from flopwise.config import ConfigError, RunConfig, build_config
from flopwise.plan import hardware
from flopwise.tune.dryrun import DryRunFailed, dry_run
from flopwise.tune.predict import predicted

WITHIN = 0.25  # the bound for every case: |predicted / measured - 1| <= 25%
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
FLASH = "Dao-AILab/flash-attention training/README.md"
LLMC = "karpathy/llm.c scripts/run_gpt2_*.sh"
TINYLLAMA = "jzhang38/TinyLlama README.md, pretrain/tinyllama.py"
TITAN = "pytorch/torchtitan docs/performance.md"


@dataclass(frozen=True)
class Case:
    """One public measurement and the flopwise configuration that matches it."""

    id: str
    source: str
    preset: str  # the preset the overrides go on top of
    overrides: tuple[str, ...]
    gpu: str  # a name flopwise.plan.hardware.find knows: the variant the source ran, where it says
    gpus: int  # all GPUs of the run
    measured: float | None  # tokens/s per GPU, as the source gives it or derived from its figures (None: not given)
    measured_how: str  # the source's own figure and, when derived, the arithmetic
    compile_why: str  # why train.compile is what it is for this source
    differs: tuple[str, ...] = ()  # what flopwise cannot express of the source's stack, and how it is treated
    params: int | None = None  # the source's NumParams, where it gives one
    network: str | None = None  # the inter-node link (a flopwise.plan.hardware.LINKS name); None on one node
    network_why: str = ""
    per_node: int = 8
    # the attention kernel the source ran, as steptime.ATTENTION_TFLOPS names it, where it is not
    # the SDPA flash kernel flopwise's trace chose (None: the same kernel, or none measured)
    attention_as: str | None = None
    gpu_why: str = ""  # where the GPU variant (memory, form factor, power limit) comes from
    # an fp8 case's bf16 twin (the same source, model and settings in bf16): the pair's speed-up is
    # predicted and measured; None for a bf16 case
    twin: str | None = None
    # why the case's absolute tokens/s are not held to the bound (its speed-up still is); "" when they are
    ratio_only: str = ""
    unsupported: str = ""  # why flopwise cannot express the case at all (reported, not traced)
    # "te": the source ran TransformerEngine's fp8 linears, whose amax / scale / cast(-transpose) are
    # fused kernels: the trace's eager cast chains are priced as fused regions (:func:`as_fused_casts`)
    casts_as: str | None = None
    speedup: float | None = None  # the measured speed-up over the twin, where the source gives only that

    @property
    def nnodes(self) -> int:
        return max(1, self.gpus // self.per_node)

    @property
    def nproc_per_node(self) -> int:
        return min(self.gpus, self.per_node)

    def config(self) -> RunConfig:
        """The flopwise configuration (validated: a ConfigError names every problem)."""
        return build_config(preset=self.preset, overrides=list(self.overrides))


def _shape(layers: int, d: int, heads: int, kv: int, ffn: int, vocab: int, max_seq: int) -> list[str]:
    return [f"model.n_layers={layers}", f"model.d_model={d}", f"model.n_heads={heads}", f"model.n_kv_heads={kv}",
            f"model.ffn_hidden={ffn}", f"model.vocab_size={vocab}", f"model.max_seq_len={max_seq}"]


# The loss over the full logits, as llm-foundry (torch's CrossEntropyLoss) and torchtitan compute
# it: flopwise's plain loss. Left to train.loss=auto, an eager step takes the chunked loss, which
# runs the head in chunks with the gradients formed in the forward -- another step than the source's.
FULL_LOGITS = "train.loss=plain"
FULL_LOGITS_WHY = "loss: {0} computes the full logits (cross-entropy over (B, T, V)): train.loss=plain, as it runs"


def _step(seq: int, micro: int, accum: int, gpus: int, precision: str, compile_: str, ac: str,
          strategy: str) -> list[str]:
    """The step's overrides; the global batch is micro-batch x accumulation x GPUs, as the sources count it."""
    return [f"train.seq_len={seq}", f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * accum * gpus}",
            f"train.precision={precision}", f"train.compile={compile_}", f"train.activation_checkpointing={ac}",
            f"parallel.strategy={strategy}"]


# --------------------------------------------------------------------------- llm-foundry (MPT)
# MPT = GPT-2's components (LayerNorm with bias, GELU MLP 4x, learned positions, biases on every
# projection, tied), so the gpt2 preset carries it; vocab 50368 and positions for 2048 tokens (the
# source's NumParams counts the position table: 125m's 125,311,488 is exactly that).
MPT_SHAPES = {"125m": (12, 768, 12, 125_311_488), "350m": (24, 1024, 16, 355_985_408),
              "760m": (24, 1536, 12, 760_470_528), "1b": (24, 2048, 16, 1_315_950_592),
              "3b": (32, 2560, 20, 2_651_837_440)}
MPT_COMPILE = "off: llm-foundry runs the model eager (Composer, no torch.compile in the benchmark configs)"
MPT_DIFFERS = (
    "attention: llm-foundry's triton flash attention (attn_impl: triton), a copy of the FlashAttention repository's "
    "Triton port of FlashAttention v1 (on triton_pre_mlir; its docstring: forward + backward 'slightly slower' than "
    "the CUDA v1, tested on A100 only); predicted at FlashAttention v1's measured speed (attention_as=flash1)",
    "LayerNorm in low precision (bf16) and exact GELU; flopwise's fp32-statistics LayerNorm and tanh GELU, eager, "
    "are predicted as flopwise runs them",
    "optimizer: Composer decoupled_adamw (per-tensor loop); flopwise's fused AdamW is predicted",
)


def mpt(cid: str, size: str, gpu: str, micro: int, accum: int, measured: int, pure: bool = False,
        seq: int = 2048) -> Case:
    layers, d, heads, params = MPT_SHAPES[size]
    precision = "bf16"  # flopwise refuses bf16-pure under fsdp2 (its MixedPrecision already computes in bf16)
    overrides = ["model.arch=gpt2", *_shape(layers, d, heads, heads, 4 * d, 50368, seq),
                 *_step(seq, micro, accum, 8, precision, "off", "none", "fsdp2"), FULL_LOGITS]
    differs = MPT_DIFFERS + (FULL_LOGITS_WHY.format("llm-foundry"),) + ((
        "FSDP mixed precision PURE (bf16 parameters, gradients reduced in bf16); flopwise refuses bf16-pure under "
        "fsdp2, so its fsdp2 under bf16 autocast (gathered in bf16, reduced in fp32) is predicted",) if pure else (
        "FSDP mixed precision DEFAULT (gathered in bf16, reduced in fp32) is what flopwise's fsdp2 under bf16 "
        "autocast does",))
    return Case(cid, FOUNDRY, "gpt2-124m", tuple(overrides), FOUNDRY_GPUS[gpu], 8, measured,
                "the table's tokens/s/GPU column", MPT_COMPILE, differs,
                params=params + (seq - 2048) * d,  # the source's NumParams: its position table grows with seq
                network_why="one node: NVLink only (RoCE between nodes is not crossed)", attention_as="flash1",
                gpu_why=f"the table's GPU column ({FOUNDRY_COLUMN[gpu]}); SXM, as its nodes are NVLink-connected")


# the README's GPU column (a100_80gb, a100_40gb, h100_80gb) as the hardware table names the variant
FOUNDRY_GPUS = {"a100": "a100 sxm 80gb", "a100 40gb": "a100 sxm 40gb", "h100": "h100 sxm 80gb"}
FOUNDRY_COLUMN = {"a100": "a100_80gb", "a100 40gb": "a100_40gb", "h100": "h100_80gb"}


# --------------------------------------------------------------------------- flash-attention (GPT-3 shapes)
# GPT-2 style: learned positions, tied, vocab 50257 padded to a multiple of 8 (50264); MHA.
FLASH_COMPILE = ("model: the source's hand-fused kernels (FusedDense MLP with GELU, dropout-add-LayerNorm, "
                 "fused cross-entropy) are what flopwise gets by compiling; eager would predict unfused ops "
                 "the source does not run")
FLASH_DIFFERS = (
    "attention: the flash-attn package's FlashAttention v1: the README's table was committed on 2022-11-29 "
    "(4a6eaa9f), FlashAttention-2 released on 2023-07-17; predicted at v1's measured speed (attention_as=flash1)",
    "fused MLP / dropout-add-LayerNorm / cross-entropy kernels: predicted as inductor's fused regions of the "
    "compiled flopwise model (compile=model)",
    "optimizer: Apex fused AdamW; flopwise's fused torch AdamW is predicted (both one pass over the state)",
)


def flash(cid: str, layers: int, d: int, heads: int, micro: int, gbs: int, node_k: int) -> Case:
    accum = gbs // (micro * 8)
    strategy = "ddp" if d <= 1024 else "zero1"  # the source: DDP for 125M and 355M, ZeRO-1 from 760M
    overrides = ["model.arch=gpt2", *_shape(layers, d, heads, heads, 4 * d, 50264, 2048),
                 *_step(2048, micro, accum, 8, "bf16", "model", "none", strategy)]
    differs = FLASH_DIFFERS + ("precision: Lightning's bf16 (autocast over fp32 weights) = flopwise bf16",)
    return Case(cid, FLASH, "gpt2-124m", tuple(overrides), "a100 sxm 80gb", 8, node_k * 1000 / 8,
                f"{node_k}k tokens/s for the node of 8 (derived: / 8 GPUs)", FLASH_COMPILE, differs,
                network_why="one node: NVLink only", attention_as="flash1",
                gpu_why="the README: 8 x A100 80GB SXM4 (400 W)")


# --------------------------------------------------------------------------- llm.c (GPT-2)
LLMC_COMPILE = ("model: llm.c's own CUDA kernels fuse residual+LayerNorm, GELU into the matmul epilogue and the "
                "classifier with its loss; flopwise's nearest is the compiled model")
LLMC_DIFFERS = (
    "llm.c's own CUDA kernels (not PyTorch): its fused LayerNorm/GELU/classifier are predicted as inductor's "
    "fused regions of the compiled flopwise model; cuBLASLt GEMMs as flopwise's GEMMs",
    "attention: cuDNN flash attention, which the FlashAttention figures did not measure; flopwise's SDPA flash "
    "kernel is predicted",
    "bf16 weights with fp32 master weights and llm.c's fused AdamW kernel = flopwise bf16-pure with fused AdamW",
)


def llmc(cid: str, shape: tuple[int, int, int], gpu: str, micro: int, accum: int, tokens: int,
         step_s: float, step_how: str) -> Case:
    layers, d, heads = shape
    overrides = ["model.arch=gpt2", *_shape(layers, d, heads, heads, 4 * d, 50304, 1024),
                 *_step(1024, micro, accum, 8, "bf16-pure", "model", "none", "zero1")]
    return Case(cid, LLMC, "gpt2-124m", tuple(overrides), gpu, 8, tokens / step_s / 8,
                f"{tokens:,} tokens/step at {step_how} (derived: tokens / step_s / 8 GPUs)", LLMC_COMPILE,
                LLMC_DIFFERS, network_why="one node: NVLink only", attention_as="flash",
                gpu_why="the scripts' comments: 8 x A100 80GB SXM / 8 x H100 80GB SXM")


def cases() -> list[Case]:
    """Every calibration case, in the reference's order."""
    out = [
        mpt("MF-a", "125m", "a100", 32, 2, 141_737),
        mpt("MF-b", "350m", "a100", 32, 2, 58_782),
        mpt("MF-c", "760m", "a100", 24, 2, 32_434),
        mpt("MF-d", "1b", "a100", 14, 4, 20_513),
        mpt("MF-e", "3b", "a100", 10, 2, 10_811),
        mpt("MF-g", "760m", "h100", 24, 2, 63_147),
        mpt("MF-h", "1b", "h100", 14, 1, 45_455),
        mpt("MF-k", "125m", "a100 40gb", 26, 3, 136_334, pure=True),
        mpt("MF-l", "1b", "a100 40gb", 8, 8, 19_271, pure=True),
        flash("FA-1", 12, 768, 12, 32, 256, 1310),
        flash("FA-2", 24, 1024, 16, 16, 256, 503),
        flash("FA-3", 24, 1536, 16, 16, 256, 245),
        flash("FA-4", 24, 2048, 16, 8, 512, 169),
        flash("FA-5", 32, 2560, 20, 4, 512, 85),
        llmc("LC-1", (12, 768, 12), "a100 sxm 80gb", 64, 1, 524_288, 0.300, "~300 ms"),
        llmc("LC-2", (24, 1024, 16), "a100 sxm 80gb", 64, 1, 524_288, 0.820, "~820 ms"),
        llmc("LC-3", (36, 1280, 20), "a100 sxm 80gb", 32, 2, 524_288, 1.7, "~1.7 s"),
        llmc("LC-4", (48, 1600, 25), "h100 sxm 80gb", 16, 8, 1_048_576, 2.80, "2.80 s"),
    ]
    return [*out, tinyllama(), torchtitan_8b()]


def tinyllama() -> Case:
    # pretrain/tinyllama.py: micro-batch 8, global_batch_size 512 // num_of_devices 8 = 64 per GPU, so 8
    # accumulation steps; on 16 GPUs that is 1,024 sequences (the README's 2M-token batch).
    overrides = ["model.arch=llama", *_shape(22, 2048, 32, 4, 5632, 32000, 2048), "model.rope_theta=10000",
                 "model.tie_embeddings=false",
                 *_step(2048, 8, 8, 16, "bf16", "model", "none", "fsdp2")]
    return Case("TL-1", TINYLLAMA, "llama3.2-1b", tuple(overrides), "a100 sxm 40gb", 16, 24_000,
                "24k tokens/s per A100-40G (the README's sentence)",
                "model: the source's fused RMSNorm / SwiGLU / rotary / cross-entropy kernels are what flopwise "
                "gets by compiling; eager would predict unfused ops the source does not run",
                ("attention: the flash-attn package's FlashAttention-2; flopwise's SDPA flash kernel is predicted",
                 "fused RMSNorm, SwiGLU (xformers), rotary and cross-entropy kernels: predicted as inductor's fused "
                 "regions of the compiled flopwise model",
                 "Lightning FSDP FULL_SHARD wrapped per block, bf16-mixed = flopwise fsdp2 (gathered in bf16, "
                 "reduced in fp32) under bf16 autocast",
                 "optimizer: torch AdamW with foreach=False (a loop over tensors); flopwise's fused AdamW is "
                 "predicted"),
                network="ib-hdr", network_why="assumed: the source names no inter-node link; InfiniBand HDR "
                "200 Gb/s per GPU is the usual A100 cluster's",
                gpu_why="the README's 'A100-40G'; SXM assumed (it names no form factor)")


def torchtitan_8b() -> Case:
    overrides = ["model.arch=llama", *_shape(32, 4096, 32, 8, 14336, 128256, 8192), "model.rope_theta=500000",
                 "model.tie_embeddings=false",
                 *_step(8192, 1, 1, 64, "bf16", "off", "selective", "fsdp2"),
                 "train.activation_checkpointing_every=2", FULL_LOGITS]
    return Case("TT-6", TITAN, "llama3.2-1b", tuple(overrides), "a100 sxm 80gb", 64, 2_904,
                "the table's tokens/s/GPU column",
                "off: the measured row is torchtitan without torch.compile (eager)",
                ("selective per-layer AC at torchtitan's default selective_ac_option 2 (every 2nd block recomputed) "
                 "= flopwise selective with activation_checkpointing_every=2",
                 "FSDP2 with bf16 param / fp32 reduce mixed precision = flopwise fsdp2 under bf16 autocast",
                 "attention: SDPA (the same kernels flopwise's SDPA chooses)",
                 FULL_LOGITS_WHY.format("torchtitan")),
                network="ib-hdr", network_why="assumed: the source names no inter-node link; InfiniBand HDR "
                "200 Gb/s per GPU is the usual A100 cluster's",
                gpu_why="the page's 'A100 80GB'; SXM assumed (it names no form factor)")


# --------------------------------------------------------------------------- held out
# Public measurements that are not in the calibration file: the same model, unchanged, is held to
# the same bounds on them (other model sizes than any calibration case). torchtitan's other rows
# on the same 64 A100s: Llama 2 13B (40 layers, d 5120, 40 heads MHA, FFN 13824, vocab 32000,
# sequence 4096) and the 70B models; "selective layer" = every 2nd block, flopwise's selective.
# Its "selective op" rows have no flopwise equivalent and are left out.

def titan(cid: str, shape: tuple[int, int, int, int, int, int], seq: int, micro: int, ac: str,
          measured: int, row: str) -> Case:
    layers, d, heads, kv, ffn, vocab = shape
    overrides = ["model.arch=llama", *_shape(layers, d, heads, kv, ffn, vocab, seq), "model.tie_embeddings=false",
                 *_step(seq, micro, 1, 64, "bf16", "off", ac, "fsdp2"), "train.activation_checkpointing_every=2",
                 FULL_LOGITS]
    return Case(cid, TITAN, "llama3.2-1b", tuple(overrides), "a100 sxm 80gb", 64, measured,
                f"the table's WPS column: {row}",
                "off: torchtitan's measured rows ran without torch.compile (eager)",
                ("FSDP2 with bf16 param / fp32 reduce mixed precision = flopwise fsdp2 under bf16 autocast",
                 "attention: SDPA (the same kernels flopwise's SDPA chooses)",
                 FULL_LOGITS_WHY.format("torchtitan")),
                network="ib-hdr", network_why="assumed: the source names no inter-node link",
                gpu_why="the page's 'A100 80GB'; SXM assumed (it names no form factor)")


LLAMA2_13B = (40, 5120, 40, 40, 13824, 32000)
LLAMA_70B = (80, 8192, 64, 8, 28672, 128256)


# llm-foundry's own tables hold more rows than the calibration set took: the same one-node runs at
# other sequence lengths. Taken by one rule, before any was predicted: 8 GPUs, models 125m-1b
# (flopwise's range), sequence 1024, 4096 and 8192 (the calibration's are 2048), A100 80GB and H100
# 80GB, as the README's tables give them (size, seq, micro-batch, accumulation, tokens/s/GPU).
FOUNDRY_ROWS = {
    "a100": (("125m", 1024, 64, 2, 156_468), ("125m", 4096, 16, 2, 118_396), ("125m", 8192, 8, 2, 90_392),
             ("350m", 1024, 64, 2, 64_813), ("350m", 4096, 16, 2, 49_555), ("350m", 8192, 8, 2, 36_569),
             ("760m", 1024, 48, 2, 29_765), ("760m", 4096, 12, 2, 27_351), ("760m", 8192, 6, 2, 20_933),
             ("1b", 1024, 18, 4, 22_112), ("1b", 4096, 7, 4, 17_807), ("1b", 8192, 3, 4, 13_814)),
    "h100": (("760m", 1024, 48, 2, 78_581), ("760m", 4096, 12, 2, 55_459), ("760m", 8192, 6, 2, 41_825),
             ("1b", 1024, 18, 4, 48_910), ("1b", 4096, 7, 4, 38_535), ("1b", 8192, 3, 4, 29_157)),
}


def foundry_rows() -> list[Case]:
    return [mpt(f"MF-{size}-{gpu}-{seq // 1024}k", size, gpu, micro, accum, measured, seq=seq)
            for gpu, rows in FOUNDRY_ROWS.items() for size, seq, micro, accum, measured in rows]


# Llama 3 8B on H100. Taken by one rule, written before any was predicted: every bf16 (no float8) row
# of Llama 3 / 3.1 8B on H100 that torchtitan or torchao publishes with FSDP alone (no TP, CP or PP)
# at sequence 8192 -- torchtitan's benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3 (8 and
# 128 GPUs, local batch 2, selective AC, eager and torch.compile) and the bf16 baseline of torchao's
# docs/source/workflows/training.md (8 GPUs, batch 1, torch.compile, per-op SAC; the reference's F-1).
# Table 2 (full AC, float8, context parallel) and every float8 row are left out by the rule.
TITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHAO = "pytorch/ao docs/source/workflows/training.md (torchao 0.10)"
LLAMA3_8B = (32, 4096, 32, 8, 14336, 128256)
H100_96GB_WHY = ("torchtitan's page: 'Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory "
                 "bandwidth', 'We used the default 500W power limit'")
PER_OP_SAC = ("activation checkpointing: the source ran torchtitan's per-op selective AC (every block: the outputs "
              "of SDPA and of every 2nd matmul kept; wk, wo, w3 recomputed); flopwise's per-layer selective "
              "(every 2nd block recomputed, up to its last saved input: q/k/v, o, w1, w3) is predicted -- the "
              "same recomputed matmul FLOPs -- rather than its selective_op, which keeps every matmul output "
              "(its fused projections have no 'every 2nd mm'). Per-layer also recomputes attention's forward "
              "in half the blocks (about 3% of the predicted step): on this count the prediction errs slow")


SDPA_FLASH_THEN = ("attention: SDPA's flash kernel, which the source's torch (before 2.9's cuDNN-first order) ran "
                   "first on sm90/sm100; flopwise's torch runs cuDNN's there (ratio_flopwise_attention)")


def titan_h100(cid: str, source: str, gpus: int, micro: int, compiled: bool, measured: float, how: str,
               gpu_why: str) -> Case:
    layers, d, heads, kv, ffn, vocab = LLAMA3_8B
    overrides = ["model.arch=llama", *_shape(layers, d, heads, kv, ffn, vocab, 8192), "model.rope_theta=500000",
                 "model.tie_embeddings=false",
                 *_step(8192, micro, 1, gpus, "bf16", "blocks" if compiled else "off", "selective", "fsdp2"),
                 "train.activation_checkpointing_every=2", FULL_LOGITS]
    compile_why = ("blocks: torchtitan compiles each transformer block (apply_compile), as flopwise's "
                   "train.compile=blocks does" if compiled else "off: the row ran without torch.compile (eager)")
    return Case(cid, source, "llama3.2-1b", tuple(overrides), "h100 sxm 96gb", gpus, measured, how, compile_why,
                (PER_OP_SAC,
                 "FSDP2 with bf16 param / fp32 reduce mixed precision = flopwise fsdp2 under bf16 autocast",
                 SDPA_FLASH_THEN,
                 FULL_LOGITS_WHY.format("torchtitan" if source == TITAN_H100 else "torchao's torchtitan run")),
                attention_as="flash",
                network="400gbit" if gpus > 8 else None,
                network_why="the page: 'backend RDMA network with 400 Gb/s per GPU'" if gpus > 8 else
                "one node: NVLink only", gpu_why=gpu_why)


def titan_h100_rows() -> list[Case]:
    return [
        titan_h100("TTH-8", TITAN_H100, 8, 2, False, 5762, "Table 1 (8 GPUs): | FSDP | 5,762 | 82.4 |",
                   H100_96GB_WHY),
        titan_h100("TTH-8c", TITAN_H100, 8, 2, True, 6667, "Table 1 (8 GPUs): | FSDP + torch.compile | 6,667 | 77.0 |",
                   H100_96GB_WHY),
        titan_h100("TTH-128", TITAN_H100, 128, 2, False, 5605, "Table 3 (128 GPUs): | FSDP | 5,605 | 67.0 |",
                   H100_96GB_WHY),
        titan_h100("TTH-128c", TITAN_H100, 128, 2, True, 6514,
                   "Table 3 (128 GPUs): | FSDP + torch.compile | 6,514 | 62.0 |", H100_96GB_WHY),
        titan_h100("F-1-bf16", TORCHAO, 8, 1, True, 6150,
                   "| Llama3-8b | none (bfloat16) | 47.65 | 6150 | - (median tokens/second)",
                   "assumed: torchao's page says only '8xH100'; the PyTorch team's torchtitan H100 runs of the "
                   "same months used Meta's 96GB HBM2e H100s at their 500 W default limit (" + TITAN_H100 + ")"),
    ]


# --------------------------------------------------------------------------- beyond A100/H100, and fp8
# The reference's section "Beyond A100/H100, and fp8" (issue 52): B200, RTX 4090 and fp8 runs. An fp8
# case names its bf16 twin (``twin``): the pair's predicted speed-up is held to the measured one.
# torchao's float8 (torchtitan's and torchao's runs) is what flopwise traces. TransformerEngine's fp8
# (llm-foundry's amp_fp8, Megatron-Bridge) is not torchao: its linears are traced as torchao's
# tensorwise float8 linears (one scale a tensor: TE's delayed and current scaling are per tensor
# too); their casts are priced as TE's kernels run them (``casts_as="te"``, :func:`as_fused_casts`).
TITAN_MX = "pytorch/torchtitan torchtitan/components/quantization/mxfp8.md @5b5f578"
MEGATRON = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @4ab94df (25.11)"
SPEEDRUN = "tyler-romero/nanogpt-speedrun logs/4c627c0d-029c-4f8a-bd18-40f99b43b22e.txt"
NANOGPT = "karpathy/nanoGPT PR #225"
FLOAT8_AG = "discuss.pytorch.org: Enabling Float8 All-Gather in FSDP2"
POWER_LIMITED = ("the source ran 'power limited B200 GPUs' (its bf16 row is 21% of the dense bf16 peak); the limit "
                 "is not given, so its absolute figures are not held to the bound, its fp8 speed-up is")
TENSORWISE_AG = ("train.fp8=true", "train.fp8_recipe=tensorwise")
ROWWISE = ("train.fp8=true", "train.fp8_recipe=rowwise")
MXFP8 = ("train.fp8=true", "train.fp8_recipe=mxfp8")
TORCHAO_FP8 = ("fp8: torchao's float8 linears, as flopwise's train.fp8 runs them (the LM head and any linear with "
               "a dimension not a multiple of 16 left in bf16, torchtitan's filter does the same for the head)")


def llama8b(cid: str, source: str, gpu: str, step: tuple[int, int, str, str], fp8: tuple[str, ...],
            measured: float | None, how: str) -> Case:
    """Llama 3 8B at sequence 8192 on one node of 8, compiled per block (torchtitan's apply_compile);
    ``step``: micro-batch, accumulation, strategy, activation checkpointing."""
    layers, d, heads, kv, ffn, vocab = LLAMA3_8B
    micro, accum, strategy, ac = step
    overrides = ["model.arch=llama", *_shape(layers, d, heads, kv, ffn, vocab, 8192), "model.rope_theta=500000",
                 "model.tie_embeddings=false", *_step(8192, micro, accum, 8, "bf16", "blocks", ac, strategy),
                 *(["train.activation_checkpointing_every=2"] if ac == "selective" else []), FULL_LOGITS, *fp8]
    return Case(cid, source, "llama3.2-1b", tuple(overrides), gpu, 8, measured, how,
                "blocks: torchtitan compiles each transformer block (apply_compile), as train.compile=blocks does",
                network_why="one node: NVLink only")


MX_CASTS = ("MXFP8: torchao 0.13's mxfp8_cublas recipe cast along rows with to_mx under compile and along columns "
            "with its CUDA kernel; flopwise's trace casts both ways with to_mx under compile (torchao's "
            "Triton and CUDA cast kernels cannot load in a CPU build), each cast one fused pass, and prices the "
            "block-scaled GEMMs (_scaled_mm with e8m0 scales, cuBLAS) at the fp8 rate")


def b200_titan(cid: str, fp8: tuple[str, ...], measured: float, row: str, twin: str | None) -> Case:
    c = llama8b(cid, TITAN_MX, "b200", (1, 1, "fsdp2", "selective"), fp8, measured, f"the table's row {row}")
    return _with(c, twin=twin, ratio_only=POWER_LIMITED, attention_as="flash",
                 gpu_why="'8x power limited B200 GPUs' (HGX B200, 180 GB)",
                 differs=(PER_OP_SAC, "FSDP2 with bf16 param / fp32 reduce = flopwise fsdp2 under bf16 autocast",
                          "attention: torch 2.9.0.dev20250815 (before the cuDNN-first order of 2025-09-03) ran "
                          "SDPA's flash kernel; predicted at flash (attention_as=flash)",
                          FULL_LOGITS_WHY.format("torchtitan"), *([TORCHAO_FP8] if fp8 else []),
                          *([MX_CASTS] if fp8 == MXFP8 else [])))


def _with(case: Case, **changes: Any) -> Case:
    return dataclasses.replace(case, **changes)


def h100_torchao(cid: str, fp8: tuple[str, ...], measured: float, row: str) -> Case:
    """torchao's Llama 3 8B float8 rows (the reference's F-1, F-2), twins of the held-out F-1-bf16."""
    [base] = [c for c in titan_h100_rows() if c.id == "F-1-bf16"]
    gather = ("under FSDP2 the weights are all-gathered in fp8 (tensorwise), in bf16 (rowwise), as in the source's "
              "rows 'tensorwise with float8 all-gather' and 'rowwise with bfloat16 all-gather'")
    return _with(base, id=cid, overrides=base.overrides + fp8, measured=measured, measured_how=row, twin="F-1-bf16",
                 differs=base.differs + (TORCHAO_FP8, gather))


TE_FP8 = ("fp8: TransformerEngine's fp8 linears (amp_fp8, TE's delayed per-tensor scaling) are traced as torchao's "
          "tensorwise float8 linears, their casts priced as TE runs them (casts_as=te): one fused cast-transpose "
          "kernel per input, weight and incoming gradient a micro-batch, the fp8 forms reused in backward where "
          "torchao casts again; the rest of the step eager as the source runs")


def mpt_fp8(cid: str, size: str, micro: int, accum: int, bf16: int, fp8: int) -> list[Case]:
    """llm-foundry's H100 amp_bf16 / amp_fp8 rows at sequence 512: the bf16 twin and the fp8 case."""
    twin = _with(mpt(f"{cid}-bf16", size, "h100", micro, accum, bf16, seq=512),
                 measured_how="the table's T/s/GPU column, amp_bf16 row")
    return [twin, _with(twin, id=cid, overrides=twin.overrides + TENSORWISE_AG, measured=fp8,
                        measured_how="the table's T/s/GPU column, amp_fp8 row", twin=twin.id,
                        differs=twin.differs + (TE_FP8,), casts_as="te")]


def rtx4090() -> list[Case]:
    gpt2 = ["model.arch=gpt2", *_shape(12, 768, 12, 12, 3072, 50304, 1024), FULL_LOGITS]
    c1 = Case("C-1", SPEEDRUN, "gpt2-124m",
              tuple(gpt2 + _step(1024, 32, 4, 2, "bf16", "model", "none", "ddp")), "rtx 4090", 2,
              262_144 / 1.19136 / 2, "step_avg:1191.36ms for 262,144 tokens (derived: / 1.19136 s / 2 GPUs)",
              "model: the source's torch.compile(model) under DDP (train.compile=model)",
              ("attention: SDPA (flash on sm89, as flopwise's torch picks)", "optimizer: torch AdamW (foreach, not "
               "fused); flopwise's fused AdamW is predicted", FULL_LOGITS_WHY.format("nanoGPT")),
              network_why="one node of 2 GeForce cards: PCIe, no NVLink and no peer-to-peer",
              gpu_why="nvidia-smi in the log: 'NVIDIA GeForce RTX 4090', 450 W")
    no_bias = ["model.attn_bias=false", "model.mlp_bias=false", "model.norm_bias=false"]
    c3 = Case("C-3", NANOGPT, "gpt2-124m",
              tuple(gpt2 + no_bias + _step(1024, 12, 40, 1, "bf16", "model", "none", "single")), "rtx 4090", 1,
              491_520 / 4.620, "~4,620 ms an iteration of 491,520 tokens (derived: / 4.62 s)",
              "model: nanoGPT's compile = True (torch.compile(model))",
              ("attention: SDPA (flash on sm89)", "optimizer: torch AdamW fused=True = flopwise's",
               FULL_LOGITS_WHY.format("nanoGPT")),
              network_why="one GPU", gpu_why="the PR: 'gpt2, 1 GPU (4090)'")
    return [c1, c3]


def b200_megatron() -> Case:
    c = llama8b("B-6", MEGATRON, "b200", (2, 8, "zero1", "none"), TENSORWISE_AG, 30_624,
                "| LLAMA3_8B | 8 | FP8-CS (FP8-MX) | 128 | 2 | 8192 | ... | 8 | 30624 (29521) |: FP8-CS")
    return _with(c, attention_as="cudnn", casts_as="te", gpu_why="DGX-B200", compile_why=(
        "blocks: Megatron's TransformerEngine layers are fused CUDA kernels (LayerNorm-linear, bias-GELU, "
        "cast-transpose); inductor's fused regions of compiled blocks stand for them"), differs=(
        "Megatron-Core with TransformerEngine, not PyTorch eager: its fused kernels are predicted as compiled blocks",
        "data parallel 8 with the distributed optimizer = flopwise zero1 (DDP underneath, optimizer state sharded)",
        "fp8: TE's current scaling (FP8-CS: one scale a tensor, computed from this step's amax) = torchao's "
        "tensorwise dynamic scaling; traced as torchao's float8 linears, their casts priced as TE runs them "
        "(casts_as=te: one cast-transpose per tensor a micro-batch, reused in backward)",
        "attention: TE's fused attention, cuDNN's kernel on Blackwell (attention_as=cudnn)",
        "activation recompute: none assumed (the table gives none for 8B)", FULL_LOGITS_WHY.format("Megatron")))


def llama70b_128(cid: str, fp8: tuple[str, ...], twin: str | None) -> Case:
    layers, d, heads, kv, ffn, vocab = LLAMA_70B
    overrides = ["model.arch=llama", *_shape(layers, d, heads, kv, ffn, vocab, 8192), "model.rope_theta=500000",
                 "model.tie_embeddings=false", *_step(8192, 1, 1, 128, "bf16", "blocks", "full", "fsdp2"),
                 FULL_LOGITS, *fp8]
    return Case(cid, FLOAT8_AG, "llama3.2-1b", tuple(overrides), "h100 sxm 80gb", 128, None,
                "only a speed-up is given: '1.50x speedup with float8 compared with bfloat16'",
                "blocks: torchtitan's apply_compile (assumed: the post says 'TorchTitan')",
                ("assumed, the post gives no settings: sequence 8192, local batch 1, full activation checkpointing, "
                 "FSDP2 over all 128 GPUs (torchtitan's Llama 3 70B defaults of the time but its tensor parallelism, "
                 "which flopwise has not)", TORCHAO_FP8 if fp8 else "bf16 twin of the fp8 run",
                 "attention: SDPA flash (torch of mid-2024)"),
                network="400gbit", network_why="assumed: 400 Gb/s per GPU, as the H100 clusters of torchtitan's "
                "pages", attention_as="flash", twin=twin, gpu_why="'128 H100s': 80 GB SXM assumed")


def beyond() -> list[Case]:
    """The calibration cases of 'Beyond A100/H100, and fp8', in the reference's order, with the
    bf16 twins their fp8 speed-ups need."""
    return [
        b200_titan("B-1", (), 8307.5, "| None (bfloat16) | 33.71 | 8307.5 | - |", None),
        b200_titan("B-2", TENSORWISE_AG, 10417.0, "| float8 tensorwise | 33.38 | 10417.0 | +25.4% |", "B-1"),
        b200_titan("B-3", MXFP8, 9969.0, "| mxfp8_cublas | 33.88 | 9969.0 | +20.0% |", "B-1"),
        b200_megatron(),
        *rtx4090(),
        h100_torchao("F-1", TENSORWISE_AG, 7689.5, "| Llama3-8b | tensorwise with float8 all-gather | 47.77 | 7689.5 |"),
        h100_torchao("F-2", ROWWISE, 6768, "| Llama3-8b | rowwise with bfloat16 all-gather | 47.79 | 6768 |"),
        *mpt_fp8("F-6", "3b", 40, 6, 27_965, 36_527),
        *mpt_fp8("F-9", "1b", 56, 4, 52_275, 70_315),
        llama70b_128("F-12-bf16", (), None),
        _with(llama70b_128("F-12", TENSORWISE_AG, "F-12-bf16"), speedup=1.50),
    ]


# torchtitan's float8 rows of the same H100 page (never used to set a constant, taken by one rule:
# every float8 row of it flopwise can express -- Table 1's and Table 3's "FSDP + torch.compile +
# Float8", twins of TTH-8c and TTH-128c, and Table 2's "FSDP 8, CP 1", which is FSDP alone at
# sequence 32768; its other rows need context parallelism). torchtitan's float8 of the time is
# tensorwise dynamic scaling with the fp8 all-gather and the precomputed scales (assumed: the page
# names only "Float8").
TITAN_F8 = ("fp8: torchtitan's Float8 = torchao's tensorwise float8 linears with fp8 all-gather under FSDP2 "
            "(assumed: the page names only 'Float8'), as flopwise's train.fp8 runs them")


def titan_h100_fp8() -> list[Case]:
    rows = {c.id: c for c in titan_h100_rows()}
    out = [_with(rows[twin], id=cid, overrides=rows[twin].overrides + TENSORWISE_AG, measured=measured,
                 measured_how=how, twin=twin, differs=rows[twin].differs + (TITAN_F8,))
           for cid, twin, measured, how in (
               ("TTH-8f", "TTH-8c", 8532, "Table 1 (8 GPUs): | FSDP + torch.compile + Float8 | 8,532 | 76.8 |"),
               ("TTH-128f", "TTH-128c", 8380, "Table 3 (128 GPUs): | FSDP + torch.compile + Float8 | 8,380 | 61.8 |"))]
    base = rows["TTH-8c"]
    long = [o.replace("=8192", "=32768") if o.startswith(("model.max_seq_len", "train.seq_len")) else o
            for o in base.overrides if not o.startswith("train.activation_checkpointing_every")]
    long = [o.replace("=selective", "=full").replace("micro_batch_size=2", "micro_batch_size=1")
            .replace("global_batch_size=16", "global_batch_size=8") for o in long]
    out.append(_with(base, id="TTH-32k-f8", overrides=tuple(long) + TENSORWISE_AG, measured=3890,
                     measured_how="Table 2 (8 GPUs, full AC, local batch 1): | FSDP 8, CP 1 | 32768 | 3,890 | 83.9 |",
                     differs=(base.differs[1], base.differs[2], base.differs[3], TITAN_F8)))
    return out


def holdouts() -> list[Case]:
    """Held-out measurements (never used to set a constant): reported apart from the calibration set."""
    return [
        *foundry_rows(),
        titan("TT-13a", LLAMA2_13B, 4096, 2, "none", 2162, "| 13B | 2 | no | 2162 | 61.1% |"),
        titan("TT-13b", LLAMA2_13B, 4096, 2, "selective", 1914, "| 13B | 2 | selective layer | 1914 | 54.1% |"),
        titan("TT-70a", LLAMA_70B, 8192, 1, "full", 331, "| 70B | 1 | full | 331 | 51.7% | (Llama 3)"),
        titan("TT-70b", (*LLAMA_70B[:5], 32000), 4096, 2, "full", 353, "| 70B | 2 | full | 353 | 50.5% | (Llama 2)"),
        *titan_h100_rows(),
        *titan_h100_fp8(),
    ]


# --------------------------------------------------------------------------- running

def describe(case: Case) -> dict[str, Any]:
    """The case as the JSON and ``--list`` show it (builds its config: a ConfigError if it is invalid)."""
    cfg = case.config()
    m, t = cfg.model, cfg.train
    spec = hardware.find(case.gpu)
    return {"id": case.id, "source": case.source, "gpu": spec.name if spec else case.gpu, "gpus": case.gpus,
            "nproc_per_node": case.nproc_per_node, "nnodes": case.nnodes, "network": case.network,
            "network_why": case.network_why, "gpu_why": case.gpu_why, "preset": case.preset,
            "overrides": list(case.overrides),
            "shape": f"{m.n_layers} layers, d {m.d_model}, {m.n_heads}/{m.n_kv_heads} heads, ffn {m.ffn_hidden}, "
                     f"vocab {m.vocab_size}, {m.norm}, {m.mlp}, {m.pos_emb}, tied {m.tie_embeddings}",
            "seq_len": t.seq_len, "micro_batch": t.micro_batch_size, "global_batch": t.global_batch_size,
            "accum": cfg.grad_accum_steps(case.gpus), "precision": t.precision, "compile": t.compile,
            "compile_why": case.compile_why, "activation_checkpointing": t.activation_checkpointing,
            "strategy": cfg.parallel.strategy, "measured_tokens_per_s_per_gpu": None if case.measured is None else round(case.measured, 1),
            "measured_how": case.measured_how, "source_params": case.params, "differs": list(case.differs),
            "fp8": t.fp8_recipe if t.fp8 else None, "twin": case.twin, "ratio_only": case.ratio_only or None,
            "unsupported": case.unsupported or None}


def predict(case: Case, traces: Path | None = None) -> dict[str, Any]:
    """Trace the case and predict its step on the case's links; ``predicted`` is None (with
    ``why``) when there is none. With ``traces``, a case's dry-run result is kept there
    (``ID.json``) and read back instead of tracing again: the trace does not depend on the time
    model's constants, so a change to them is re-checked in seconds."""
    t0 = time.perf_counter()
    if case.unsupported:
        return {"trace_s": 0.0, "predicted": None, "why": f"not traced: {case.unsupported}"}
    kept = traces / f"{case.id}.json" if traces else None
    if kept is not None and kept.is_file():
        result = json.loads(kept.read_text())
    else:
        try:
            result = dry_run(case.config(), gpu=case.gpu, nproc_per_node=case.nproc_per_node, nnodes=case.nnodes,
                             log=lambda s: None)
        except (ConfigError, DryRunFailed) as e:  # the case is reported as not traced, the rest go on
            return {"trace_s": round(time.perf_counter() - t0, 1), "predicted": None, "why": f"not traced: {e}"}
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(json.dumps(result, default=str))
    base = as_fused_casts(result) if case.casts_as == "te" else result  # the source's casts, either kernel
    own = predicted(base, case.config(), network=case.network)
    pred = predicted(as_source(base, case.attention_as), case.config(), network=case.network) \
        if case.attention_as and case.attention_as != own_kernel(result) else own
    row: dict[str, Any] = {"trace_s": round(time.perf_counter() - t0, 1), "compile_traced": result.get("compile"),
                           "loss_traced": result.get("loss"), "network_passed": bool(case.network),
                           "attention_as": case.attention_as}
    if own.get("predicted") and case.measured:
        row["ratio_flopwise_attention"] = float(own["tokens_per_s_per_gpu"]) / case.measured
    if not pred.get("predicted"):
        return {**row, "predicted": None, "why": pred.get("why", "no prediction (no reason given)")}
    tps = float(pred["tokens_per_s_per_gpu"])
    return {**row, "predicted": tps, "ratio": tps / case.measured if case.measured else None,
            "step_s": pred.get("step_s"), "fp8_matmuls": pred.get("fp8"),
            "mfu": pred.get("mfu"), "hfu": pred.get("hfu"), "breakdown": pred.get("breakdown"),
            # the links the prediction counted (GB/s per GPU): a dry run without network= takes its default
            "link_gb_s": pred.get("link"), "network_gb_s": pred.get("network")}


SDPA_FUSED = ("flash", "cudnn")  # the fused kernels SDPA chooses first on a GPU (flash, or cuDNN on sm90/sm100)


def own_kernel(result: dict[str, Any]) -> str | None:
    """The fused SDPA kernel the trace chose (flopwise's torch, on the case's GPU), or None."""
    kernels = (result.get("trace") or {}).get("sdpa_kernels") or {}
    return next((k for k in SDPA_FUSED if kernels.get(k)), None)


def as_source(result: dict[str, Any], kernel: str) -> dict[str, Any]:
    """A copy of the dry run's ``result`` whose traced fused SDPA kernels (flash, cuDNN) are
    ``kernel`` (the source's, see :attr:`Case.attention_as`); every other record as traced."""
    kernels = (result.get("trace") or {}).get("kernels")
    if not kernels:
        return result
    records = [{**r, "kernel": kernel} if r["kind"] == "attn" and r["kernel"] in SDPA_FUSED else r
               for r in kernels["records"]]
    return {**result, "trace": {**result["trace"], "kernels": {**kernels, "records": records}}}


# The ops of torchao's eager float8 cast (amax, scale, clamp, cast, and the layout copies around it)
CAST_OPS = frozenset({"abs", "max", "amax", "_to_copy", "clamp", "reciprocal", "mul", "div", "contiguous", "clone",
                      "copy_", "t", "transpose", "permute", "view", "reshape", "expand"})


def _cast_chains(records: list[dict[str, Any]]) -> list[tuple[int, set[int], frozenset[int]]]:
    """Each scaled matmul input's eager cast chain: (the record that makes the value the matmul
    reads, the chain's records -- back to a tensor some other op made --, the values it casts
    from), in the order the step runs them."""
    maker = {v: i for i, r in enumerate(records) for v, _ in r["writes"]}
    out = []
    for r in records:
        if r["kind"] != "mm" or r["op"] != "_scaled_mm":
            continue
        for value, _ in r["reads"]:
            chain: set[int] = set()
            todo = [value]
            while todo:
                i = maker.get(todo.pop(), -1)
                c = records[i] if i >= 0 else None
                if c is None or i in chain or c["kind"] != "mem" or c["op"] not in CAST_OPS:
                    continue
                chain.add(i)
                todo += [v for v, _ in c["reads"]]
            if chain:
                made = {v for i in chain for v, _ in records[i]["writes"]}
                sources = frozenset(v for i in chain for v, _ in records[i]["reads"] if v not in made)
                out.append((maker[value], chain, sources))
    return sorted(out, key=lambda c: min(c[1]))


def _bias_adds(records: list[dict[str, Any]]) -> set[int]:
    """The records that add a bias (a vector, at most a row of it) to a scaled GEMM's output."""
    scaled = {v: n for r in records if r["kind"] == "mm" and r["op"] == "_scaled_mm" for v, n in r["writes"]}
    out = set()
    for i, r in enumerate(records):
        if r["kind"] == "mem" and r["op"] == "add" and len(r["reads"]) == 2:
            (a, na), (b, nb) = r["reads"]
            if (a in scaled and nb * 64 <= na) or (b in scaled and na * 64 <= nb):
                out.add(i)
    return out


def as_fused_casts(result: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dry run's ``result`` with TransformerEngine's casts in place of torchao's
    eager ones (``casts_as="te"``). TE (``module/linear.py``) casts a linear's input and weight in
    forward with ``fp8_cast_transpose_fused`` -- one kernel reading the tensor once and writing
    its fp8 copy and the copy's transpose -- and saves both fp8 forms for backward; backward casts
    the incoming gradient once the same way and feeds its two forms to the dgrad and wgrad GEMMs.
    torchao's eager path runs abs, max, the scale, an upcast, a multiply, a clamp and the cast one
    by one, and casts again in backward what forward had cast (the saved input for wgrad) and the
    gradient once per GEMM, and adds a linear's bias to the GEMM's output in a kernel of its own
    where TE's ``fp8_gemm`` adds it in the GEMM (``bias=``). So here: each cast chain is marked as
    one compiled region's (``graph``: the time model fuses it) and writes one more fp8 copy (the
    transpose); a chain that casts, within its micro-batch, what an earlier chain cast already is
    dropped, and so is a bias add on a scaled GEMM's output."""
    kernels = (result.get("trace") or {}).get("kernels")
    if not kernels:
        return result
    records = kernels["records"]
    seen: set[tuple[int, frozenset[int]]] = set()
    kept: set[int] = set()
    dropped: set[int] = set()
    extra: dict[int, int] = {}  # record -> bytes of the transposed fp8 copy it also writes
    next_id = 1 + max((v for r in records for v, _ in (*r["reads"], *r["writes"])), default=0)
    for last, chain, sources in _cast_chains(records):
        key = (records[last]["micro"], sources)
        if key in seen:
            dropped |= chain
            continue
        seen.add(key)
        kept |= chain
        extra[last] = sum(n for _, n in records[last]["writes"])
    dropped |= _bias_adds(records)
    out = []
    for i, r in enumerate(records):
        if i in dropped and i not in kept:
            continue
        if i in kept:
            r = {**r, "graph": True}
        if i in extra:
            r = {**r, "writes": [*r["writes"], [next_id, extra[i]]]}
            next_id += 1
        out.append(r)
    return {**result, "trace": {**result["trace"], "kernels": {**kernels, "records": out}}}


def summary(rows: list[dict[str, Any]], key: str = "ratio") -> dict[str, Any]:
    """Median and largest |predicted / measured - 1| (``key``: the ratio to take) over the cases
    that have a prediction."""
    errors = [(abs(r[key] - 1), r["id"]) for r in rows if r.get(key) is not None and not r.get("ratio_only")]
    if not errors:
        return {"predicted_cases": 0, "cases": len(rows)}
    worst = max(errors)
    return {"predicted_cases": len(errors), "cases": len(rows),
            "median_abs_error": statistics.median(e for e, _ in errors), "largest_abs_error": worst[0],
            "largest_case": worst[1], "within_25pct": sum(e <= WITHIN for e, _ in errors)}


def _line(r: dict[str, Any]) -> str:
    measured = r["measured_tokens_per_s_per_gpu"]
    head = f"| {r['id']} | {r['gpus']} x {r['gpu']}{' fp8 ' + r['fp8'] if r.get('fp8') else ''} | " \
           f"{'-' if measured is None else f'{measured:,.0f}'} |"
    if r.get("predicted") is None:
        return f"{head} - | - | {r['why']} |"
    breakdown = r.get("breakdown") or {}
    kinds = ", ".join(f"{k} {v:.3g}" for k, v in breakdown.items() if isinstance(v, (int, float)))
    own = r.get("ratio_flopwise_attention")
    other = f" ({r['attention_as']}; flopwise's SDPA kernel: {own:.3f})" if r.get("attention_as") and own is not None \
        else ""
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}{' (ratio only)' if r.get('ratio_only') else ''}"
    return (f"{head} {r['predicted']:,.0f} (predicted) | {ratio}{other} | "
            f"predicted step {r['step_s']:.3f} s: {kinds} |")


PAIR_WITHIN = 0.10  # the bound on an fp8 pair: |predicted speed-up - measured speed-up| <= 0.10


def with_twins(chosen: list[Case], known: dict[str, Case]) -> list[Case]:
    """``chosen`` with the bf16 twin of each fp8 case in it, just before the case (once)."""
    out: list[Case] = []
    for c in chosen:
        if c.twin and c.twin.lower() in known and known[c.twin.lower()] not in out + chosen:
            out.append(known[c.twin.lower()])
        out.append(c)
    return out


def pairs(rows: list[dict[str, Any]], chosen: list[Case]) -> list[dict[str, Any]]:
    """Each fp8 case beside its bf16 twin: the measured and the predicted speed-up of fp8."""
    by_id = {r["id"]: r for r in rows}
    out = []
    for c in chosen:
        if not c.twin or c.twin not in by_id:
            continue
        fp8, bf16 = by_id[c.id], by_id[c.twin]
        measured = c.speedup if c.speedup is not None else (
            fp8["measured_tokens_per_s_per_gpu"] / bf16["measured_tokens_per_s_per_gpu"])
        row: dict[str, Any] = {"id": c.id, "twin": c.twin, "measured_speedup": measured, "predicted_speedup": None}
        if fp8.get("predicted") and bf16.get("predicted"):
            row["predicted_speedup"] = fp8["predicted"] / bf16["predicted"]
            row["difference"] = row["predicted_speedup"] - measured
        else:
            row["why"] = fp8.get("why") or bf16.get("why")
        out.append(row)
    return out


def _pair_line(p: dict[str, Any]) -> str:
    if p["predicted_speedup"] is None:
        return f"| {p['id']} / {p['twin']} | {p['measured_speedup']:.3f} | - | - | {p['why']} |"
    return (f"| {p['id']} / {p['twin']} | {p['measured_speedup']:.3f} | {p['predicted_speedup']:.3f} (predicted) | "
            f"{p['difference']:+.3f} | |")


def list_cases(chosen: list[Case]) -> None:
    for c in chosen:
        d = describe(c)
        print(f"{d['id']}  {d['source']}\n  {d['gpus']} x {d['gpu']} ({d['nnodes']} node(s) of {d['nproc_per_node']}; "
              f"network {d['network'] or '-'}: {d['network_why']})\n  {d['shape']}\n  seq {d['seq_len']}, "
              f"micro-batch {d['micro_batch']} x accum {d['accum']} x {d['gpus']} GPUs = {d['global_batch']}; "
              f"{d['precision']}, {d['strategy']}, AC {d['activation_checkpointing']}, compile "
              f"{d['compile_why']}\n  measured {d['measured_tokens_per_s_per_gpu'] or 0:,.0f} tokens/s/GPU "
              f"({d['measured_how']})\n  --preset {d['preset']} {' '.join(d['overrides'])}")
        if d["gpu_why"]:
            print(f"  GPU: {d['gpu_why']}")
        for line in d["differs"]:
            print(f"  differs: {line}")


def versions() -> dict[str, str | None]:
    """The tracing torch and torchao (which picked the SDPA kernels and traced the fp8 linears)."""
    import importlib.metadata as metadata

    import torch

    try:
        torchao: str | None = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        torchao = None
    return {"torch": torch.__version__, "torchao": torchao}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", nargs="+", metavar="ID", help="only these cases (default: all)")
    p.add_argument("--list", action="store_true", help="print the cases and their configs; trace nothing")
    p.add_argument("--json-out", type=Path, help="write the record here instead of benchmarks/results/")
    p.add_argument("--traces", type=Path, help="keep each case's trace here (ID.json) and reuse it when present")
    p.add_argument("--holdout", action="store_true", help="also the held-out measurements (reported apart)")
    p.add_argument("--set", choices=("all", "first", "beyond"), default="all",
                   help="the first calibration set (A100/H100, bf16), the one beyond it (B200, RTX 4090, fp8), or both")
    a = p.parse_args(argv)
    held, second = {c.id for c in holdouts()}, {c.id for c in beyond()}
    sets = {"all": cases() + beyond(), "first": cases(), "beyond": beyond()}[a.set]
    every = sets + (holdouts() if a.holdout or a.case else [])
    known = {c.id.lower(): c for c in cases() + beyond() + holdouts()}
    unknown = [x for x in a.case or [] if x.lower() not in known]
    if unknown:
        p.error(f"--case {' '.join(unknown)}: unknown; choose from {', '.join(c.id for c in known.values())}")
    chosen = with_twins([known[x.lower()] for x in a.case] if a.case else every, known)
    if a.list:
        list_cases(chosen)
        return 0
    print("| case | GPUs | measured tok/s/GPU | tok/s/GPU | predicted / measured (the source's attention kernel; "
          "with flopwise's) | predicted step and breakdown (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for c in chosen:
        row = {**describe(c), **predict(c, a.traces)}
        rows.append(row)
        print(_line(row), flush=True)
    for r in rows:
        r["set"] = "held out" if r["id"] in held else "beyond" if r["id"] in second else "calibration"
    calibration, beyond_rows, held_out = ([r for r in rows if r["set"] == s] for s in ("calibration", "beyond",
                                                                                         "held out"))
    own = "ratio_flopwise_attention"
    speedups = pairs(rows, chosen)
    record: dict[str, Any] = {
        "cases": rows, "bound": WITHIN, "summary": summary(calibration), "summary_held_out": summary(held_out),
        "summary_beyond": summary(beyond_rows), "fp8_pairs": speedups, "fp8_pair_bound": PAIR_WITHIN,
        "summary_flopwise_attention": summary(calibration, own),
        "summary_held_out_flopwise_attention": summary(held_out, own)}
    own_kernel = "every case with the SDPA kernel flopwise's torch picks"
    for name, key in (("calibration set", "summary"), ("beyond A100/H100 and fp8 (ratio-only cases apart)",
                                                       "summary_beyond"), ("held out", "summary_held_out"),
                      (f"calibration set, {own_kernel}", "summary_flopwise_attention"),
                      (f"held out, {own_kernel}", "summary_held_out_flopwise_attention")):
        s = record[key]
        if s["predicted_cases"]:
            print(f"\n{name}: predicted against measured: median |ratio - 1| {s['median_abs_error']:.1%}, largest "
                  f"{s['largest_abs_error']:.1%} ({s['largest_case']}), {s['within_25pct']} of "
                  f"{s['predicted_cases']} within 25%")
    if speedups:
        print("\n| fp8 case / bf16 twin | measured speed-up | predicted speed-up | predicted - measured | |")
        print("| --- | --- | --- | --- | --- |")
        for pair in speedups:
            print(_pair_line(pair))
        held_pairs = [x for x in speedups if x["predicted_speedup"] is not None]
        inside = sum(abs(x["difference"]) <= PAIR_WITHIN for x in held_pairs)
        print(f"\nfp8 speed-ups: {inside} of {len(held_pairs)} predicted within ±{PAIR_WITHIN} of the measured one"
              f" ({len(speedups) - len(held_pairs)} not predicted)")
    device = "traced on fake tensors (no GPU ran); tokens/s predicted for the cases' GPUs"
    record["versions"] = versions()
    if a.json_out is None:
        save_result("predict-vs-public", "traced", device, record)
    else:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps({"benchmark": "predict_vs_public", "device": device, **record}, indent=2)
                              + "\n")
        print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
