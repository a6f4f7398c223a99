"""Typed run configuration: one dataclass per concern, presets, overrides, validation.

A run is described by a :class:`RunConfig` made of sections (``model``, ``data``,
``optim``, ``train``, ``eval``, ``tracking``, ``parallel``).  It is assembled in layers,
each overriding the last:

1. the dataclass defaults,
2. a named preset shipped in ``flopwise/presets/NAME.yaml`` (``--preset``),
3. a user YAML file (``--config run.yaml``),
4. ``section.key=value`` overrides from the command line.

Loading checks what one value can tell: unknown keys are errors with a did-you-mean,
values are coerced to the field's type, and a choice (a ``Literal`` field) must be one of
its values. What needs several fields is checked beside its dataclass (each section's
``problems()``); :func:`validate` gathers those and the checks across sections. All
problems are reported together by :class:`ConfigError` before anything is allocated.
Nothing here resolves an ``auto`` or otherwise changes a value: what a run does with
``auto`` is decided by the stage that knows the machine (the trainer, the planner).

Renamed keys still load (:data:`RENAMED_KEYS`), with a note in :attr:`RunConfig.notes`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import math
import numbers
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from flopwise.errors import FlopwiseError, shown
from flopwise.fsio import FileFormatError, read_text


class ConfigError(FlopwiseError, ValueError):
    """One or more configuration problems, each naming where it came from."""

    every_rank = True  # every rank of a torchrun job validates the same config: rank 0 says it once

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")

    def __reduce__(self):  # picklable with its problems: rank 0's refusal is re-raised on every rank
        return (type(self), (self.problems,))


# --------------------------------------------------------------------------- choices
# Each choice is a Literal: the loader refuses any other value (with a did-you-mean), and
# the planner and the trainer share these names (``flopwise plan --precision bf16`` is
# ``train.precision=bf16``).

Arch = Literal["llama", "qwen3", "qwen3_moe", "gpt2", "custom"]
Norm = Literal["rmsnorm", "layernorm"]
Mlp = Literal["swiglu", "gelu", "relu2"]
PosEmb = Literal["rope", "learned", "none"]
AttentionBackend = Literal["auto", "flash", "sdpa", "flex", "eager"]
Loader = Literal["epoch", "random"]
Schedule = Literal["cosine", "constant", "wsd"]
DecayShape = Literal["linear", "cosine", "sqrt"]
OptimizerName = Literal["adamw", "muon"]
Switch = Literal["auto", "true", "false"]  # auto lets the stage decide (optim.fused, tracking.tensorboard)
# bf16: autocast over fp32 master weights; bf16-pure: bf16 weights (fp32 master copy and
# AdamW state); fp16: autocast with a gradient scaler over fp32 weights; float32.
Precision = Literal["bf16", "bf16-pure", "fp16", "float32"]
PrecisionChoice = Literal["auto", Precision]
NonFinitePolicy = Literal["stop", "skip", "rollback"]
Compile = Literal["auto", "off", "model", "blocks"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
# none; full: every block recomputed in backward; selective: blocks 0, k, 2k, ...
# (k = train.activation_checkpointing_every); selective_op: every block keeps its matmul and
# attention outputs and recomputes the rest (norms, RoPE, activations) in backward
ActivationCheckpointing = Literal["none", "full", "selective", "selective_op"]
Loss = Literal["auto", "plain", "chunked", "fused"]
Fp8Recipe = Literal["tensorwise", "rowwise", "mxfp8"]  # torchao's float8 training recipes (train.fp8)
# Why a run whose schedule is fitted to train.max_hours ends (RunConfig.fits_to_time): run.json's
# result.stopped; for a run whose only limit is its time, that is its finish.
TIME_USED = "the time budget is used with the decay finished"
WandbMode = Literal["online", "offline"]
Strategy = Literal["single", "ddp", "zero1", "fsdp2", "hsdp", "diloco"]
StrategyChoice = Literal["auto", Strategy]
InnerStrategy = Literal["ddp", "fsdp2"]  # inside a DiLoCo worker group
OuterDtype = Literal["fp32", "bf16"]  # what DiLoCo's pseudo-gradients are all-reduced in
Backend = Literal["auto", "nccl", "gloo"]

ARCHS = typing.get_args(Arch)
NORMS = typing.get_args(Norm)
MLPS = typing.get_args(Mlp)
POS_EMBS = typing.get_args(PosEmb)
ATTENTION_BACKENDS = typing.get_args(AttentionBackend)
PRECISIONS = typing.get_args(Precision)
ACTIVATION_CHECKPOINTING = typing.get_args(ActivationCheckpointing)
STRATEGIES = typing.get_args(StrategyChoice)
TASKS = ("arc_easy", "arc_challenge", "openbookqa", "hellaswag", "piqa")
MAX_VAL_TOKENS = 1 << 27  # tokens of the validation windows, held at once as int64 (1 GiB)


def choices(tp: Any) -> tuple[str, ...]:
    """The values of a ``Literal`` type (nested Literals flattened), e.g. ``choices(Precision)``."""
    return tuple(typing.get_args(tp))


class _Problems(list):
    """Problems of one section, with the range checks every section uses."""

    def positive(self, name: str, value: float, allow_zero: bool = False) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # named once, by validate()
            return False
        ok = value >= 0 if allow_zero else value > 0
        if not ok:
            self.append(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
        return ok


def _choice_problems(obj: Any, section: str) -> list[str]:
    """Literal fields holding a value outside their choices (set in Python: loading refuses them)."""
    out = []
    for name, tp in _field_types(type(obj)).items():
        allowed = _literal_choices(tp)
        value = getattr(obj, name)
        if allowed is not None and value not in allowed and not (value is None and _is_optional(tp)):
            out.append(_choice_message(f"{section}.{name}", value, allowed))
    return out


def _choice_message(where: str, value: Any, allowed: tuple) -> str:
    return (f"{where} {shown(value)}{_did_you_mean(str(value).lower(), [str(a) for a in allowed])}: "
            f"choose {', '.join(str(a) for a in allowed)}")


def type_problem(value: Any, tp: Any) -> str | None:
    """Why ``value`` is no value of the annotated field type ``tp`` ("expected an integer, got
    '64'"), None when it is. Strict, where loading coerces: for a value that did not come
    through loading (set in Python, or mapped from another format such as a Hugging Face
    ``config.json``). An int is a number, a bool is neither; a ``Literal`` is left to the
    choice check."""
    if _is_optional(tp):
        if value is None:
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        ok, want = isinstance(value, bool), "true/false"
    elif tp is int:
        ok, want = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
    elif tp is float:
        ok, want = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
    elif tp is str:
        ok, want = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"expected {want}, got {shown(value)}"


# ModelConfig fields that must be > 0 (head_dim too, when set) and >= 0: the checks of one value.
MODEL_POSITIVE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len",
                  "rope_theta", "norm_eps", "init_std")
MODEL_NON_NEGATIVE = ("n_experts", "moe_top_k", "moe_ffn_hidden", "moe_aux_loss_coef", "moe_z_loss_coef")


def model_value_problems(values: dict[str, Any], label: Callable[[str], str] | None = None,
                         finite: bool = True) -> list[str]:
    """What is wrong with each of these :class:`ModelConfig` field values on its own -- its type,
    finiteness and sign -- each named by ``label(field)`` (default ``model.FIELD``). The part of
    :meth:`ModelConfig.problems` that needs one value; :mod:`flopwise.model.hf` runs it on a
    ``config.json``'s values (named by their Hugging Face keys) before ``transformers`` sees
    them. ``finite=False`` leaves inf/NaN to :func:`validate`, which names them once."""
    label = label or (lambda name: f"model.{name}")
    types_ = _field_types(ModelConfig)
    out = []
    for name, value in values.items():
        where = label(name)
        wrong = type_problem(value, types_[name])
        if wrong:
            out.append(f"{where}: {wrong}")
        elif value is None or isinstance(value, (bool, str)):
            continue
        elif isinstance(value, float) and not math.isfinite(value):
            if finite:
                out.append(f"{where} must be a finite number, got {value}")
        elif (name in MODEL_POSITIVE or name == "head_dim") and not value > 0:
            out.append(f"{where} must be > 0, got {value}")
        elif name in MODEL_NON_NEGATIVE and value < 0:
            out.append(f"{where} must be >= 0, got {value}")
    return out


# What each Hugging Face family fixes (``arch``); ``custom`` fixes nothing and has no
# Hugging Face equivalent. Any combination trains; ``flopwise export`` checks these
# (:func:`hf_mismatches`) so that a model is never exported as something it is not.
ARCH_REQUIRES: dict[str, dict[str, Any]] = {
    "llama": dict(norm="rmsnorm", mlp="swiglu", pos_emb="rope", qk_norm=False, n_experts=0),
    "qwen3": dict(norm="rmsnorm", mlp="swiglu", pos_emb="rope", qk_norm=True, mlp_bias=False, n_experts=0),
    "qwen3_moe": dict(norm="rmsnorm", mlp="swiglu", pos_emb="rope", qk_norm=True, mlp_bias=False),
    "gpt2": dict(norm="layernorm", norm_bias=True, mlp="gelu", pos_emb="learned", qk_norm=False,
                 attn_bias=True, mlp_bias=True, n_experts=0),
    "custom": {},
}


def hf_mismatches(m: "ModelConfig") -> list[str]:
    """Why ``m`` is not a model of the Hugging Face family ``m.arch`` names (empty: it is)."""
    if m.arch == "custom":
        return ["model.arch=custom has no Hugging Face equivalent"]
    if m.arch not in ARCH_REQUIRES:
        return [f"model.arch {shown(m.arch)} is not a known family"]

    def show(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    out = []
    for name, want in ARCH_REQUIRES[m.arch].items():
        have = getattr(m, name)
        if name == "n_experts":
            if have:
                out.append(f"model.arch={m.arch} is dense but model.n_experts={have}")
        elif have != want:
            out.append(f"model.arch={m.arch} needs model.{name}={show(want)}, got {show(have)}")
    if m.arch == "qwen3_moe" and not m.n_experts:
        out.append("model.arch=qwen3_moe needs model.n_experts > 0")
    if m.arch == "gpt2":
        if m.n_kv_heads != m.n_heads:
            out.append(f"model.arch=gpt2 has no grouped-query attention: model.n_kv_heads must equal "
                       f"model.n_heads ({m.n_heads}), got {m.n_kv_heads}")
        if m.resolved_head_dim * m.n_heads != m.d_model:
            out.append(f"model.arch=gpt2 needs head_dim x n_heads = d_model, got {m.resolved_head_dim} x {m.n_heads}")
    return out


@dataclass
class ModelConfig:
    """A decoder-only transformer: Llama, Qwen3, Qwen3-MoE and GPT-2 families, or a custom mix.

    ``arch`` names the Hugging Face family the components must match (see ARCH_REQUIRES)
    or ``custom`` for any combination (trainable, not exportable to transformers).
    """

    arch: Arch = "llama"
    vocab_size: int = 8192
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0 (1 = MQA, n_heads = MHA)
    head_dim: int | None = None  # default d_model // n_heads
    ffn_hidden: int = 384  # MLP hidden width (SwiGLU: of the gate and of the up projection)
    max_seq_len: int = 1024  # RoPE table / learned position table length; train.seq_len must not exceed it
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    norm: Norm = "rmsnorm"
    norm_bias: bool = False  # LayerNorm with a bias (GPT-2); RMSNorm has none
    mlp: Mlp = "swiglu"  # swiglu (fused gate+up) | gelu (tanh approximation, GPT-2) | relu2 (squared ReLU)
    pos_emb: PosEmb = "rope"  # rope | learned (absolute, GPT-2) | none
    attn_bias: bool = False  # biases on the q/k/v and output projections
    mlp_bias: bool = False  # biases on the MLP projections
    qk_norm: bool = False  # RMSNorm on per-head queries and keys (Qwen3)
    tie_embeddings: bool = True
    init_std: float = 0.02
    # Attention kernel: auto picks the best available for the device and dtype and says why.
    attention: AttentionBackend = "auto"
    attention_strict: bool = False  # fail instead of falling back when the requested backend is unavailable
    doc_mask: bool = False  # attend only within each document (the loader's EOS/BOS boundaries)
    # Mixture of experts (0 experts = a dense MLP): SwiGLU experts, top-k routing.
    n_experts: int = 0
    moe_top_k: int = 0  # experts active per token
    moe_ffn_hidden: int = 0  # each expert's SwiGLU hidden width (0 = ffn_hidden)
    moe_norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Qwen3-MoE)
    moe_aux_loss_coef: float = 0.01  # load-balancing auxiliary loss weight
    moe_z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE); 0 = off
    # A Hugging Face config.json (or its directory): the architecture fields above are taken
    # from it, and the weights from the safetensors beside it when there are any.
    hf_config: str = ""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of D x F in one dense MLP: 3 for SwiGLU (gate, up, down), else 2."""
        return 3 if self.mlp == "swiglu" else 2

    def problems(self) -> list[str]:
        """What is wrong with this section on its own (empty: nothing): each value's type and
        sign (:func:`model_value_problems`), then what involves several. Infinite and NaN
        numbers are named by :func:`validate` (and :func:`model_problems`)."""
        p = _Problems(_choice_problems(self, "model"))
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        p += model_value_problems(values, finite=False)
        if any(type_problem(v, tp) for v, tp in zip(values.values(), _field_types(ModelConfig).values())):
            return list(p)  # what follows computes with the values
        if self.is_moe and self.mlp != "swiglu":
            p.append(f"model.n_experts > 0: experts are SwiGLU, model.mlp must be swiglu, got {self.mlp}")
        if self.norm_bias and self.norm != "layernorm":
            p.append("model.norm_bias=true needs model.norm=layernorm (RMSNorm has no bias)")
        if self.n_heads > 0 and self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            p.append(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None and self.n_heads > 0 and self.d_model % self.n_heads:
            p.append(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}) "
                     "unless model.head_dim is set")
        if self.n_experts > 0 and not 1 <= self.moe_top_k <= self.n_experts:
            p.append(f"model.moe_top_k must be in [1, model.n_experts={self.n_experts}], got {self.moe_top_k}")
        elif self.n_experts == 0 and self.moe_top_k:
            p.append(f"model.moe_top_k={self.moe_top_k} needs model.n_experts > 0")
        hd = self.resolved_head_dim if self.n_heads > 0 else 0
        if self.pos_emb == "rope" and hd > 0 and hd % 2:
            p.append(f"head dimension {hd} must be even for rotary embeddings (model.head_dim / d_model / n_heads)")
        return list(p)


