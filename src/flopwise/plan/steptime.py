"""A training step's time on a named GPU, predicted from the kernels of its trace. Plain arithmetic.

The dry run (``tune/kernels.py``) lists the kernels of the run's own CUDA step as traced on fake
tensors: matrix multiplies with their shapes, SDPA kernels, memory-bound ops with the values they
read and write, collectives with their bytes, host reads. This module turns that list into a
time on a GPU of the hardware table, each kernel by the resource that bounds it:

- a matrix multiply: its FLOPs at the GPU's sustained matmul rate (:data:`GEMM_FRACTION`, a
  published measurement), less what its shape wastes: output tiles of 128 x 128 (cuBLAS's usual
  bf16 tile) spread over the SMs in waves, the last wave partly empty; a grid smaller than the SMs
  is split along K as cuBLAS does. Never faster than its bytes at the achievable bandwidth;
- attention: the kernel the trace chose (flash, memory-efficient, cuDNN), forward and backward,
  at the speed its authors measured on that GPU for its head dimension, sequence length and
  causality (:data:`ATTENTION_TFLOPS`); a causal kernel does half the FLOPs of a full one;
- anything else: bytes read and written over the achievable bandwidth (:data:`HBM_FRACTION`),
  at least :data:`KERNEL_MIN_S`. Under ``torch.compile`` the elementwise ops between two matrix
  multiplies (or attention, or a collective) of the forward and the backward are one fused
  region: it reads what comes from outside it and writes what is read after it, once;
- the host: each op dispatched costs :data:`HOST_OP_S` (eager), each fused kernel
  :data:`HOST_KERNEL_S`; when the GPU's work per op is smaller, the host bounds the step;
- collectives: ring algorithms over the link (NVLink/PCIe in a node, the network between
  nodes), at the fraction of the link nccl-tests reach, plus a latency per call; each runs on
  its own stream from when it is issued and its inputs exist, and a kernel that reads what a
  collective produced waits for it. Only the *exposed* communication costs.

A two-stream simulation (compute, communication) with the host ahead of both gives the step's
time; the traced step's first micro-batch stands for each of the run's extra ones.

Every constant below names its source. None is fitted to a case of the calibration set
(``benchmarks/predict_vs_public.py``). A GPU that lacks one gets no prediction, with the name of
what is missing. fp8 matmuls (torchao's ``_scaled_mm``) are priced at the fp8 rate
(:data:`FP8_GEMM_FRACTION`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flopwise.plan import hardware

# The fraction of the dense bf16 peak a matrix multiply *sustains* through a training run, by GPU.
# Stas Bekman's ml-engineering handbook (compute/accelerator, mamf-finder.py) measures two
# ceilings: MAMF, the best shape's rate in a short burst at the boost clock, and MSMF, the rate
# held once the GPU sits at its power limit -- "the power-saturated, sustained rate that matches
# real training throughput". MSMF is used; where the handbook gives only MAMF it is scaled down:
# - H100 SXM, H200 (one GH100 at 700 W, "H200 is the same"): MSMF 743-746 TFLOP/s over five runs
#   on an H200 -> 745 / 989.4;
# - GH200: MAMF 83.8% times the H200's measured MSMF / MAMF (745 / 846.5, the same runs);
# - A100 SXM: MAMF 271.2 / 312 (86.9%) times the clock it sustains at its 400 W limit under a
#   dense load, 1305 of 1410 MHz (NVIDIA's HPL submissions, as Glenn Lockwood's "peak FLOPS"
#   notes give them); A100 PCIe: MAMF 252.9 / 312 times the same ratio.
# - H100 NVL, H100 PCIe, H200 NVL: no MAMF or MSMF is published for any; each is the same GH100 rated by
#   NVIDIA at its own lower power (NVL 835 at 350-400 W, PCIe 756.5 at 350 W: the hardware table),
#   so the H100 SXM's sustained share of its rating (745 / 989.4) is carried to their ratings as it
#   is, not scaled: no source measures the clock either holds under its limit;
# - H100 SXM 96GB: the same share, of the rate the part is rated at under its 500 W default power
#   limit (:data:`POWER_LIMITED_TFLOPS`).
# Beyond A100/H100 only burst rates are published: the handbook's MAMF for B200 (1,745 of 2,250)
# and GB200 (1,822 of 2,500), and a community square-GEMM sweep (zzc0721/torch-performance-test-
# data database.md @9d82827: the best of sizes 1024-10240, 30 timed iterations; the median where a
# card has several rows). Each is carried to a sustained rate as GH200's is, times the H200's
# measured MSMF / MAMF (745 / 846.5 = 0.880): B200 0.776, GB200 0.729, RTX PRO 6000 Workstation
# 418.0 / 503.8, Server 409.4 / 503.8, RTX 5090 240.1 / 209.5, RTX 4090 169.5 / 165.2, RTX 3090
# 76.6 / 71, L40S 269.2 / 362.05, RTX A6000 123.3 / 154.8, L4 70.9 / 121 -- each x 0.880.
# GeForce cards boost above the clock their peak is rated at, so theirs exceed 1 before it.
# **Derived** (:data:`DERIVED`), no measurement of the part itself: RTX PRO 6000 Max-Q the
# Workstation's share of its own (lower, 300 W) rating; RTX 4070 the RTX 4090's and RTX 3060 the
# RTX 3090's (the same GeForce tensor cores, halved for fp32 accumulate); RTX 6000 Ada the L40S's
# (the same AD102, 142 SMs); A10 and A10G the RTX A6000's (GA102 data-centre and pro parts).
GEMM_FRACTION: dict[str, float] = {
    "A100 SXM 80GB": 0.804, "A100 SXM 40GB": 0.804, "A100 PCIe 80GB": 0.751, "A100 PCIe 40GB": 0.751,
    "H100 SXM": 0.753, "H200": 0.753, "GH200": 0.738, "H100 NVL": 0.753, "H100 PCIe": 0.753,
    "H100 SXM 96GB": 0.753, "H200 NVL": 0.753,
    "B200": 0.683, "GB200": 0.641,
    "RTX PRO 6000 Blackwell Workstation": 0.730, "RTX PRO 6000 Blackwell Server": 0.715,
    "RTX PRO 6000 Blackwell Max-Q": 0.730,
    "RTX 5090": 1.008, "RTX 4090": 0.903, "RTX 3090": 0.949, "RTX 4070": 0.903, "RTX 3060 12GB": 0.949,
    "L40S": 0.654, "RTX 6000 Ada": 0.654, "L4": 0.516,
    "RTX A6000": 0.701, "A10": 0.701, "A10G": 0.701,
}
# fp8 matrix multiplies (torch._scaled_mm, what torchao's float8 training runs), as a fraction of the
# dense fp8 peak: the handbook's fp8 (e4m3) MAMF -- H100 SXM 1,402.6 / 1,979, H200 1,453.4 / 1,979,
# B200 3,432.5 / 4,500, GB200 3,615.6 / 5,000 -- times the H200's bf16 MSMF / MAMF (0.880), as the
# bf16 shares are carried. Elsewhere **derived** (no fp8 GEMM of the part is published): its bf16
# share times the H100's fp8 / bf16 MAMF ratio (0.7087 / 0.8030 = 0.883); the other Hopper parts
# take the H100 SXM's own. A part with no fp8 peak in the table (A100, RTX PRO 6000) prices none.
FP8_GEMM_FRACTION: dict[str, float] = {"H100 SXM": 0.624, "H200": 0.646, "B200": 0.671, "GB200": 0.636,
                                       "H100 SXM 96GB": 0.624, "H100 NVL": 0.624, "H100 PCIe": 0.624,
                                       "H200 NVL": 0.646, "GH200": 0.646}
FP8_OVER_BF16 = 0.883
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# The dense bf16 rate of a part run below the TDP its table peak is rated at, by default: what its
# tensor cores (matmuls and attention alike) run at instead of the table's peak, fp16/tf32 in the
# same proportion. H100 SXM 96GB: torchtitan ran it at its "default 500W power limit" (700 W TDP)
# and says its "actual peak TFLOPs number is between SXM and NVL" (benchmarks/
# llama3_h100_202412_torchtitan.md, footnote 2), i.e. between 835 (H100 NVL, 132 SMs rated at its
# 400 W maximum) and 989.4 (H100 SXM, 700 W). Derived: linear in power between those two rated
# parts, 835 + (500 - 400) / (700 - 400) x (989.4 - 835) = 886.5; the source bounds it to 835-989.4
# (-6% / +12%), nothing pins it closer.
POWER_LIMITED_TFLOPS: dict[str, float] = {"H100 SXM 96GB": 886.5}
# Achievable fraction of the datasheet HBM bandwidth for a streaming kernel: the same handbook's
# memory-copy measurements and NVIDIA's own STREAM-type figures put A100 and H100 at 85-92%;
# 0.85, the low end, as the elementwise kernels of a training step are short.
HBM_FRACTION = 0.85
# SDPA kernels' measured speed, forward and backward together, in TFLOP/s at sequence lengths
# ATTENTION_SEQS, by architecture -> kernel -> (causal, head dimension 64 or 128). The source is
# the FlashAttention repository's own figures (Dao-AILab/flash-attention, assets/
# flash2_a100_fwd_bwd_benchmark.png on an A100 80GB SXM4 and flash2_h100_fwd_bwd_benchmark.png
# on an H100 80GB SXM5, as in the FlashAttention-2 paper; its benchmarks/benchmark_flash_attention.py
# runs 16k tokens a call at hidden size 2048). FLOPs are counted as that script counts them:
# 4·B·H·T·T·D forward, half of it when causal, 2.5 x the forward for the backward; the figures
# time forward and backward together, and each is charged at that speed by its FLOPs. Kernels:
# - flash: FlashAttention-2, the kernel PyTorch's SDPA runs as its flash backend;
# - efficient: xFormers' cutlass kernel ("xformers" in the figure), which PyTorch's
#   memory-efficient SDPA backend is built from (A100 only: the H100 figure does not have it);
# - flash1: FlashAttention (v1), which no SDPA backend runs: it is here to predict published runs
#   that used it (benchmarks/predict_vs_public.py). Its Triton port, which llm-foundry runs, is
#   within 3% of it at sequence 2048 in the A100 figure ("FlashAttention Triton").
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_TFLOPS: dict[str, dict[str, dict[tuple[bool, int], tuple[float, ...]]]] = {
    "sm80": {
        "flash": {(False, 64): (132, 153, 162, 171, 175, 176), (False, 128): (151, 173, 187, 196, 201, 203),
                  (True, 64): (88, 119, 140, 156, 165, 171), (True, 128): (99, 133, 155, 173, 182, 189)},
        "efficient": {(False, 64): (68, 73, 76, 77, 75, 75), (False, 128): (83, 91, 95, 96, 97, 98),
                      (True, 64): (51, 60, 66, 68, 69, 67), (True, 128): (58, 72, 82, 87, 91, 92)},
        "flash1": {(False, 64): (91, 92, 104, 108, 110, 110), (False, 128): (76, 72, 76, 80, 82, 83),
                   (True, 64): (58, 70, 77, 87, 92, 97), (True, 128): (55, 62, 69, 76, 80, 83)},
    },
    "sm90": {
        "flash": {(False, 64): (215, 254, 274, 288, 294, 296), (False, 128): (248, 294, 320, 326, 335, 338),
                  (True, 64): (141, 192, 232, 257, 273, 284), (True, 128): (163, 221, 265, 294, 308, 328)},
        "flash1": {(False, 64): (157, 159, 161, 161, 166, 168), (False, 128): (127, 127, 128, 131, 137, 139),
                   (True, 64): (104, 123, 136, 138, 149, 156), (True, 128): (98, 109, 108, 126, 135, 137)},
    },
}
# Beyond sm80 and sm90 one shape is measured per architecture, and the other shapes follow the
# shape dependence of the nearest measured table, scaled to that one point (**derived**):
# - sm100 (B200, GB200): FlashAttention-2 (flash_attn 2.7.4, torch 2.8) on a B200 at head
#   dimension 64, non-causal, batch 8 x sequence 2048: 381 forward, 302 backward -> 321 for both
#   together; the sm90 flash table scaled by 321 / 274.
# - sm86 (RTX 3090, 3060, A6000, A10, A10G): FlashAttention-2 on an RTX A5000 (111 TFLOP/s dense)
#   at head dimension 64, non-causal, sequence 2048: 81.3 forward, 70.1 backward -> 72.9 for both;
#   the sm80 tables (flash and memory-efficient) scaled by (72.9 / 111) / (162 / 312).
# - sm89 (Ada: RTX 4090, 4070, L4, L40S, RTX 6000 Ada) and sm120 (RTX 5090, RTX PRO 6000): no
#   public attention measurement; SDPA runs the same SM80-base FlashAttention-2 kernels there
#   (FA4's Blackwell path is sm100 only), so sm86's fractions of the peak are carried over.
_SM100_SCALE = 321.0 / 274.0
_SM86_SCALE = (72.9 / 111.0) / (162.0 / 312.0)


Speeds = dict[tuple[bool, int], tuple[float, ...]]


def _scaled(table: Speeds, factor: float) -> Speeds:
    return {key: tuple(round(v * factor, 1) for v in speeds) for key, speeds in table.items()}


ATTENTION_TFLOPS["sm100"] = {"flash": _scaled(ATTENTION_TFLOPS["sm90"]["flash"], _SM100_SCALE)}
ATTENTION_TFLOPS["sm86"] = {k: _scaled(ATTENTION_TFLOPS["sm80"][k], _SM86_SCALE) for k in ("flash", "efficient")}
ATTENTION_TFLOPS["sm89"] = ATTENTION_TFLOPS["sm120"] = ATTENTION_TFLOPS["sm86"]
# The dense bf16 (= fp16) peak of the GPU each figure ran on: its speeds become fractions of the
# peak, which carry to the other GPUs of the architecture (A100 40GB, A100 PCIe, H200, GH200); the
# derived tables are in the units of the A100's figure, scaled (sm100: H100's).
ATTENTION_FIGURE_PEAK = {"sm80": 312.0, "sm90": 989.4, "sm100": 989.4, "sm86": 312.0, "sm89": 312.0,
                         "sm120": 312.0}
# Which attention figures are derived, by architecture (shown with a prediction that uses them).
ATTENTION_DERIVED = {
    "sm100": "attention: the H100 FlashAttention-2 table scaled to one B200 measurement",
    "sm86": "attention: the A100 FlashAttention-2 tables scaled to one RTX A5000 measurement",
    "sm89": "attention: Ampere's (RTX A5000) FlashAttention-2 speeds as a share of the peak; none measured on Ada",
    "sm120": ("attention: Ampere's (RTX A5000) FlashAttention-2 speeds as a share of the peak; none measured on "
              "consumer Blackwell"),
}
# Matmul rates carried from another part (GEMM_FRACTION's comment).
GEMM_DERIVED = {
    "RTX PRO 6000 Blackwell Max-Q": "matmul rate: the Workstation Edition's share of the peak",
    "RTX 4070": "matmul rate: the RTX 4090's share of the peak", "RTX 3060 12GB": "matmul rate: the RTX 3090's",
    "RTX 6000 Ada": "matmul rate: the L40S's share of the peak", "A10": "matmul rate: the RTX A6000's",
    "A10G": "matmul rate: the RTX A6000's",
}
# Kernels the figures lack, as a fraction of the dense bf16 peak, (kernel, way) -> (head_dim <= 64,
# head_dim 128), FLOPs counted as above: cuDNN's kernel from the FlashAttention-3 paper's
# comparisons (Shah et al., 2024); memory-efficient on H100 in the A100 figure's proportion to flash.
# sm100's cuDNN: cuDNN's SDPA benchmark on a GB200 (frontend 1.21.1, backend 9.22; b2, 64 q / 8 kv
# heads, head dimension 128, causal, sequence 4096): 1,408 forward, 1,148 backward of its 2,500 ->
# 0.56 and 0.46 at head dimension 128; 64 not measured, taken in sm90's proportion (0.50 / 0.60).
# Memory-efficient on sm100 in the sm90 proportion to flash (derived, as the sm90 entry is).
ATTENTION_FRACTION: dict[str, dict[tuple[str, str], tuple[float, float]]] = {
    "sm80": {("cudnn", "fwd"): (0.50, 0.60), ("cudnn", "bwd"): (0.40, 0.48)},
    "sm90": {("efficient", "fwd"): (0.17, 0.20), ("efficient", "bwd"): (0.13, 0.15),
             ("cudnn", "fwd"): (0.50, 0.60), ("cudnn", "bwd"): (0.40, 0.48)},
    "sm100": {("efficient", "fwd"): (0.17, 0.20), ("efficient", "bwd"): (0.13, 0.15),
              ("cudnn", "fwd"): (0.47, 0.56), ("cudnn", "bwd"): (0.38, 0.46)},
}
GEMM_TILE = (128, 128)  # cuBLAS's common bf16 output tile (CUTLASS's default for sm80/sm90 tensor ops)
SPLIT_K_MIN = 512  # a split-K slice keeps at least this much of K (CUTLASS's split-K heuristics)
# Host and launch costs. PyTorch's eager dispatch of one op, from Python through the dispatcher to
# cudaLaunchKernel, is several microseconds (PyTorch's own "overhead" measurements, and Horace
# He's "Making Deep Learning Go Brrrr"); a compiled graph launches its kernels from generated code.
HOST_OP_S = 6e-6
HOST_KERNEL_S = 3e-6
# An eager matrix multiply costs the host more than an elementwise op: cuBLAS picks its kernel and
# workspace per call. Back-to-back eager torch.mm calls at 1024^3, where the GPU kernel takes ~3 us,
# measured 12.2 us a call on an H100 SXM, 9.9 on an H100 PCIe and 12.6 on an H800 PCIe (zzc0721/
# torch-performance-test-data, issues 79, 95 and 112): the host's issue rate, whatever the GPU. The
# middle one. What Muon's eager Newton-Schulz (thousands of small GEMMs a step) is bound by.
HOST_GEMM_S = 12.2e-6
KERNEL_MIN_S = 2.5e-6  # the shortest a launched kernel takes on the GPU (launch latency, nsight traces)
# Collectives: nccl-tests on DGX A100 and DGX H100 report all-reduce bus bandwidth of about 80%
# of NVLink's one-direction rate; across nodes NCCL reaches about 90% of the NIC's line rate.
LINK_FRACTION = 0.80
NETWORK_FRACTION = 0.90
LATENCY_S = {"link": 15e-6, "network": 35e-6}  # per call: nccl-tests' small-message times in a node / over IB
RING_FACTOR = {"allreduce": 2.0, "all_reduce": 2.0, "allgather": 1.0, "all_gather": 1.0, "reduce_scatter": 1.0,
               "broadcast": 1.0, "alltoall": 1.0, "all_to_all": 1.0, "reduce": 1.0}
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var_mean", "_log_softmax", "_softmax",
                        "linalg_vector_norm", "nll_loss_forward", "nll_loss_backward", "embedding_dense_backward",
                        "cumsum", "_log_softmax_backward_data", "_softmax_backward_data", "native_layer_norm",
                        "native_layer_norm_backward", "logsumexp"})
KINDS = ("matmul", "attention", "memory", "optimizer", "launch_host", "exposed_comm")


# torch.compile's modes (``train.compile_mode``) as the prediction takes them: (CUDA graphs, what of
# the mode is not modelled). reduce-overhead and max-autotune capture each compiled graph as a CUDA
# graph (torch.compile's documentation; inductor's ``triton.cudagraphs``), replayed without a launch
# from the host per kernel: their kernels cost no host time. max-autotune also benchmarks Triton
# templates against cuBLAS for each matmul and keeps the fastest; no public measurement gives its
# gain at these shapes, so the matmuls stay at cuBLAS's measured rate, and the prediction says so.
COMPILE_MODES: dict[str, tuple[bool, str]] = {
    "default": (False, ""),
    "reduce-overhead": (True, ""),
    "max-autotune": (True, "its matmul autotuning is not modelled (cuBLAS's measured rate)"),
    "max-autotune-no-cudagraphs": (False, "its matmul autotuning is not modelled (cuBLAS's measured rate)"),
}


def compile_mode(mode: str) -> tuple[bool, str]:
    """``(cuda_graphs, not_modelled)`` of a ``train.compile_mode`` (:data:`COMPILE_MODES`)."""
    return COMPILE_MODES.get(mode, (False, f"compile mode {mode} is not modelled (priced as default)"))


class Unpredictable(ValueError):
    """The GPU lacks a constant the model needs: which one."""


@dataclass(frozen=True)
class Gpu:
    """The constants a prediction needs for one GPU and its links (see the module docstring)."""

    name: str
    peak: dict[str, float]  # FLOP/s, dense, by input dtype of a matmul
    sms: int
    hbm_bytes_s: float  # datasheet
    gemm_fraction: float
    arch: str  # sm80, sm90: which measured attention speeds apply
    link_bytes_s: float  # in a node, one direction, per GPU (nominal)
    network_bytes_s: float  # between nodes, per GPU (nominal)
    per_node: int = 8
    network_shared: bool = False  # one NIC for the node's GPUs (hardware.Link.shared), not one each
    derived: tuple[str, ...] = ()  # the constants taken from another part or architecture, and from which
    fp8_fraction: float | None = None  # of the fp8 peak a scaled matmul sustains; None: no fp8 rate
    fp8_derived: str = ""  # how fp8_fraction was derived ("" when measured on the part)

    @property
    def hbm(self) -> float:
        return self.hbm_bytes_s * HBM_FRACTION


def gpu(spec_name: str, link: str | None = None, network: str | None = None, per_node: int = 8) -> Gpu:
    """The constants of the hardware table's ``spec_name``; raises :class:`Unpredictable` naming
    the first one missing."""
    spec = hardware.find(spec_name)
    if spec is None:
        raise Unpredictable(f"{spec_name!r} is not in the hardware table")
    missing = [what for what, value in (("dense bf16 peak", spec.bf16), ("SM count", hardware.SMS.get(spec.name)),
                                        ("measured matmul ceiling (GEMM_FRACTION)", GEMM_FRACTION.get(spec.name)),
                                        ("published attention speeds for its architecture",
                                         ATTENTION_TFLOPS.get(_arch(spec.name)))) if value is None]
    if missing:
        raise Unpredictable(f"{spec.name} has no {missing[0]}: no step time is predicted for it")
    intra = hardware.find_link(link or hardware.default_link(spec))
    inter = hardware.find_network(network)  # None: hardware.DEFAULT_NETWORK, as plan and the dry run
    if intra is None or inter is None:
        raise Unpredictable(f"unknown link {link or network!r}")
    assert spec.bf16 is not None  # checked above
    derate = POWER_LIMITED_TFLOPS.get(spec.name, spec.bf16) / spec.bf16  # 1.0 unless run below its TDP
    tf32 = spec.tf32 if spec.tf32 is not None else spec.bf16 / 2
    arch = _arch(spec.name)
    derived = (*hardware.DERIVED.get(spec.name, ()), *([GEMM_DERIVED[spec.name]] if spec.name in GEMM_DERIVED else []),
               *([ATTENTION_DERIVED[arch]] if arch in ATTENTION_DERIVED else []),
               *(["tf32 rate: half the bf16 peak"] if spec.tf32 is None else []))
    peak = {"bfloat16": spec.bf16 * derate * 1e12, "float16": (spec.fp16 or spec.bf16) * derate * 1e12,
            "float32": tf32 * derate * 1e12}
    fp8, fp8_derived = None, ""
    if spec.fp8 is not None:
        peak.update({d: spec.fp8 * derate * 1e12 for d in FP8_DTYPES})
        fp8 = FP8_GEMM_FRACTION.get(spec.name)
        if fp8 is None:
            fp8 = GEMM_FRACTION[spec.name] * FP8_OVER_BF16
            fp8_derived = "fp8 matmul rate: its bf16 share x the H100's fp8 / bf16 ratio (no fp8 GEMM of it published)"
    return Gpu(spec.name, peak, hardware.SMS[spec.name], spec.bandwidth_tbs * 1e12,
               GEMM_FRACTION[spec.name], arch, intra.gb_per_s * 1e9,
               inter.gb_per_s * 1e9, per_node, inter.shared, derived, fp8, fp8_derived)


def _arch(name: str) -> str:
    major, minor = hardware.CAPABILITY.get(name, (0, 0))
    return f"sm{major}{minor}"


# --------------------------------------------------------------------------- one kernel

def matmul_s(g: Gpu, m: int, n: int, k: int, batch: int = 1, dtype: str = "bfloat16") -> float:
    """A matrix multiply (M x K by K x N, ``batch`` of them) on ``g``: its FLOPs at the achievable
    rate times the share of the SMs its tiles keep busy; never below its bytes' time."""
    flops = 2.0 * m * n * k * batch
    if dtype in FP8_DTYPES:  # a scaled matmul: fp8 inputs, bf16 output (torchao's float8 training)
        if g.fp8_fraction is None:
            raise Unpredictable(f"{g.name} has no fp8 matmul rate: its fp8 matmuls are not predicted")
        rate = g.peak[dtype] * g.fp8_fraction * tile_efficiency(g.sms, m, n, k, batch)
        moved = (m * k + k * n) * batch + 2 * m * n * batch
        return max(flops / rate, moved / g.hbm, KERNEL_MIN_S)
    rate = g.peak.get(dtype, g.peak["float32"]) * g.gemm_fraction * tile_efficiency(g.sms, m, n, k, batch)
    size = 2 if dtype in ("bfloat16", "float16") else 4
    moved = (m * k + k * n + m * n) * batch * size
    return max(flops / rate, moved / g.hbm, KERNEL_MIN_S)