@dataclass
class DataConfig:
    # A directory written by ``flopwise prepare`` (tokenizer.json, meta.json, *.bin shards).
    # Empty: the embedded corpus (the Python standard library's source), prepared once
    # into ``cache_dir``.
    path: str = ""
    cache_dir: str = "~/.cache/flopwise"
    builtin_vocab_size: int = 8192  # BPE vocabulary trained for the embedded corpus
    builtin_max_mb: float = 0.0  # cap on the embedded corpus' source text (0 = all of it)
    # epoch: a shuffled pass over packed sequences, every token a target once per epoch, the
    # same samples per step on any number of ranks (resumes at another world size);
    # random: seeded random windows sampled with replacement (the nanoGPT way), per-rank streams.
    # The default since neither assembles batches measurably faster (docs/benchmarks.md#loader).
    loader: Loader = "epoch"
    prefetch: int = 0  # batches assembled ahead on a background thread (0 = off)
    pin_memory: bool = True  # CUDA: pinned host batches, copied asynchronously

    def problems(self) -> list[str]:
        p = _Problems(_choice_problems(self, "data"))
        p.positive("data.builtin_vocab_size", self.builtin_vocab_size)
        p.positive("data.builtin_max_mb", self.builtin_max_mb, allow_zero=True)
        if not 0 <= self.prefetch <= 8:
            p.append(f"data.prefetch must be in [0, 8], got {self.prefetch}")
        return list(p)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    schedule: Schedule = "cosine"  # cosine | constant | wsd (warmup-stable-decay), after warmup
    weight_decay: float = 0.1  # applied to 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    fused: Switch = "auto"  # auto (fused AdamW: on CUDA and CPU; it skips a bad step on the device) | true | false
    name: OptimizerName = "adamw"  # adamw | muon (Muon for 2-D hidden weights, AdamW for the rest)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    decay_fraction: float = 0.2  # schedule=wsd: the final fraction of the run spent decaying
    decay_shape: DecayShape = "linear"  # schedule=wsd: linear | cosine | sqrt
    # schedule=wsd or cosine with train.max_hours: the decay ends as the time budget does (always so for a
    # run whose only limit is train.max_hours: RunConfig.fits_to_time)
    fit_to_time: bool = False

    def problems(self) -> list[str]:
        p = _Problems(_choice_problems(self, "optim"))
        p.positive("optim.lr", self.lr)
        if not 0 <= self.min_lr_ratio <= 1:
            p.append(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        p.positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        p.positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        p.positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                p.append(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        p.positive("optim.eps", self.eps)
        if not 0 < self.decay_fraction <= 1:
            p.append(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        p.positive("optim.muon_lr", self.muon_lr)
        p.positive("optim.muon_weight_decay", self.muon_weight_decay, allow_zero=True)
        if not 0 <= self.muon_momentum < 1:
            p.append(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        return list(p)


@dataclass
class TrainConfig:
    run_dir: str = ""  # default: runs/<preset>-<timestamp>
    seq_len: int = 128
    micro_batch_size: int = 16
    global_batch_size: int = 32  # sequences per optimizer step (all micro-batches, all ranks)
    max_steps: int = 0  # 0 = no step limit (then max_tokens or max_hours must be set)
    max_tokens: int = 0  # 0 = no token limit; with several limits set, the first reached ends the run
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # CPU threads torch computes with (torch.set_num_threads); 0 = torch's own default
    # auto: bf16 on CUDA with bf16, fp16 on CUDA without (V100, T4), else float32;
    # bf16 (autocast, fp32 weights) | bf16-pure (bf16 weights) | fp16 (autocast + scaler) | float32
    precision: PrecisionChoice = "auto"
    log_every: int = 10
    checkpoint_every: int = 0  # steps between checkpoints (saves); 0 = only at the end (and on a stop)
    keep_checkpoints: int = 3  # the newest N complete checkpoints are kept; 0 = keep all
    milestone_every: int = 0  # checkpoints at multiples of this step are never deleted; 0 = none
    # the run's training-time budget, across its starts; stops in time with a final checkpoint. Alone (no
    # max_steps nor max_tokens) it is the run's length: as many steps as fit, the schedule fitted to the time
    max_hours: float = 0.0
    nonfinite: NonFinitePolicy = "stop"  # non-finite loss or gradients: stop | skip (the update) | rollback
    nonfinite_patience: int = 3  # skips or rollbacks in a row before the run stops anyway
    # Bounds over the whole run (kept in checkpoints, so they hold across resumes): a run that
    # keeps diverging stops with its diagnostics instead of skipping or rolling back forever.
    nonfinite_max_skips: int = 20  # skipped updates in the run
    nonfinite_max_rollbacks: int = 5  # rollbacks in the run
    nonfinite_max_rollbacks_per_checkpoint: int = 2  # rollbacks to one and the same checkpoint
    # A collapse: the gradient norm ~0 (exactly 0, or below 1e-6 with the loss at ln V, the
    # uniform prediction's) for this many steps in a row; handled as a non-finite step. 0 = off.
    collapse_steps: int = 5
    spike_factor: float = 3.0  # a loss above this x its running mean is logged as an event; 0 = off
    # Throughput (docs/training.md#throughput-switches): wrappers applied in a fixed order, checkpointing -> compile.
    # auto: model on CUDA (forward, LM head and loss in one graph), off on a CPU (compiling costs more
    # than it saves in a CPU-sized run) | off | model | blocks (each transformer block compiled on its own)
    compile: Compile = "auto"
    compile_mode: CompileMode = "default"  # default | reduce-overhead (CUDA graphs) | max-autotune
    # Activation checkpointing (recompute in backward), not the saving of checkpoints above:
    # none | full (every block) | selective (blocks 0, k, 2k, ... with k = activation_checkpointing_every)
    # | selective_op (every block, per op: matmul and attention outputs saved, the rest recomputed)
    activation_checkpointing: ActivationCheckpointing = "none"
    activation_checkpointing_every: int = 2  # selective: every k-th block is recomputed (was checkpoint_every_k)
    loss: Loss = "auto"  # auto | plain | chunked (LM head + loss in chunks, no full logits) | fused (kernel)
    loss_chunk_tokens: int = 1024  # rows per chunk of the chunked loss (docs/benchmarks.md#chunked-cross-entropy)
    fp8: bool = False  # float8 linear layers through torchao (Ada, Hopper or newer); never on by itself
    # train.fp8's scaling: tensorwise (one scale a tensor; under FSDP2 the weights are all-gathered in
    # fp8) | rowwise (a scale per row: closer to bf16's numbers, slower) | mxfp8 (a power-of-two scale
    # per 32 values, Blackwell sm100 only; all-gathers in bf16)
    fp8_recipe: Fp8Recipe = "tensorwise"
    batch_ramp_tokens: int = 0  # ramp gradient accumulation from batch_ramp_start to full over these tokens
    batch_ramp_start: int = 1  # accumulation steps at the start of the ramp
    profile: bool = False  # torch.profiler around profile_steps, TensorBoard traces in RUN/profile
    profile_wait: int = 5
    profile_warmup: int = 2
    profile_active: int = 3
    nvtx: bool = False  # NVTX ranges around data, forward/backward, optimizer (Nsight Systems)
    preflight: str = ""  # the preflight.json this configuration came from (copied into the run for the report)
    warmup_log_steps: int = 3  # first steps excluded from throughput averages
    peak_tflops: float = 0.0  # dense peak of one device for MFU; 0 = from the hardware table

    def problems(self) -> list[str]:
        p = _Problems(_choice_problems(self, "train"))
        for name in ("seq_len", "micro_batch_size", "global_batch_size", "log_every"):
            p.positive(f"train.{name}", getattr(self, name))
        for name in ("max_steps", "max_tokens", "checkpoint_every", "keep_checkpoints", "milestone_every",
                     "warmup_log_steps", "seed", "nonfinite_patience", "collapse_steps", "threads"):
            p.positive(f"train.{name}", getattr(self, name), allow_zero=True)
        for name in ("nonfinite_max_skips", "nonfinite_max_rollbacks", "nonfinite_max_rollbacks_per_checkpoint"):
            p.positive(f"train.{name}", getattr(self, name))  # a bound of 0 would forbid what the policy asks for
        p.positive("train.max_hours", self.max_hours, allow_zero=True)
        p.positive("train.spike_factor", self.spike_factor, allow_zero=True)
        p.positive("train.peak_tflops", self.peak_tflops, allow_zero=True)
        if self.micro_batch_size > 0:
            p += batch_split_problems(self, 1)
        if self.max_steps <= 0 and self.max_tokens <= 0 and self.max_hours <= 0:
            p.append("set train.max_steps, train.max_tokens or train.max_hours (all are 0): a run needs a length "
                     "or a time budget")
        for name in ("activation_checkpointing_every", "loss_chunk_tokens", "batch_ramp_start", "profile_active"):
            p.positive(f"train.{name}", getattr(self, name))
        for name in ("batch_ramp_tokens", "profile_wait", "profile_warmup"):
            p.positive(f"train.{name}", getattr(self, name), allow_zero=True)
        accum = self.global_batch_size // self.micro_batch_size if self.micro_batch_size > 0 else 0
        if self.batch_ramp_tokens and self.batch_ramp_start > accum > 0:
            p.append(f"train.batch_ramp_start ({self.batch_ramp_start}) exceeds the accumulation steps of the "
                     f"full batch ({accum})")
        if self.batch_ramp_tokens and self.max_tokens <= 0:
            p.append("train.batch_ramp_tokens needs train.max_tokens (steps vary in size during the ramp)")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            p.append(f"train.device {shown(self.device)}: choose auto, cpu, cuda or cuda:N")
        return list(p)


@dataclass
class EvalConfig:
    every: int = 50  # validation every N steps (and at the end); 0 = only at the end
    # The fixed held-out set, in windows of train.seq_len + 1 tokens: never a speed setting's
    # multiple (the micro-batch only batches its forwards), so runs at any micro-batch compare.
    windows: int = 128
    sample_tokens: int = 120  # length of the text sample written at the end (and at a stop); 0 = none
    sample_every: int = 500  # also a sample every N steps during training, into samples.txt; 0 = only at the end
    sample_prompt: str = ""  # "" = the first tokens of a validation document (in the corpus's language)
    temperature: float = 0.8
    top_k: int = 50
    # Multiple-choice tasks during training (comma-separated: arc_easy, arc_challenge,
    # openbookqa, hellaswag, piqa), every tasks_every steps (0 = only at the end).
    tasks: str = ""
    tasks_every: int = 0
    tasks_limit: int = 0  # first N examples of each task (0 = all)
    task_dir: str = ""  # a folder of TASK.jsonl / TASK.parquet files in the hub format; empty = the hub

    def problems(self) -> list[str]:
        p = _Problems(_choice_problems(self, "eval"))
        for name in ("every", "sample_tokens", "sample_every"):
            p.positive(f"eval.{name}", getattr(self, name), allow_zero=True)
        p.positive("eval.windows", self.windows)
        p.positive("eval.temperature", self.temperature, allow_zero=True)
        p.positive("eval.top_k", self.top_k, allow_zero=True)
        for name in ("tasks_every", "tasks_limit"):
            p.positive(f"eval.{name}", getattr(self, name), allow_zero=True)
        for task in (x.strip() for x in self.tasks.split(",") if x.strip()):
            if task not in TASKS:
                p.append(f"eval.tasks: unknown task {shown(task)}{_did_you_mean(task, list(TASKS))}; "
                         f"choose from {', '.join(TASKS)}")
        return list(p)


@dataclass
class TrackingConfig:
    tensorboard: Switch = "auto"  # auto (when the tensorboard package is installed) | true | false
    wandb: bool = False
    wandb_project: str = "flopwise"
    wandb_mode: WandbMode = "online"  # online | offline (sync later with `wandb sync`)
    grad_norms_every: int = 0  # per-layer gradient norms every N steps (0 = off; the global norm is every step)
    update_ratios: bool = False  # with grad_norms_every: also |update| / |weight| per layer

    def problems(self) -> list[str]:
        p = _Problems(_choice_problems(self, "tracking"))
        p.positive("tracking.grad_norms_every", self.grad_norms_every, allow_zero=True)
        return list(p)


@dataclass
class ParallelConfig:
    # Data parallelism across the processes `torchrun` starts (docs/distributed.md).
    # auto: single on one process; else DDP when weights, gradients and AdamW state fit each
    # GPU, ZeRO-1 when only the optimizer state does not, FSDP2 otherwise (the planner's
    # memory model decides, and the choice is explained at startup). hsdp: FSDP2 within a group of
    # group_size ranks (0: one node), replicas across groups (asked for by name, never by auto).
    strategy: StrategyChoice = "auto"  # auto | single | ddp | zero1 | fsdp2 | hsdp | diloco
    backend: Backend = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    bucket_mb: float = 25.0  # DDP (and ZeRO-1) gradient all-reduce bucket size
    reshard_after_forward: bool = True  # FSDP2: free gathered block weights after forward (re-gather in backward)
    timeout_min: float = 30.0  # a collective that waits longer than this fails the run instead of hanging
    # group_size: the ranks of one group (0: the ranks of one node). HSDP (strategy=hsdp) shards
    # within a group and all-reduces the shards' gradients across groups every step.
    # DiLoCo (strategy=diloco, docs/distributed.md#diloco): worker groups each train inner_steps
    # steps with their own optimizer, then all-reduce the pseudo-gradient (anchor - parameters)
    # across groups once and an outer Nesterov SGD steps the anchor. Inside a group ranks train
    # with inner_strategy.
    group_size: int = 0
    inner_strategy: InnerStrategy = "ddp"
    # The defaults are what held up at 20 tokens/parameter (benchmarks/diloco.py, docs/distributed.md#diloco):
    # the paper's momentum 0.9 overshot there (+19% against tuned ddp), 0.5 did best; H = 100
    # trailed H = 30 at DiLoCo's best inner rate (+5.6% against +3.0%).
    inner_steps: int = 30  # H: inner steps between outer syncs
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    outer_dtype: OuterDtype = "fp32"
    # Streaming DiLoCo: the model in `fragments` parts synced at staggered inner steps; a
    # fragment's all-reduce runs while the next `overlap_steps` inner steps compute
    fragments: int = 1
    overlap_steps: int = 0

    def problems(self) -> list[str]:
        p = _Problems(_choice_problems(self, "parallel"))
        p.positive("parallel.bucket_mb", self.bucket_mb)
        p.positive("parallel.timeout_min", self.timeout_min)
        p.positive("parallel.group_size", self.group_size, allow_zero=True)
        p.positive("parallel.inner_steps", self.inner_steps)
        p.positive("parallel.outer_lr", self.outer_lr)
        if not 0 <= self.outer_momentum < 1:
            p.append(f"parallel.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        p.positive("parallel.fragments", self.fragments)
        p.positive("parallel.overlap_steps", self.overlap_steps, allow_zero=True)
        if self.fragments > 0 and self.inner_steps > 0 and self.fragments > self.inner_steps:
            p.append(f"parallel.fragments={self.fragments} exceeds parallel.inner_steps={self.inner_steps}: "
                     "each fragment syncs at its own inner step of the H")
        if self.inner_steps > 0 and self.overlap_steps >= self.inner_steps:
            p.append(f"parallel.overlap_steps={self.overlap_steps} must be below parallel.inner_steps="
                     f"{self.inner_steps}: a fragment's all-reduce must land before its next sync")
        return list(p)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    preset: str = ""  # the preset this config started from, for naming and the record
    # What loading had to say (a renamed key, once each): for the command to print. Not part
    # of the configuration: not compared, not written.
    notes: list[str] = field(default_factory=list, compare=False, repr=False)

    # Derived quantities used across the trainer and the planner.
    def grad_accum_steps(self, world_size: int = 1) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * world_size)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len

    @property
    def time_only(self) -> bool:
        """Whether ``train.max_hours`` is the run's only limit (max_steps = max_tokens = 0): it
        trains as many steps as fit in the time, :meth:`total_steps` is 0 (not known before the
        run), and its schedule follows the share of the time spent (:attr:`fits_to_time`)."""
        t = self.train
        return t.max_hours > 0 and t.max_steps <= 0 and t.max_tokens <= 0

    @property
    def fits_to_time(self) -> bool:
        """Whether the learning-rate schedule follows the share of ``train.max_hours`` spent
        (``optim.fit_to_time``, or a run whose only limit is its time) instead of the steps."""
        return self.optim.fit_to_time or self.time_only

    def total_steps(self) -> int:
        """Optimizer steps planned: the first of max_steps and max_tokens to be reached; 0 for a
        run whose only limit is its time (:attr:`time_only`)."""
        limits = []
        if self.train.max_steps > 0:
            limits.append(self.train.max_steps)
        if self.train.max_tokens > 0:
            limits.append(-(-self.train.max_tokens // self.tokens_per_step))
        return min(limits) if limits else 0

    def limit_key(self) -> str:
        """The key of the limit :meth:`step_limit` describes (``train.max_steps``,
        ``train.max_tokens`` or, alone, ``train.max_hours``; "" when none is set)."""
        t = self.train
        if self.time_only:
            return "train.max_hours"
        by_tokens = -(-t.max_tokens // self.tokens_per_step) if t.max_tokens > 0 else 0
        if t.max_steps > 0 and (not by_tokens or t.max_steps <= by_tokens):
            return "train.max_steps"
        return "train.max_tokens" if by_tokens else ""

    def step_limit(self) -> str:
        """Which of ``train.max_steps`` and ``train.max_tokens`` sets :meth:`total_steps` (the one
        reached first; max_steps on a tie: :meth:`limit_key`), with what the other would allow when
        both are set: e.g. ``"train.max_steps (300 steps; train.max_tokens=3000000 would allow
        367)"``; for a run whose only limit is its time, ``"train.max_hours (0.5 h, the run's only
        limit)"``."""
        t, key = self.train, self.limit_key()
        by_tokens = -(-t.max_tokens // self.tokens_per_step) if t.max_tokens > 0 else 0
        if key == "train.max_hours":
            return f"train.max_hours ({t.max_hours:g} h, the run's only limit)"
        if key == "train.max_steps":
            other = f"; train.max_tokens={t.max_tokens} would allow {by_tokens:,}" if by_tokens else ""
            return f"train.max_steps ({t.max_steps:,} steps{other})"
        if key == "train.max_tokens":
            other = f"; train.max_steps={t.max_steps} would allow more" if t.max_steps else ""
            return f"train.max_tokens ({by_tokens:,} steps of {self.tokens_per_step:,} tokens{other})"
        return ""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("notes")
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def step_identity(cfg: RunConfig) -> dict[str, Any]:
    """What a traced or predicted step is a step of: the model (a digest of its section), the
    sequence length and the global batch. A prediction made for another of these is no prediction
    of this run's step (``virtual.json`` records it: :func:`identity_mismatch`)."""
    shape = repr(sorted(dataclasses.asdict(cfg.model).items())).encode()
    return {"model": hashlib.sha256(shape).hexdigest()[:16], "seq_len": cfg.train.seq_len,
            "global_batch": cfg.train.global_batch_size}


def identity_mismatch(recorded: Any, cfg: RunConfig) -> str:
    """How ``recorded`` (a :func:`step_identity`) differs from ``cfg``'s step, in words; empty when
    it is the same step."""
    if not isinstance(recorded, dict):
        return "it does not say which model and batch it predicted"
    mine = step_identity(cfg)
    names = {"model": "another model", "seq_len": "sequence length", "global_batch": "global batch"}
    diffs = [names[k] if k == "model" else f"{names[k]} {recorded.get(k)} (this run: {mine[k]})"
             for k in mine if recorded.get(k) != mine[k]]
    return ", ".join(diffs)


SECTIONS = ("model", "data", "optim", "train", "eval", "tracking", "parallel")
DEFAULT_PRESET = "tiny"


# --------------------------------------------------------------------------- presets

def preset_names() -> list[str]:
    root = resources.files("flopwise") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        hint = _did_you_mean(name, names)
        raise ConfigError([f"unknown preset {shown(name)}{hint}; available: {', '.join(names)}"])
    text = (resources.files("flopwise") / "presets" / f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


# --------------------------------------------------------------------------- building

def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key_hint(cfg: "RunConfig", section: str, key: str, own: list[str]) -> str:
    """The did-you-mean of an unknown ``section.key``: the same key in another section first
    (``train.lr`` -> ``optim.lr``), then a close key in its own section, then a close key in
    any section, named with it (``train.min_lr`` -> ``optim.min_lr_ratio``)."""
    others = [s for s in SECTIONS if s != section]
    exact = [f"{s}.{key}" for s in others if key in _field_types(type(getattr(cfg, s)))]
    if exact:
        return f" (did you mean {' or '.join(repr(x) for x in exact)}?)"
    hint = _did_you_mean(key, own)
    if hint:
        return hint
    qualified = {f"{s}.{k}": k for s in others for k in _field_types(type(getattr(cfg, s)))}
    where = [q for q, k in qualified.items() if k.startswith(key + "_")]  # train.min_lr -> optim.min_lr_ratio
    if not where:
        close = difflib.get_close_matches(key, list(qualified.values()), n=1, cutoff=0.75)
        where = [q for q, k in qualified.items() if close and k == close[0]]
    return f" (did you mean {' or '.join(repr(x) for x in where[:3])}?)" if where else ""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _literal_choices(tp: Any) -> tuple | None:
    """The allowed values of a ``Literal`` field (also ``Literal[...] | None``), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _literal_choices(inner[0]) if len(inner) == 1 else None
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


_BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def _coerce_choice(value: Any, allowed: tuple, where: str) -> str:
    """A choice from YAML or the command line. YAML reads a bare on/off/yes/no/true/false as a
    bool: it becomes the spelling the choices use (``train.compile: off`` is ``"off"``, and
    so is a quoted ``"false"``)."""
    if isinstance(value, str) and value not in allowed and value.lower() in _BOOL_WORDS:
        value = _BOOL_WORDS[value.lower()]
    if isinstance(value, bool):
        words = ("true", "on", "yes") if value else ("false", "off", "no")
        value = next((w for w in words if w in allowed), words[0])
    elif isinstance(value, (int, float)):
        value = str(value)
    elif not isinstance(value, str):
        raise ValueError(f"{where}: expected one of {', '.join(map(str, allowed))}, got {shown(value)}")
    if value not in allowed:
        raise ValueError(_choice_message(where, value, allowed))
    return value


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce ``value`` (from YAML or a command-line string) to the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(value, args[0], where)
    if origin is Literal:
        return _coerce_choice(value, typing.get_args(tp), where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{where}: expected true/false, got {shown(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected an integer, got {shown(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))  # accepts 1e6 and 1_000_000
            except ValueError:
                pass
            else:
                if f.is_integer():
                    return int(f)
        raise ValueError(f"{where}: expected an integer, got {shown(value)}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected a number, got {shown(value)}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ValueError(f"{where}: expected a number, got {shown(value)}")
        # YAML's .inf/.nan, "inf"/"nan" and overflowing literals (1e999) all parse as floats;
        # no field has a use for them (0 is the "off" of the fields that can be off).
        if not math.isfinite(number):
            raise ValueError(f"{where}: expected a finite number, got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, bool):  # YAML reads "true" as a bool; keep the word
            return "true" if value else "false"
        if isinstance(value, (dict, list)):
            raise ValueError(f"{where}: expected a string, got {shown(value)}")
        return "" if value is None else str(value)
    return value


class _Loading:
    """Problems and notes collected while one configuration is loaded; ``eval_batches``: a
    legacy ``eval.batches`` of the layer being applied (:func:`_settle_eval_batches`)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.eval_batches: tuple[int, str] | None = None  # (value, source)
        self.windows_from = ""  # the source that set eval.windows in the layer being applied

    def note(self, text: str) -> None:
        if text not in self.notes:  # once per load, however many layers use the old name
            self.notes.append(text)


def _apply_mapping(cfg: RunConfig, mapping: dict[str, Any], source: str, loading: _Loading) -> None:
    """Overlay a nested mapping ``{section: {key: value}}`` onto ``cfg``, collecting problems."""
    if not isinstance(mapping, dict):
        loading.problems.append(f"{source}: expected a mapping of sections, got {type(mapping).__name__}")
        return
    for section, values in mapping.items():
        if section == "preset":
            cfg.preset = str(values)
            continue
        if section not in SECTIONS:
            loading.problems.append(
                f"{source}: unknown section {shown(section)}{_did_you_mean(str(section), list(SECTIONS))}")
            continue
        if not isinstance(values, dict):
            loading.problems.append(f"{source}: section {shown(section)} must be a mapping, got {shown(values)}")
            continue
        for key, value in values.items():
            _set(cfg, section, str(key), value, source, loading)
    _settle_eval_batches(cfg, loading)


# Keys that were renamed: configs written by earlier versions (a run's config.yaml, a user's
# YAML, an override) still load, with a note naming the new key.
RENAMED_KEYS = {
    ("train", "save_every"): "checkpoint_every",
    ("train", "checkpoint_every_k"): "activation_checkpointing_every",
}


def _set(cfg: RunConfig, section: str, key: str, value: Any, source: str, loading: _Loading) -> None:
    if (section, key) == ("eval", "batches"):  # read with the layer's micro-batch: _settle_eval_batches
        try:
            loading.eval_batches = (_coerce(value, int, f"{source}: eval.batches"), source)
        except ValueError as e:
            loading.problems.append(str(e))
        return
    if (section, key) == ("eval", "windows"):
        loading.windows_from = source
    new = RENAMED_KEYS.get((section, key))
    if new is not None:
        loading.note(f"{section}.{key} is now {section}.{new}")
        key = new
    obj = getattr(cfg, section)
    types_ = _field_types(type(obj))
    if key not in types_:
        loading.problems.append(f"{source}: unknown key {section}.{key}{_key_hint(cfg, section, key, list(types_))}")
        return
    try:
        setattr(obj, key, _coerce(value, types_[key], f"{source}: {section}.{key}"))
    except ValueError as e:
        loading.problems.append(str(e))


def _settle_eval_batches(cfg: RunConfig, loading: _Loading) -> None:
    """A layer's legacy ``eval.batches`` (validation batches of ``train.micro_batch_size``
    windows, before ``eval.windows``) as the windows it meant: times the micro-batch of the
    same layer (the one written beside it, or the layers' below), so an old run's config.yaml
    keeps the set it validated on and a later micro-batch (an override, preflight's choice)
    no longer moves it. Mapped rather than refused: old runs resume, evaluate and report from
    their config.yaml unedited. With ``eval.windows`` in the same layer it is ambiguous."""
    legacy, windows_from = loading.eval_batches, loading.windows_from
    loading.eval_batches, loading.windows_from = None, ""
    if legacy is None:
        return
    batches, source = legacy
    if windows_from:
        loading.problems.append(f"{source}: eval.batches ({batches}) and eval.windows ({cfg.eval.windows}, "
                                f"{windows_from}) both set: keep eval.windows, the validation set in windows")
        return
    if batches <= 0:
        loading.problems.append(f"{source}: eval.batches must be > 0, got {batches} (it is now eval.windows)")
        return
    micro = cfg.train.micro_batch_size
    cfg.eval.windows = batches * micro
    loading.note(f"eval.batches ({batches}, {source}) is now eval.windows: {cfg.eval.windows} "
                 f"({batches} x train.micro_batch_size {micro} as written there); the validation set no longer "
                 "follows the micro-batch")


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"optim.lr=1e-3"`` -> ``("optim", "lr", 0.001)``; the value is read as YAML."""
    if "=" not in text:
        raise ConfigError([f"override {shown(text)}: expected section.key=value"])
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError([f"override {shown(text)}: expected section.key=value (e.g. optim.lr=1e-3)"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts[0], parts[1], value


def batch_split_problems(t: "TrainConfig", world_size: int) -> list[str]:
    """Why the global batch cannot be cut into micro-batches on ``world_size`` ranks (empty
    when it can): it must be micro x accumulation x ranks."""
    if t.global_batch_size % (t.micro_batch_size * world_size) == 0:
        return []
    if world_size == 1:
        return [f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({t.micro_batch_size})"]
    return [f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size}) x {world_size} ranks = {t.micro_batch_size * world_size}: the global batch is "
            "micro x accumulation x ranks"]


# Reads a Hugging Face config.json (or the directory holding one) and returns the
# ModelConfig it describes, raising ValueError naming the file: flopwise.model.hf.read_hf_config.
# It is handed to build_config by its caller, so that this module, the lowest layer, needs
# nothing from flopwise.model (and no torch).
HFConfigReader = Callable[[str], "ModelConfig"]


def build_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    read_hf_config: HFConfigReader | None = None,
) -> RunConfig:
    """Defaults <- preset <- YAML file <- overrides <- the Hugging Face architecture of
    ``model.hf_config`` (read with ``read_hf_config``); then validate. Raises ConfigError
    with every problem; what loading noted (renamed keys) is in ``notes`` of the result."""
    cfg = RunConfig()
    loading = _Loading()
    file_data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            file_data = read_yaml(path, f"config file {str(path)!r}") or {}
        except FileNotFoundError:
            raise ConfigError([f"config file {str(path)!r} does not exist"]) from None
        except IsADirectoryError:
            raise ConfigError([f"config file {str(path)!r} is a directory"]) from None
        if not isinstance(file_data, dict):
            raise ConfigError([f"config file {str(path)!r}: expected a mapping of sections"])

    name = preset or file_data.get("preset") or DEFAULT_PRESET
    _apply_mapping(cfg, load_preset(str(name)), f"preset {name}", loading)
    cfg.preset = str(name)
    if file_data:
        _apply_mapping(cfg, file_data, str(config_file), loading)
        cfg.preset = str(name)
    # A run's own config.yaml: its directory is the run (the overrides below may still name another)
    own_run_dir, moved_note = run_dir_of_file(cfg, config_file)
    for text in overrides or []:
        try:
            section, key, value = parse_override(text)
        except ConfigError as e:
            loading.problems.extend(e.problems)
            continue
        if section not in SECTIONS:
            loading.problems.append(
                f"override {shown(text)}: unknown section {shown(section)}{_did_you_mean(section, list(SECTIONS))}"
            )
            continue
        _set(cfg, section, key, value, f"override {shown(text)}", loading)
    _settle_eval_batches(cfg, loading)  # the overrides are one layer
    if moved_note and cfg.train.run_dir == own_run_dir:
        loading.note(moved_note)

    problems = loading.problems
    if cfg.model.hf_config and not problems:
        problems += apply_hf_architecture(cfg.model, read_hf_config)
    problems += validate(cfg)
    if problems:
        raise ConfigError(problems)
    cfg.notes = loading.notes
    return cfg


# What ``flopwise train`` writes beside a run's config.yaml: a config.yaml next to one of them is
# a run's own. ``checkpoints`` is ``flopwise.checkpoints.CHECKPOINT_DIR`` (a layer above); it
# counts only holding a ``step-*`` entry, as another tool's checkpoints/ folder would not.
RUN_FILES = ("run.json", "metrics.jsonl")
CHECKPOINTS = "checkpoints"


def _holds_run(d: Path) -> bool:
    return any((d / name).is_file() for name in RUN_FILES) or any((d / CHECKPOINTS).glob("step-*"))


def run_directory(config_file: str | Path) -> Path | None:
    """The run directory whose ``config.yaml`` (or whose checkpoint's copy of it,
    ``RUN/checkpoints/step-N/config.yaml``) ``config_file`` is; None for any other file."""
    path = Path(config_file)
    if path.name != "config.yaml":
        return None
    candidates = [path.parent]
    if path.parent.parent.name == CHECKPOINTS:  # RUN/checkpoints/step-N/config.yaml
        candidates.append(path.parent.parent.parent)
    return next((d for d in candidates if _holds_run(d)), None)


def run_dir_of_file(cfg: RunConfig, config_file: str | Path | None) -> tuple[str, str]:
    """Point ``cfg.train.run_dir`` at the run directory ``config_file`` sits in, when it is a
    run's own config.yaml: a copied or moved run is trained where it is now, never at the path
    its config recorded (that run would get the copy's edits, or a moved run would start
    again at step 0 at its old place). Returns the directory set ("" when none) and a note
    when the recorded one differed."""
    run_dir = run_directory(config_file) if config_file is not None else None
    if run_dir is None:
        return "", ""
    recorded, here = cfg.train.run_dir, str(run_dir.resolve())
    cfg.train.run_dir = here
    if recorded and Path(recorded).expanduser().resolve() != Path(here):
        return here, (f"{config_file} records train.run_dir {recorded}; this run is at {here} (copied or moved): "
                      f"using {here}")
    return here, ""


# Fields a Hugging Face config.json decides (``model.hf_config``); the rest stay the run's.
HF_ARCHITECTURE_FIELDS = (
    "arch", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "max_seq_len",
    "rope_theta", "norm_eps", "norm", "norm_bias", "mlp", "pos_emb", "attn_bias", "mlp_bias", "qk_norm",
    "tie_embeddings", "n_experts", "moe_top_k", "moe_ffn_hidden", "moe_norm_topk_prob",
)


def apply_hf_architecture(m: ModelConfig, read_hf_config: HFConfigReader | None) -> list[str]:
    """Overwrite ``m``'s architecture (:data:`HF_ARCHITECTURE_FIELDS`) with that of the
    Hugging Face config at ``m.hf_config``, read by ``read_hf_config``; the problems (empty
    when it worked). A step of building a configuration, never of checking one."""
    if read_hf_config is None:
        return [f"model.hf_config {shown(m.hf_config)}: this configuration was built without a Hugging Face "
                "config reader (pass read_hf_config=flopwise.model.hf.read_hf_config to build_config)"]
    try:
        hf = read_hf_config(m.hf_config)
    except (ValueError, TypeError) as e:
        return [f"model.hf_config {shown(m.hf_config)}: {e}"]
    for name in HF_ARCHITECTURE_FIELDS:
        setattr(m, name, getattr(hf, name))
    return []


MAX_CONFIG_BYTES = 16 << 20  # a YAML config holds a few KB; a larger file is no config and is not read


def read_yaml(path: str | Path, label: str) -> Any:
    """The YAML document in the file at ``path`` (a ``--config`` file, a run's ``config.yaml``).
    What makes it no YAML config -- more than :data:`MAX_CONFIG_BYTES`, bytes that are not
    UTF-8 (their offset named), a syntax error (its line and column), nesting that exhausts
    the parser -- is a :class:`ConfigError` of one line starting with ``label``; a missing
    or unreadable file is the ``OSError`` ``open`` raises."""
    try:
        data = yaml.safe_load(read_text(path, MAX_CONFIG_BYTES))
        if _expands_past(data, MAX_CONFIG_VALUES):
            raise ConfigError([f"{label}: its aliases expand to more than {MAX_CONFIG_VALUES:,} values "
                               "(a YAML alias bomb?): write the values out"])
        return data
    except FileFormatError as e:
        raise ConfigError([f"{label}: {e.reason}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{label}: not valid YAML: {_yaml_problem(e)}"]) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError([f"{label}: not valid YAML: nested too deeply to read"]) from None


MAX_CONFIG_VALUES = 100_000  # values a config document may hold once its aliases are expanded


def _expands_past(data: Any, limit: int) -> bool:
    """Whether ``data``, with every shared (aliased) value counted each time it is referred to,
    holds more than ``limit`` values. A few hundred bytes of nested aliases expand to billions:
    anything that walks or prints the document would not end. Stops counting at ``limit``."""
    seen, stack = 0, [data]
    while stack:
        item = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A PyYAML error in one line: where (line and column, 1-based) and what."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if not problem:
        text = str(e).strip()
        return text.splitlines()[0] if text else type(e).__name__
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


# The last line of a run's config.yaml as flopwise wrote it before the run's manifest.json
# (``manifest.seal_run_files``) held the checksums of a run's files: still read, never written.
CHECKSUM_MARK = "# flopwise sha256 of the lines above: "


def checksum_problem(path: str | Path) -> str:
    """"" when the file at ``path`` ends in the checksum line (:data:`CHECKSUM_MARK`) of a run
    recorded before the run's manifest and matches it (or holds none: a file from before
    checksums, or one a user wrote); else what is wrong."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    body, mark, digest = text.rpartition(CHECKSUM_MARK)
    if not mark:
        return ""
    if hashlib.sha256(body.encode()).hexdigest() != digest.strip():
        return "changed since the run wrote it (its checksum does not match)"
    return ""


def load_run_config(path: str | Path) -> RunConfig:
    """Read a resolved ``config.yaml`` (as written into a run directory) back. An empty or
    cut file is an error naming it, never an all-defaults configuration. The architecture is
    the one written there (``model.hf_config`` was applied when the run was configured)."""
    data = read_yaml(path, str(path))
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError([f"{path}: not a resolved run configuration (no 'model' section)"])
    cfg = RunConfig()
    loading = _Loading()
    _apply_mapping(cfg, data, str(path), loading)
    problems = loading.problems + validate(cfg)
    if problems:
        raise ConfigError(problems)
    cfg.notes = loading.notes
    return cfg


# --------------------------------------------------------------------------- validation

def nonfinite_fields(cfg: RunConfig) -> dict[str, float]:
    """``{"section.name": value}`` for every float field of every section holding inf or NaN."""
    return {k: v for section in SECTIONS for k, v in _nonfinite(getattr(cfg, section), section).items()}


def _nonfinite(obj: Any, section: str) -> dict[str, float]:
    out = {}
    for name, tp in _field_types(type(obj)).items():
        value = getattr(obj, name)
        if tp is float and isinstance(value, float) and not math.isfinite(value):
            out[f"{section}.{name}"] = value
    return out


MAX_INT = 2**63 - 1  # torch, numpy and the OS take 64-bit signed integers: a larger one overflows in C


PATH_FIELDS = ("model.hf_config", "data.path", "data.cache_dir", "train.run_dir", "train.preflight", "eval.task_dir")
NAME_MAX = 255  # bytes in one path component on Linux, macOS and Windows filesystems


def recorded_paths(cfg: RunConfig, base: Path | None = None) -> tuple[RunConfig, dict[str, dict[str, str]]]:
    """``cfg`` as a run records it, and what changed: every relative path setting resolved
    against ``base`` (the working directory), so a run's ``config.yaml`` reads the same from
    any directory. ``{"section.key": {"typed": ..., "resolved": ...}}`` says what the user
    typed. A path starting with ``~`` stays as typed (each machine's home is its own), and
    ``model.hf_config`` only when it names a local directory (not a hub id)."""
    base = Path.cwd() if base is None else base
    out, changed = copy.deepcopy(cfg), {}
    for name in PATH_FIELDS:
        section, key = name.split(".")
        typed = getattr(getattr(cfg, section), key)
        if not typed or typed.startswith("~") or Path(typed).is_absolute():
            continue
        resolved = (base / typed).resolve()
        if name == "model.hf_config" and not resolved.is_dir():
            continue
        setattr(getattr(out, section), key, str(resolved))
        changed[name] = {"typed": typed, "resolved": str(resolved)}
    return out, changed


def path_problems(name: str, value: str) -> list[str]:
    """A path setting whose components the filesystem cannot name (past :data:`NAME_MAX` bytes,
    or holding a NUL byte): refused before any work, not as "File name too long" later."""
    if "\0" in value:
        return [f"{name} holds a NUL byte: {shown(value)}"]
    for part in value.replace("\\", "/").split("/"):
        if len(os.fsencode(part)) > NAME_MAX:
            return [f"{name}: the path component {shown(part, 60)} is {len(os.fsencode(part)):,} bytes; "
                    f"a filesystem names at most {NAME_MAX}"]
    return []


def oversized_ints(cfg: RunConfig) -> dict[str, int]:
    """``{"section.name": value}`` for every integer field of every section beyond :data:`MAX_INT`."""
    return {k: v for section in SECTIONS for k, v in _oversized(getattr(cfg, section), section).items()}


def _oversized(obj: Any, section: str) -> dict[str, int]:
    out = {}
    for name in _field_types(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            out[f"{section}.{name}"] = value
    return out


def model_problems(m: ModelConfig) -> list[str]:
    """Every problem of a model configuration on its own, as :func:`validate` finds it in a run's:
    infinite or NaN numbers, integers beyond 64 bits, then :meth:`ModelConfig.problems`. What
    a loader runs on a model it did not configure (a Hugging Face ``config.json``,
    :mod:`flopwise.model.hf`) before anything is allocated."""
    p = [f"{name} must be a finite number, got {value}" for name, value in _nonfinite(m, "model").items()]
    p += [f"{name} must be within ±(2^63 - 1), got {shown(value)}" for name, value in _oversized(m, "model").items()]
    return p + m.problems()


def validate(cfg: RunConfig) -> list[str]:
    """Every problem in the config, as readable strings naming the fields involved: inf/NaN
    set in Python (files and overrides refuse them when read), each section's own
    ``problems()``, then what involves two sections. Changes nothing."""
    p = [f"{name} must be a finite number, got {value}" for name, value in nonfinite_fields(cfg).items()]
    p += [f"{name} must be within ±(2^63 - 1), got {shown(value)}" for name, value in oversized_ints(cfg).items()]
    for name in PATH_FIELDS:
        section, key = name.split(".")
        p += path_problems(name, getattr(getattr(cfg, section), key))
    for section in SECTIONS:
        p += getattr(cfg, section).problems()
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
    if t.seq_len > m.max_seq_len > 0:
        p.append(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    if cfg.eval.windows * (t.seq_len + 1) > MAX_VAL_TOKENS:
        p.append(f"eval.windows ({cfg.eval.windows:,}) x train.seq_len + 1 ({t.seq_len + 1:,}) tokens: more than "
                 f"{MAX_VAL_TOKENS:,} held at once for validation; give fewer eval.windows")
    if o.fit_to_time and (o.schedule not in ("wsd", "cosine") or t.max_hours <= 0):
        p.append("optim.fit_to_time needs optim.schedule=wsd or cosine and train.max_hours > 0")
    if not d.path and d.builtin_vocab_size > m.vocab_size > 0:
        p.append(
            f"data.builtin_vocab_size ({d.builtin_vocab_size}) exceeds model.vocab_size "
            f"({m.vocab_size}): the embedding could not hold every token id"
        )
    return p