def tile_efficiency(sms: int, m: int, n: int, k: int, batch: int = 1) -> float:
    """The share of the tensor cores a GEMM's grid of :data:`GEMM_TILE` output tiles keeps busy:
    padding of the edge tiles, times the last wave's emptiness; a grid smaller than the SMs is
    split along K (each slice at least :data:`SPLIT_K_MIN` deep)."""
    tm, tn = GEMM_TILE
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    padding = (m * n) / (tiles_m * tm * tiles_n * tn)
    tiles = tiles_m * tiles_n * batch
    if tiles < sms:
        tiles *= max(1, min(sms // tiles, k // SPLIT_K_MIN))
    waves = math.ceil(tiles / sms)
    return padding * tiles / (waves * sms)


def attention_s(g: Gpu, r: dict[str, Any]) -> float:
    """An SDPA kernel from its record (kernel, way, shapes, causality): its FLOPs (half when
    causal) at the speed measured for its kernel, head dimension (64 or 128: up to 64 uses the
    64 figures) and sequence length (between two measured lengths, log-linear; outside them,
    the nearest)."""
    hd = 64 if r["head_dim"] <= 64 else 128
    measured = ATTENTION_TFLOPS.get(g.arch, {}).get(r["kernel"], {}).get((bool(r["causal"]), hd))
    if measured is not None:
        fraction = _at_length(measured, r["k_len"]) / ATTENTION_FIGURE_PEAK[g.arch]
    else:
        fractions = ATTENTION_FRACTION.get(g.arch, {}).get((r["kernel"], r["way"]))
        if fractions is None:  # the math path is not one kernel: its bmm/softmax ops are in the trace
            raise Unpredictable(f"no measured speed for attention kernel {r['kernel']} {r['way']} on {g.name}")
        fraction = fractions[0] if hd == 64 else fractions[1]
    forward = 4.0 * r["batch"] * r["heads"] * r["q_len"] * r["k_len"] * r["head_dim"] * (0.5 if r["causal"] else 1.0)
    flops = forward * (2.5 if r["way"] == "bwd" else 1.0)
    return max(flops / (g.peak.get(r["dtype"], g.peak["bfloat16"]) * fraction), KERNEL_MIN_S)


def _at_length(speeds: tuple[float, ...], length: int) -> float:
    """``speeds`` (at :data:`ATTENTION_SEQS`) at sequence ``length``: log-linear between the two
    measured lengths around it, the nearest measured one outside them."""
    seqs = ATTENTION_SEQS
    if length <= seqs[0]:
        return speeds[0]
    if length >= seqs[-1]:
        return speeds[-1]
    i = next(j for j in range(1, len(seqs)) if seqs[j] >= length)
    f = math.log2(length / seqs[i - 1]) / math.log2(seqs[i] / seqs[i - 1])
    return speeds[i - 1] + f * (speeds[i] - speeds[i - 1])


def memory_s(g: Gpu, nbytes: float) -> float:
    return max(nbytes / g.hbm, KERNEL_MIN_S)


def collective_s(g: Gpu, op: str, nbytes: float, group: int, ranks: list[int] | None = None) -> float:
    """A ring collective of ``nbytes`` (the whole buffer) over ``group`` ranks; it crosses the
    network when its ``ranks`` (global) lie on more than one node of ``g.per_node`` GPUs -- without
    them, when the group is larger than a node. On a NIC the node's GPUs share, a collective with
    k of its ranks on a node runs beside the node's other per_node / k copies of it (HSDP's shard
    all-reduce, one rank a node: all 8 at once) and gets that share of the NIC."""
    if group <= 1:
        return 0.0
    base = op.rstrip("_").replace("_into_tensor", "").replace("_coalesced", "").replace("_base", "").lstrip("_")
    factor = next((f for name, f in RING_FACTOR.items() if base.startswith(name)), 1.0)
    nodes = len({r // g.per_node for r in ranks}) if ranks else -(-group // g.per_node)
    network = g.network_bytes_s * NETWORK_FRACTION / hardware.side_by_side(g.network_shared, g.per_node,
                                                                           -(-group // nodes))
    bus = min(g.link_bytes_s * LINK_FRACTION, network) if nodes > 1 else g.link_bytes_s * LINK_FRACTION
    return LATENCY_S["network" if nodes > 1 else "link"] + factor * (group - 1) / group * nbytes / bus


# --------------------------------------------------------------------------- the step

@dataclass
class Kernel:
    """One kernel as the simulation runs it: its kind for the breakdown, its time, its host cost."""

    kind: str  # matmul, attention, memory, optimizer, comm, sync
    seconds: float
    host_s: float
    reads: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    weight: float = 1.0  # DiLoCo's outer sync: once every inner_steps steps


def in_graph(r: dict[str, Any], compiled: bool) -> bool:
    """Whether the run launches record ``r`` from a compiled graph: as the trace marked it (its
    ``graph``: the compiled blocks or loss function, ``tune/kernels.py``); a record without the
    mark (an older trace) by ``compiled``, the whole forward and backward."""
    if "graph" in r:
        return bool(r["graph"])
    return compiled and r["phase"] in ("forward", "backward")


def kernels_of(records: list[dict[str, Any]], g: Gpu, compiled: bool, outer_every: int = 0,
               cuda_graphs: bool = False) -> list[Kernel]:
    """The records as kernels with their times; each run of elementwise records inside one
    compiled graph fused (:func:`fuse`); what runs eagerly (:func:`in_graph`) kernel by kernel.
    ``cuda_graphs``: the compiled graphs are replayed as CUDA graphs (:func:`compile_mode`), their
    kernels launched without host time."""
    launch = 0.0 if cuda_graphs else HOST_KERNEL_S
    out: list[Kernel] = []
    run: list[dict[str, Any]] = []
    last_read = {v: i for i, r in enumerate(records) for v, _ in r["reads"]}  # one pass, not one per region
    for i, r in enumerate(records):
        fusible = r["kind"] == "mem" and r["phase"] in ("forward", "backward") and in_graph(r, compiled)
        if fusible:
            run.append(r)
            continue
        if run:
            out += fuse(run, last_read, i, g, launch)
            run = []
        out.append(_kernel(r, g, outer_every, compiled, launch))
    if run:
        out += fuse(run, last_read, len(records), g, launch)
    return out


def _kernel(r: dict[str, Any], g: Gpu, outer_every: int, compiled: bool = False,
            launch: float = HOST_KERNEL_S) -> Kernel:
    reads, writes = [v for v, _ in r["reads"]], [v for v, _ in r["writes"]]
    if in_graph(r, compiled):  # a graph's code (or a CUDA graph) launches it
        host = launch
    elif r["kind"] == "mm":  # cuBLAS's dispatch, and the views dispatched before it
        host = HOST_GEMM_S + max(0, r["host"] - 1) * HOST_OP_S
    else:
        host = r["host"] * HOST_OP_S
    weight = 1.0 / outer_every if r["phase"] == "outer" and outer_every > 0 else 1.0
    if r["kind"] == "mm":
        kind = "optimizer" if r["phase"] in ("step", "outer") else "matmul"
        return Kernel(kind, matmul_s(g, r["m"], r["n"], r["k"], r["batch"], r["dtype"]), host, reads, writes, weight)
    if r["kind"] == "attn":
        return Kernel("attention", attention_s(g, r), host, reads, writes, weight)
    if r["kind"] == "coll":
        return Kernel("comm", collective_s(g, r["op"], r["bytes"], r["group"], r.get("ranks")), host, reads, writes,
                      weight)
    if r["kind"] == "sync":
        return Kernel("sync", 0.0, host, reads, writes, weight)
    nbytes = sum(n for _, n in r["reads"]) + sum(n for _, n in r["writes"])
    kind = "optimizer" if r["phase"] in ("step", "outer") else "memory"
    return Kernel(kind, memory_s(g, nbytes), host, reads, writes, weight)


def fuse(run: list[dict[str, Any]], last_read: dict[int, int], end: int, g: Gpu,
         launch: float = HOST_KERNEL_S) -> list[Kernel]:
    """Elementwise records ``run`` (ending before record ``end``; ``last_read``: the index of the
    last record that reads each value) as the fused kernels of one compiled region: a kernel per
    reduction in it (and one for the rest), together reading each value that comes from outside
    the region once and writing each value read after it (or never read again: a gradient, an
    updated buffer) once."""
    made = {v for r in run for v, _ in r["writes"]}
    later = {v for r in run for v, _ in r["writes"] if last_read.get(v, -1) >= end}
    read = {v: n for r in run for v, n in r["reads"] if v not in made}
    read_later = {v for r in run for v, _ in r["reads"]}
    written = {v: n for r in run for v, n in r["writes"] if v in later or v not in read_later}
    n_kernels = 1 + sum(1 for r in run if r["op"] in REDUCTIONS)
    nbytes = sum(read.values()) + sum(written.values())
    seconds = max(nbytes / g.hbm, n_kernels * KERNEL_MIN_S)
    return [Kernel("memory", seconds, n_kernels * launch, list(read), list(written))]


@dataclass
class Timeline:
    """The simulation's clocks: the host, the compute stream, the communication stream, and when
    each value a collective makes is ready; ``busy``/``waits``: seconds by kind."""

    host: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    ready: dict[int, float] = field(default_factory=dict)  # values a collective made: when
    made: dict[int, float] = field(default_factory=dict)  # values the compute stream made: when
    busy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    comm_total: float = 0.0

    def run(self, k: Kernel) -> None:
        self.host += k.host_s * k.weight
        if k.kind == "sync":  # the host waits for the GPU to reach this point
            self.host = max(self.host, self.compute, *(self.ready.get(v, 0.0) for v in k.reads))
            return
        deps = max((self.ready.get(v, 0.0) for v in k.reads), default=0.0)
        seconds = k.seconds * k.weight
        if k.kind == "comm":  # from when it is issued and what it sends exists
            made = max((self.made.get(v, 0.0) for v in k.reads), default=0.0)
            start = max(self.host, self.comm, deps, made)
            self.comm = start + seconds
            self.comm_total += seconds
            for v in k.writes:
                self.ready[v] = self.comm
            return
        start = max(self.compute, self.host, deps)
        if start > self.compute:  # the compute stream idles: for the host, or for a collective
            gap = start - self.compute
            self.busy["exposed_comm" if deps >= max(self.host, self.compute) else "launch_host"] += gap
        self.compute = start + seconds
        self.busy[k.kind] += seconds
        for v in k.writes:
            self.made[v] = self.compute
            self.ready.pop(v, None)

    def end(self, tail_host_s: float) -> float:
        """The step's time: every stream and the host done; the wait at the end attributed."""
        host = self.host + tail_host_s
        last = max(self.compute, self.comm, host)
        if last > self.compute:
            self.busy["exposed_comm" if self.comm >= host else "launch_host"] += last - self.compute
        return last


def predict(kernels: dict[str, Any], g: Gpu, compiled: bool, cuda_graphs: bool = False) -> dict[str, Any]:
    """The step's predicted time and throughput on ``g`` from the dry run's kernel list
    (``trace.kernels``: its records, the traced and the run's accumulation, micro-batch,
    sequence length, ranks). The traced first micro-batch stands for each extra one of the run.
    ``cuda_graphs``: the compiled graphs replay as CUDA graphs (:func:`compile_mode`)."""
    records = kernels["records"]
    traced, run_accum = kernels["traced_accum"], kernels["run_accum"]
    timeline = Timeline()
    by_micro: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_micro.setdefault(r["micro"], []).append(r)
    order = sorted(by_micro)
    sequence: list[int] = []
    for m in order:
        sequence += [m] * (1 + (run_accum - traced) if m == 1 and traced >= 1 and run_accum > traced else 1)
    for m in sequence:
        for k in kernels_of(by_micro[m], g, compiled, kernels.get("outer_every", 0), cuda_graphs):
            timeline.run(k)
    step_s = timeline.end(kernels.get("tail_host", 0) * HOST_OP_S)
    tokens = kernels["micro_batch"] * run_accum * kernels["seq_len"]
    breakdown = dict(timeline.busy)
    return {"predicted": True, "gpu": g.name, "step_s": step_s, "tokens_per_s_per_gpu": tokens / step_s,
            "tokens_per_s": tokens * kernels["world"] / step_s, "breakdown": breakdown,
            "comm_s": timeline.comm_total, "kernels": len(records)}
