"""Bytes per GPU of one training step, analytically from a ``ModelConfig``: "does micro-batch
64 x seq 512 fit in 80 GB, and with which settings?"

Pure Python (no torch import), so ``flopwise plan`` stays fast. Every number is in bytes;
:meth:`MemoryEstimate.gb` converts to GiB (1024**3 bytes) for printing and JSON.

What is counted (per GPU, at the peak of a training step)
---------------------------------------------------------
``total = params + grads + optimizer + master + buffers + weight_copies + fsdp_buffers
          + activations + logits + transient + overhead (+ outer under diloco)``

* **States** (:func:`state_bytes`; exact, checked tensor by tensor in the tests):

  =============  ======  ======  ==================  ==========  =========
  precision      params  grads   AdamW (m, v)        master      per param
  =============  ======  ======  ==================  ==========  =========
  ``float32``    4       4       4 + 4               --          16
  ``bf16``       4       4       4 + 4               --          16 (+2 autocast copies)
  ``fp16``       4       4       4 + 4               --          16 (+2 autocast copies)
  ``bf16-pure``  2       2       4 + 4 (fp32)        4 (fp32)    16  (``master_weights=True``)
  ``bf16-pure``  2       2       2 + 2 (bf16)        --          8   (``master_weights=False``)
  =============  ======  ======  ==================  ==========  =========

  The names are ``train.precision``'s. ``bf16`` is what ``flopwise train`` does on CUDA:
  fp32 parameters, gradients and AdamW state, bf16 autocast for the matmuls; ``fp16`` is
  the same with float16 autocast (and a gradient scaler, whose two scalars are not
  counted): 2-byte activations like ``bf16``, fp32 master weights. ``bf16-pure`` without
  master weights is what
  ``torch.optim.AdamW`` really allocates for bf16 parameters: ``exp_avg``/``exp_avg_sq``
  are ``zeros_like(param)``, i.e. bf16 (``optimizer_dtype="fp32"`` models an optimizer
  that keeps them in fp32 anyway). AdamW's per-tensor ``step`` counters (0-d float32
  tensors, 4 bytes per parameter *tensor*: ~0.5 KiB for a 32-layer model; a 512-byte
  allocator block each on CUDA) are counted by :func:`estimate`, which knows the number
  of tensors, and by :func:`state_bytes` only when ``n_tensors`` is given.

* **Autocast weight copies** (``weight_copies``, ``bf16`` and ``fp16``): autocast casts each
  fp32 weight to bf16 once per forward (its cast cache) and ``linear`` saves that bf16
  copy for backward, so 2 bytes per matmul weight (the LM head included, also when tied:
  the tied embedding is cast for the head matmul; the embedding *lookup* stays fp32)
  stay alive until backward. For SmolLM-360M that is 0.67 GiB.

* **Activations**: what autograd saves in the forward pass of *our* model
  (:mod:`flopwise.model`), derived tensor by tensor in :func:`layer_activation_terms`
  and measured in ``tests/unit/test_memory.py`` with ``saved_tensors_hooks``
  (exact to the byte on torch 2.13 CPU, fp32, pure bf16 and bf16 autocast, sdpa and
  math; the tests allow 2%). With ``activation_checkpointing="full"`` each
  block keeps only its input and, at the peak, one block is recomputed in backward:
  ``L * input + one block's activations``. With ``"selective"`` the R blocks 0, k, 2k, ...
  (k = ``activation_checkpointing_every``, R = ceil(L / k)) keep only their input and the
  others all their activations: ``(L - R) * block + R * input + one block's activations``;
  autocast weight copies are saved by the blocks that are not recomputed. With
  ``"selective_op"`` every block keeps its input and the outputs of its matmuls and attention
  kernel (:func:`selective_op_layer_terms`, exact against ``MemTracker`` on CPU) and, at the
  peak, one block's recomputed rest (:func:`_selective_op_recompute`).

* **Logits and loss** (``logits``): the (B, T, V) logits in the compute dtype (held by
  ``train/train_step.py`` until its backward ends), the float32 log-softmax that
  ``cross_entropy`` saves (``loss_sum`` upcasts with ``logits.float()``; the fp32 copy
  itself is not saved) and the int64 targets.

* **Transient** (``transient``): temporaries on top of everything saved, at the worst
  moment of backward (:func:`_transient`): usually the loss backward, where
  ``nll_loss`` backward's (B*T, V) float32 gradient and ``log_softmax`` backward's
  (B*T, V) float32 result coexist with the saved log-softmax (``8 * B*T*V`` bytes);
  for ``eager`` at long sequences it can be the last block's backward (two (B, H, T, T)
  float32 gradients). With checkpointing, the recomputed block and the loss
  temporaries are not added together. With ``loss="chunked"`` (what ``train`` takes on
  a GPU) the loss peaks in its forward, one chunk at a time, and at a large micro-batch
  the last block's MLP backward is the worst moment (:func:`_block_backward`); compiled,
  its gradients are counted unfused, as the dry run's trace holds them, so that ``flopwise
  plan`` and ``flopwise preflight --dry-run`` find the same largest micro-batch (within 0.1%
  of the traced peak for llama-style blocks and GPT-2's at 8 x H100, ddp, bf16).

* **Buffers** (``buffers``): the float32 RoPE tables, 2 x max_seq_len x hd x 4 bytes.

  Measured on CPU with ``MemTracker`` (every storage alive, forward + loss + backward +
  AdamW), ``total`` matches the real peak within 0.1% without checkpointing and
  overestimates it by 0-3% with it (tests allow 2% and 12%).

* **Assumptions that make this an upper bound**: gradients are counted as resident
  during the forward pass. That is exact with gradient accumulation (the gradients of
  earlier micro-batches exist) or ``zero_grad(set_to_none=False)``; with a single
  micro-batch and ``set_to_none=True`` the true peak is lower by up to ``grads``.
  With checkpointing the recomputed block's autocast weight copies are counted next to
  the loss temporaries (0-3% high in the tests). CUDA allocator rounding (512-byte
  blocks) is ignored.

* **Not counted** (``overhead_gb`` adds it if wanted): the CUDA context and library
  workspaces (~0.3-0.6 GiB, outside PyTorch's allocator), NCCL buffers, allocator
  fragmentation (``max_memory_reserved - max_memory_allocated``). The ``headroom``
  fraction of :func:`max_micro_batch` (default 0.9) is meant to cover them.

Strategies
----------
* ``single``/``ddp``: everything replicated. DDP is assumed to use
  ``gradient_as_bucket_view=True`` (gradients are views into the all-reduce buckets);
  with ``ddp_bucket_view=False`` DDP's buckets hold a second copy of the gradients.
* ``zero1``: AdamW state and the fp32 master copy divided by ``n_gpus``.
* ``fsdp2`` (one unit per block plus the root): parameters, gradients, optimizer
  state and master copy divided by ``n_gpus`` (rounded up), plus ``fsdp_buffers``: the
  all-gathered, unsharded parameters of two blocks in the compute dtype (the current
  one and the prefetched next), the root's unsharded embedding/final norm/head (the root
  is not resharded after forward) and the unsharded gradients of one block and of the
  root before their reduce-scatter (in the compute dtype). With ``bf16`` (or ``fp16``) a
  ``MixedPrecisionPolicy(param_dtype=bf16)`` is assumed: the gathered weights are
  already bf16 (no autocast copies) and the residual stream is bf16 as with ``bf16-pure``.
* ``hsdp`` (hybrid sharding: FSDP2 over a 2-D mesh): fsdp2 within a shard group of
  ``group_size`` ranks (the callers resolve the config's "0 = the ranks of one node"), each
  group a replica of the others -- everything above is fsdp2's at ``group_size`` GPUs, whatever
  the number of groups: the states divided by the group's ranks, not by ``n_gpus``, the same
  gather buffers, bf16 gathered weights and residual stream (:data:`SHARDED`).
* ``diloco`` (DiLoCo, Douillard et al. 2023): ranks train in worker groups of ``group_size``
  with ``inner_strategy`` (ddp or fsdp2, sharded over the group, not the world), so
  everything above is the inner strategy's over ``group_size`` ranks, plus the outer state
  (``outer``): the anchor (an fp32 copy of the parameters, 4 B/param) and the outer Nesterov
  momentum (fp32, 4 B/param), and what a sync needs beyond the step's freed activations and
  temporaries (the fp32 pseudo-gradient and its ``outer_dtype`` all-reduce buffer); divided by
  ``group_size`` under an fsdp2 inner strategy.

Activations in detail (per token, per block, sdpa)
--------------------------------------------------
With ``c`` = compute-dtype bytes (2 for bf16 / fp16, 4 for float32), ``r`` = residual-stream
bytes (4 for float32, bf16 and fp16 autocast -- the embedding output is fp32 and
``x + bf16`` promotes to fp32 -- 2 for bf16-pure), ``q = H*hd``, ``kv = KV*hd``, ``F`` =
SwiGLU width::

    2 norms      2 * (4*D + 4 + r*D + c*D)   fp32 input of rms_norm, fp32 rstd, normalised
                                             y (saved by the weight multiply), the linear's
                                             input (a bf16 cast copy under autocast)
    qkv          c * (q + 2*kv)              the fused projection output (v is a view of it)
    rope'd q, k  c * (q + kv)                saved by SDPA
    SDPA out     c * q                       also wo's input (flash kernels lay it out as
                                             (B, T, H, hd): the reshape is a view)
    logsumexp    4 * H                       float32
    QK-norm      (H+KV) * (4 + c*hd [+ 4*hd if c != 4])   rstd, normalised y, fp32 copy
    SwiGLU       c * 4F                      gate|up (2F, saved by silu; up is a view),
                                             silu(gate) (F), the product (F, w_down's input)

``eager`` is SDPA's MATH backend (the materialised-scores fallback): it saves the scaled
q, the (GQA-expanded) k and v, each ``4 * q`` (math upcasts bf16 to fp32), the softmax
output ``4 * H * T`` per token (the (B, H, T, T) float32 probabilities -- the pre-softmax
scores are not saved, only transient) and wo's input, a ``c * q`` copy; qkv, the
rope'd q/k and the logsumexp are not saved then. Plus per layer, independent of B, the
bf16 copies of the RoPE tables (4 x T x hd) when RoPE runs in bf16. Outside the blocks:
the int64 token ids (8 per token), the final norm (as above), and ``logits``.

Mixture of experts (analytical only: the trainer's MoE layer does not exist yet):
per token the router logits (E, compute dtype) and fp32 probabilities (E), the top-k
indices (int64) and weights (fp32), and for each of the top_k experts its gathered
input (c*D) and SwiGLU activations (c * 4 * F_expert).

CPU vs CUDA: the tests measure on CPU (float32, and bf16 autocast). CUDA's flash /
memory-efficient / cuDNN kernels save the same q, k, v, out and a float32 logsumexp
(memory-efficient attention pads it to a multiple of 32 positions); the
``benchmarks/memory_model.py`` script checks the total against
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

from flopwise.config import ACTIVATION_CHECKPOINTING, PRECISIONS, AttentionBackend, ModelConfig, Strategy, choices
from flopwise.plan.flops import checkpointed_blocks, param_counts

GIB = 1024**3

# The names are train's (``train.precision``, ``train.activation_checkpointing``,
# ``parallel.strategy``): one vocabulary for planning and training.
# model.attention's names: every backend but eager (S×S scores) holds no scores (flash,
# memory-efficient SDPA, flex), so the memory model tells eager from the rest.
ATTENTIONS = choices(AttentionBackend)
CHECKPOINTING = ACTIVATION_CHECKPOINTING
STRATEGIES = choices(Strategy)
SHARDED = ("fsdp2", "hsdp")  # fully_shard the model: sharded states, bf16-gathered weights, gather buffers
INNER_STRATEGIES = ("ddp", "fsdp2")  # parallel.inner_strategy: inside a DiLoCo worker group
OUTER_BYTES = {"fp32": 4, "bf16": 2}  # parallel.outer_dtype: DiLoCo's pseudo-gradient, bytes per parameter
AUTOCAST = ("bf16", "fp16")  # fp32 weights, 2-byte matmuls

# The planner's names before they were train's, still accepted (with a note). The planner's
# old "bf16" meant pure bf16 weights; it now means bf16 autocast, as in train.precision.
OLD_NAMES = {
    "precision": {"bf16-amp": "bf16", "fp32": "float32"},
    "strategy": {"fsdp": "fsdp2"},
}


def current_name(kind: str, value: str, flag: str = "") -> tuple[str, str]:
    """``(name, note)``: the current name of a ``precision`` or ``strategy`` value and, when
    ``value`` is an old one, the one-line note that says so (``flag`` names where it was
    given, e.g. ``--precision``); else ``(value, "")``."""
    new = OLD_NAMES[kind].get(value)
    if new is None:
        return value, ""
    where = f"{flag} {value}" if flag else f"{kind} {value!r}"
    return new, f"{where} is now called {new}"


@dataclass
class MemorySettings:
    precision: str = "bf16"  # bf16 | bf16-pure | fp16 | float32, as train.precision (module docstring's table)
    master_weights: bool = True  # "bf16-pure" only: an fp32 master copy (and fp32 AdamW state)
    attention: str = "sdpa"  # sdpa (flash/efficient: O(T) saved per head) | eager (SDPA math: (T x T) probs)
    # none | full (each block's input; one block recomputed) | selective (blocks 0, k, 2k, ...)
    # | selective_op (each block's input, matmul and attention outputs; one block's rest recomputed)
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2  # selective: k
    strategy: str = "single"  # single | ddp | zero1 | fsdp2 | hsdp | diloco, as parallel.strategy
    n_gpus: int = 1
    optimizer_dtype: str = "auto"  # AdamW m/v: auto (fp32, or the param dtype for bf16 w/o master) | fp32 | bf16
    ddp_bucket_view: bool = True  # DDP gradient_as_bucket_view=True; False: buckets copy the grads
    overhead_gb: float = 0.0  # fixed GiB outside the allocator (CUDA context ~0.5); headroom covers it by default
    loss: str = "plain"  # plain (full logits) | chunked (train.loss=chunked: one chunk of logits at a time)
    loss_chunk_tokens: int = 1024
    # micro-batches per step on each GPU. Under fsdp2 the earlier ones' gradients stay unsharded
    # (set_requires_gradient_sync(False)) and are accumulated in the reduce dtype, fp32, until the
    # last micro-batch reduce-scatters them: a whole unsharded fp32 copy at the peak.
    grad_accum: int = 1
    # train.compile is on (model or blocks): the saved activations are the min-cut partitioner's
    # (it recomputes cheap pointwise results in backward rather than keeping them), see
    # compiled_layer_terms; the temporaries are the partitioner's graph's, unfused (_block_backward).
    compiled: bool = False
    # train.compile=model: the plain loss is compiled in one graph with the model. Inductor's
    # cross-entropy then saves neither the logits nor the float32 log-softmax (recomputed in
    # backward, where 12 bytes a logit are live at the peak): the dry run traced tiny's step at
    # 3.00 GiB of temporaries and 0.63 GiB saved for 0.25 G logits, where eager's count is 14.
    loss_in_graph: bool = False
    # strategy "diloco" only (parallel.inner_strategy, group_size, outer_dtype): the strategy
    # inside a worker group, the group's ranks (0: all n_gpus; the callers resolve the config's
    # "0 = the ranks of one node"), and the dtype of the pseudo-gradient buffer. group_size is
    # also hsdp's: the ranks of a shard group (0 as above), the states are divided by them
    inner_strategy: str = "ddp"
    group_size: int = 0
    outer_dtype: str = "fp32"

    def __post_init__(self) -> None:
        # The planner's old names (bf16-amp, fp32, fsdp) are still accepted, with a warning.
        for kind in ("precision", "strategy"):
            new, note = current_name(kind, getattr(self, kind))
            if note:
                warnings.warn(f"MemorySettings {note}", FutureWarning, stacklevel=3)
                setattr(self, kind, new)

    @property
    def autocast(self) -> bool:
        """fp32 weights with 2-byte matmuls (bf16 or fp16 autocast)."""
        return self.precision in AUTOCAST

    def validate(self) -> None:
        problems = []
        for name, value, allowed in (("precision", self.precision, PRECISIONS),
                                     ("attention", self.attention, ATTENTIONS),
                                     ("activation_checkpointing", self.activation_checkpointing, CHECKPOINTING),
                                     ("strategy", self.strategy, STRATEGIES),
                                     ("optimizer_dtype", self.optimizer_dtype, ("auto", "fp32", "bf16")),
                                     ("loss", self.loss, ("plain", "chunked")),
                                     ("inner_strategy", self.inner_strategy, INNER_STRATEGIES),
                                     ("outer_dtype", self.outer_dtype, tuple(OUTER_BYTES))):
            if value not in allowed:
                problems.append(f"memory {name} {value!r}: choose {', '.join(allowed)}")
        if self.n_gpus < 1:
            problems.append(f"memory n_gpus must be >= 1, got {self.n_gpus}")
        if self.grad_accum < 1:
            problems.append(f"memory grad_accum must be >= 1, got {self.grad_accum}")
        if self.activation_checkpointing_every < 1:
            problems.append(f"memory activation_checkpointing_every must be >= 1, got "
                            f"{self.activation_checkpointing_every}")
        if self.overhead_gb < 0:
            problems.append(f"memory overhead_gb must be >= 0, got {self.overhead_gb}")
        if self.group_size < 0:
            problems.append(f"memory group_size must be >= 0, got {self.group_size}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def group_ranks(self) -> int:
        """Ranks of one DiLoCo worker group or HSDP shard group: ``group_size`` (0: all ``n_gpus``),
        at most ``n_gpus``."""
        return min(self.group_size or self.n_gpus, self.n_gpus)

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the model (fsdp2 over every GPU, hsdp within a group): bf16-gathered weights."""
        return self.strategy in SHARDED

    @property
    def shard_ranks(self) -> int:
        """The GPUs the states are sharded over: ``n_gpus`` under fsdp2, the shard group's ranks
        (:attr:`group_ranks`) under hsdp, 1 otherwise."""
        if self.strategy == "hsdp":
            return self.group_ranks
        return self.n_gpus if self.strategy == "fsdp2" else 1

    def inner(self) -> "MemorySettings":
        """The settings a rank trains with inside its DiLoCo group: the inner strategy over the
        group's ranks (``self`` for any other strategy)."""
        if self.strategy != "diloco":
            return self
        return replace(self, strategy=self.inner_strategy, n_gpus=self.group_ranks)

    def recomputed_blocks(self, n_layers: int) -> int:
        """Blocks recomputed in backward (each keeps only its input in forward); none under
        ``selective_op``, whose blocks keep their matmul outputs and recompute no matmul (the
        budget weighs HFU's recompute by this)."""
        if self.op_checkpointed:
            return 0
        return len(checkpointed_blocks(n_layers, self.activation_checkpointing, self.activation_checkpointing_every))

    @property
    def op_checkpointed(self) -> bool:
        """``selective_op``: every block keeps its matmul and attention outputs, recomputes the rest."""
        return self.activation_checkpointing == "selective_op"


@dataclass
class MemoryEstimate:
    """Bytes per GPU at the peak of one training step (see the module docstring)."""

    params: int
    grads: int
    optimizer: int
    master: int
    activations: int  # saved for backward inside embedding + blocks + final norm (+ one recomputed block)
    logits: int  # (B,T,V) logits in compute dtype + fp32 log-softmax + int64 targets
    total: int
    weight_copies: int = 0  # autocast's 2-byte copies of the matmul weights (bf16, fp16)
    buffers: int = 0  # the model's RoPE tables (float32 cos and sin, max_seq_len x hd each)
    fsdp_buffers: int = 0  # unsharded params of 2 blocks + root, unsharded grads of 1 block + root
    transient: int = 0  # loss-backward or block-backward temporaries at the peak
    overhead: int = 0  # MemorySettings.overhead_gb
    outer: int = 0  # diloco: anchor + outer momentum (fp32) + pseudo-gradient (outer_dtype)
    per_layer: int = 0  # activation bytes saved by one block (no checkpointing)
    per_layer_terms: dict[str, int] = field(default_factory=dict)  # that, tensor by tensor
    notes: list[str] = field(default_factory=list)

    TERMS = ("params", "grads", "optimizer", "master", "buffers", "weight_copies", "fsdp_buffers", "activations",
             "logits", "transient", "overhead", "total", "per_layer")

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer + self.master + self.outer

    @property
    def allocated(self) -> int:
        """What PyTorch's allocator should report at the peak: ``total`` less ``overhead``."""
        return self.total - self.overhead

    def gb(self) -> dict[str, float]:
        """Each term in GiB (1024**3 bytes), keyed like the fields; ``outer`` only under diloco."""
        out = {k: getattr(self, k) / GIB for k in self.TERMS}
        if self.outer:
            out["outer"] = self.outer / GIB
        return out


# --------------------------------------------------------------------------- dtypes

def residual_bytes(strategy: str, precision: str) -> int:
    """Bytes per element of the residual stream a step trains with -- the one rule the memory
    model and the strategy rankings share: 4 under float32 and under bf16 / fp16 autocast with
    fp32 weights (the embedding's output is fp32 and ``x + bf16`` promotes), 2 under bf16-pure,
    and 2 under FSDP2 (fsdp2, hsdp) with autocast precision, whose
    ``MixedPrecisionPolicy(param_dtype=bf16)`` gathers bf16 weights: the embedding's output, and so
    the whole stream, is bf16."""
    if precision in AUTOCAST:
        return 2 if strategy in SHARDED else 4
    return 4 if precision == "float32" else 2


def numerics_change(strategy: str, configured: str, precision: str) -> str:
    """Why training with ``strategy`` changes the numbers ``configured`` trains at ``precision``
    ("" when it does not): a residual stream of another dtype (:func:`residual_bytes`)."""
    mine, theirs = residual_bytes(strategy, precision), residual_bytes(configured, precision)
    if mine == theirs:
        return ""
    name = {4: "fp32", 2: "bf16"}
    return (f"changes numerics: a {name[mine]} residual stream where {configured} keeps it {name[theirs]} under "
            f"{precision}")


def _dtypes(s: MemorySettings) -> dict[str, int]:
    """Bytes per element of each kind of tensor under ``s``."""
    if s.precision == "float32":
        d = dict(param=4, grad=4, opt=4, master=0, compute=4, residual=4)
    elif s.autocast:  # bf16 / fp16 autocast over fp32 weights
        d = dict(param=4, grad=4, opt=4, master=0, compute=2, residual=residual_bytes(s.strategy, s.precision))
    else:  # bf16-pure: bf16 parameters
        d = dict(param=2, grad=2, opt=4 if s.master_weights else 2, master=4 if s.master_weights else 0,
                 compute=2, residual=2)
    if s.optimizer_dtype != "auto":
        d["opt"] = 4 if s.optimizer_dtype == "fp32" else 2
    return d


def _shard(n: int, k: int) -> int:
    return -(-n // k)


# --------------------------------------------------------------------------- states

def state_bytes(n_params: int, settings: MemorySettings, n_tensors: int = 0) -> dict[str, int]:
    """Parameter, gradient, AdamW and master-copy bytes per GPU for ``n_params`` parameters.

    Keys: ``params``, ``grads``, ``optimizer`` (exp_avg + exp_avg_sq, plus 4 bytes of
    ``step`` per tensor when ``n_tensors`` is given), ``master``. Sharding: ``zero1``
    divides optimizer and master by ``n_gpus``; ``fsdp2`` divides all four (rounded up), and
    ``hsdp`` divides them by its shard group's ranks, not by ``n_gpus``; but
    with ``grad_accum`` > 1 the gradients are a whole fp32 copy (accumulated unsharded: the
    dry run's trace of llama3.2-1b at 8 ranks holds 4.6 GiB of them, against 0.58 sharded);
    ``ddp`` with ``ddp_bucket_view=False`` doubles the gradients (bucket copies).
    ``diloco``: the inner strategy's over the group's ranks, plus ``outer``
    (:func:`outer_state_bytes`).
    """
    settings.validate()
    if settings.strategy == "diloco":
        return {**state_bytes(n_params, settings.inner(), n_tensors), "outer": outer_state_bytes(n_params, settings)}
    d = _dtypes(settings)
    n = int(n_params)
    params, grads = n * d["param"], n * d["grad"]
    optimizer, master = 2 * n * d["opt"], n * d["master"]
    steps = 4 * n_tensors  # AdamW's 0-d float32 `step` per parameter tensor (not sharded)
    k = settings.n_gpus
    if settings.strategy == "zero1":
        optimizer, master = _shard(optimizer, k), _shard(master, k)
    elif settings.sharded:
        k = settings.shard_ranks  # hsdp: a shard group's ranks (the groups are replicas)
        params, grads, optimizer, master = (_shard(x, k) for x in (params, grads, optimizer, master))
        if settings.grad_accum > 1 and k > 1:  # accumulated unsharded in fp32 until the step's last backward
            grads = 4 * n
    elif settings.strategy == "ddp" and not settings.ddp_bucket_view:
        grads *= 2
    return {"params": params, "grads": grads, "optimizer": optimizer + steps, "master": master}


def outer_state_bytes(n_params: int, settings: MemorySettings) -> int:
    """DiLoCo's outer state per rank, held for the whole run: the anchor (fp32 parameters, 4 B
    each) and the outer Nesterov momentum (fp32, 4 B), each divided by the group's ranks when
    the inner strategy is fsdp2; 0 for any other strategy."""
    if settings.strategy != "diloco":
        return 0
    return _outer(8 * int(n_params), settings)


def outer_sync_bytes(n_params: int, settings: MemorySettings) -> int:
    """What an outer sync allocates for its moment, after the step's activations are gone: the
    fp32 pseudo-gradient and its all-reduce buffer in ``outer_dtype`` (bf16: and the fp32 mean
    read back from it); divided by the group's ranks under fsdp2; 0 for any other strategy."""
    if settings.strategy != "diloco":
        return 0
    per_param = 4 + OUTER_BYTES[settings.outer_dtype] + (4 if settings.outer_dtype != "fp32" else 0)
    return _outer(per_param * int(n_params), settings)


def _outer(nbytes: int, settings: MemorySettings) -> int:
    return _shard(nbytes, settings.group_ranks) if settings.inner_strategy == "fsdp2" else nbytes


def n_param_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors of ``Transformer(cfg)`` (one AdamW ``step`` counter each)."""
    per_layer = 6 + (2 if cfg.qk_norm else 0)  # attn_norm, wqkv, wo, mlp_norm, w_gate_up|w_up, w_down (+ q/k norm)
    if cfg.is_moe:  # router + the experts' two 3-D tensors instead of the dense pair
        per_layer += 1
    per_layer += 2 * cfg.attn_bias + 2 * (cfg.mlp_bias and not cfg.is_moe)  # bias vectors
    norm_bias = cfg.norm == "layernorm" and cfg.norm_bias
    per_layer += 2 * norm_bias
    embeddings = 1 + (cfg.pos_emb == "learned")  # tok_emb (+ pos_emb)
    final_norm = 1 + norm_bias
    return embeddings + cfg.n_layers * per_layer + final_norm + (0 if cfg.tie_embeddings else 1)


# --------------------------------------------------------------------------- activations

def layer_activation_terms(cfg: ModelConfig, micro_batch: int, seq_len: int,
                           settings: MemorySettings) -> dict[str, int]:
    """Bytes autograd saves in one block's forward, tensor by tensor (no checkpointing)."""
    d = _dtypes(settings)
    c, r = d["compute"], d["residual"]
    B, T, D = micro_batch, seq_len, cfg.d_model
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    q, kv = H * hd, KV * hd
    N = B * T  # tokens
    # Each RMSNorm: rms_norm saves its float32 input (x itself when fp32, else x.float())
    # and the float32 rstd (B, T, 1); `weight * y` saves y (residual dtype); the next
    # linear saves its input (its own bf16 cast under autocast, else the norm's output).
    norm = N * (4 * D + 4 + r * D + c * D)
    if cfg.norm == "layernorm":  # saves its input, mean and rstd (float32), then the next linear's input
        norm = N * (4 * D + 8 + c * D)  # approximate: not yet checked against measurement like RMSNorm
    t: dict[str, int] = {"attn_norm": norm}
    if settings.attention == "sdpa":
        t["qkv"] = N * c * (q + 2 * kv)  # (B, T, (H+2KV)*hd): v, a view of it, is saved by SDPA
        t["q_k_rotated"] = N * c * (q + kv)  # RoPE outputs (B, H|KV, T, hd) saved by SDPA
        t["attn_out"] = N * c * q  # SDPA output (B, H, T, hd), also wo's input (a view)
        t["logsumexp"] = N * 4 * H  # SDPA's float32 (B, H, T)
    else:  # SDPA MATH backend: bf16 inputs upcast to fp32 (allow_fp16_bf16_reduction_math_sdp off)
        t["q_k_v_math"] = N * 4 * 3 * q  # scaled q, k, v expanded to H heads, fp32 (B*H, T, hd)
        t["probs"] = B * H * T * T * 4  # softmax output (B, H, T, T) float32
        t["attn_out"] = N * c * q  # wo's input: transpose(1, 2).reshape copy (B, T, H*hd)
        if cfg.qk_norm and c == 4:  # fp32 rms_norm saves q, k as views of qkv: the whole buffer
            t["qkv"] = N * c * (q + 2 * kv)
    if cfg.qk_norm:
        # per head: rstd (fp32), normalised y (compute dtype), and when q/k are bf16
        # the float32 copy rms_norm saves (in fp32 that copy is qkv itself).
        t["qk_norm"] = N * (H + KV) * (4 + c * hd + (4 * hd if c != 4 else 0))
    rope_in_bf16 = c != 4 and not (cfg.qk_norm and r == 4)  # amp + QK-norm: q, k are fp32 at RoPE
    if rope_in_bf16:
        t["rope_tables"] = 4 * T * hd * c  # cos/sin .to(bf16) for q and k, saved by the multiplies
    t["mlp_norm"] = norm
    if cfg.is_moe:
        E, k, Fe = cfg.n_experts, cfg.moe_top_k, cfg.expert_ffn_hidden
        t["router"] = N * (E * c + E * 4 + k * 8 + k * 4)  # logits, fp32 probs, top-k ids and weights
        t["experts"] = N * k * (c * D + c * 4 * Fe)  # each token's gathered input and SwiGLU per expert
    elif cfg.mlp == "swiglu":
        F = cfg.ffn_hidden
        t["swiglu"] = N * c * 4 * F  # gate|up (2F), silu(gate) (F), silu*up (F)
    else:  # gelu / relu2: the up projection's output and the activation's output
        t["mlp_act"] = N * c * 2 * cfg.ffn_hidden
    return t


def compiled_layer_terms(cfg: ModelConfig, micro_batch: int, seq_len: int,
                         settings: MemorySettings) -> dict[str, int]:
    """Bytes one dense block saves for backward when compiled (AOTAutograd's min-cut
    partitioner, the one inductor uses): the inputs of its matmuls in the compute dtype, the
    block's input, the norms' statistics and the attention kernel's own; norms, RoPE and
    activation functions are recomputed from them. Counted by storage, as the allocator holds
    them: ``v`` (and, without RoPE, ``q`` and ``k``) is a view of the fused projection's output,
    which it keeps whole; ``wo``'s input is a view of the attention output (the flash kernels lay
    it out as (B, T, H, hd)). Read off the partitioner's saved set in the dry run's trace: equal to
    the byte for smollm-135m's, smollm-360m's, smollm-1.7b's, llama3.2-1b's and gpt2-124m's blocks
    on torch 2.13 (``tests/integration/test_dryrun.py`` holds the two within 10%)."""
    d = _dtypes(settings)
    c, r = d["compute"], d["residual"]
    D, H, KV, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    q, kv = H * hd, KV * hd
    N = micro_batch * seq_len
    t = {
        "block_input": N * r * D,  # the residual stream entering the block: both norms recompute from it
        "norm_stats": 2 * N * (8 if cfg.norm == "layernorm" else 4),  # float32 rstd (and mean) of each norm
        "norm_outputs": 2 * N * c * D,  # the inputs of wqkv and of the MLP's first projection
        "qkv": N * c * (q + 2 * kv),  # the fused projection's output: v (and q, k without RoPE) views of it
        "attn_out": N * c * q,  # SDPA's output, saved for its backward; wo's input is a view of it
        "logsumexp": N * 4 * H,
        "attn_proj_out": N * c * D,  # wo's output: the residual sum in the MLP half is recomputed from it
    }
    if cfg.qk_norm:
        t["qk_norm_stats"] = N * (H + KV) * 4  # each head's float32 rstd
    if cfg.pos_emb == "rope":
        t["q_k_rotated"] = N * c * (q + kv)  # what SDPA saves: RoPE's outputs, new tensors
    if cfg.mlp == "swiglu":
        t["swiglu"] = N * c * 3 * cfg.ffn_hidden  # gate|up, and silu(gate) * up (w_down's input)
    else:
        t["mlp_act"] = N * c * 2 * cfg.ffn_hidden  # the up projection's output and the activation's
    return t


def selective_op_layer_terms(cfg: ModelConfig, micro_batch: int, seq_len: int,
                             settings: MemorySettings) -> dict[str, int]:
    """Bytes one block keeps from forward to backward under ``selective_op`` (``train/wrap.py``:
    ``selective_op_policy``): its input, held by the checkpoint to recompute from, and the cached
    outputs of its matmuls and attention kernel; norms, RoPE, activation functions and casts are
    recomputed. Eager, every matmul output is kept, the down projection's too (nobody reads it:
    the residual add saves nothing); compiled, the partitioner keeps only what backward reads, so
    not that one. Exact against ``MemTracker`` on CPU (``tests/unit/test_memory_selective_op.py``)."""
    d = _dtypes(settings)
    c, r = d["compute"], d["residual"]
    D, H, KV, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    q, kv = H * hd, KV * hd
    B, T = micro_batch, seq_len
    N = B * T
    t = {"block_input": N * r * D, "qkv": N * c * (q + 2 * kv)}
    if settings.attention == "sdpa":
        t["attn_out"] = N * c * q  # the kernel's output (B, H, T, hd) and float32 logsumexp (B, H, T)
        t["logsumexp"] = N * 4 * H
    else:  # SDPA's math backend: two bmm outputs, float32 (bf16 upcast): the scores and scores @ v
        t["scores"] = B * H * T * T * 4
        t["attn_out"] = N * 4 * q
    t["attn_proj_out"] = N * c * D  # wo's output: the MLP half's residual sum is recomputed from it
    if cfg.is_moe:
        E, k, Fe = cfg.n_experts, cfg.moe_top_k, cfg.expert_ffn_hidden
        t["router"] = N * c * E  # the router's logits
        t["experts"] = N * k * c * (2 * Fe + D)  # each token-slot's gate|up and down outputs (weighted after)
    else:
        t["mlp_up"] = N * c * (2 if cfg.mlp == "swiglu" else 1) * cfg.ffn_hidden  # gate|up, or up
        if not settings.compiled:
            t["mlp_down"] = N * c * D  # w_down's output, cached though backward does not read it
    return t


def _selective_op_recompute(cfg: ModelConfig, micro_batch: int, seq_len: int, settings: MemorySettings,
                            terms: dict[str, int]) -> int:
    """What one block's recompute adds during its backward under ``selective_op``: what it saves
    without checkpointing (``terms``, :func:`layer_activation_terms`) less what the cache already
    holds (the qkv projection, the attention kernel's outputs, the MLP's up projection)."""
    c = _dtypes(settings)["compute"]
    N = micro_batch * seq_len
    cached = terms.get("qkv", 0) + terms.get("logsumexp", 0)
    if settings.attention == "sdpa":
        cached += terms["attn_out"]
    if cfg.is_moe:
        cached += N * cfg.moe_top_k * c * 2 * cfg.expert_ffn_hidden
    elif cfg.mlp == "swiglu":
        cached += N * c * 2 * cfg.ffn_hidden  # gate|up of swiglu's 4F
    else:
        cached += N * c * cfg.ffn_hidden  # the up projection's output of mlp_act's 2F
    return max(sum(terms.values()) - cached, 0)


def _logits_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, settings: MemorySettings) -> int:
    c = _dtypes(settings)["compute"]
    N, V = micro_batch * seq_len, cfg.vocab_size
    if settings.loss == "plain" and settings.loss_in_graph:  # int64 targets, a float32 log-sum-exp a row
        return N * 8 + N * 4
    if settings.loss == "chunked":
        # model/loss.py with the gradients computed in the forward: the (N, D) input gradient
        # in the dtype of its input (the final norm's output: the residual stream's) and the
        # (V, D) float32 head gradient are held until backward, with the int64 targets; no
        # logits survive the forward.
        return N * cfg.d_model * _dtypes(settings)["residual"] + V * cfg.d_model * 4 + N * 8
    # logits (B, T, V) in compute dtype, held by the caller through backward;
    # float32 log-softmax saved by cross_entropy; int64 targets; the 0-d total_weight.
    return N * V * c + N * V * 4 + N * 8 + 4


def _chunked_loss_tmp(cfg: ModelConfig, N: int, settings: MemorySettings) -> int:
    """What ``train.loss=chunked`` (model/loss.py) holds during its forward beyond what it keeps:
    one chunk's float32 logits and, for a 2-byte compute dtype, their rounded copy; the head
    weight cast to the compute dtype (autocast's copy, here the loss's own) and the chunk's
    weight-gradient product in it; and its input, the final norm's output, alive until the
    loss returns."""
    d = _dtypes(settings)
    c, D, V = d["compute"], cfg.d_model, cfg.vocab_size
    chunk = min(settings.loss_chunk_tokens, N) * V * (4 + (c if c != 4 else 0))
    cast = V * D * c if settings.autocast and not settings.sharded else 0  # FSDP2 gathers it in bf16
    product = V * D * c if c != 4 else 0
    return chunk + cast + product + N * D * d["residual"]


def _block_backward(cfg: ModelConfig, N: int, settings: MemorySettings) -> tuple[int, int]:
    """``(temporaries, freed)`` at the worst moment of the last block's backward (its MLP's).

    Eager, the kernels' own: the largest gradient buffer, SwiGLU's (B, T, 2F) gate|up gradient
    (or the experts'), beside the residual stream's gradient, nothing of the block freed yet --
    within 1% of the peak MemTracker measures on CPU with the chunked loss. (The eager dry run
    traces silu's backward as its decomposition on fake tensors, eight (B, T, F) where a GPU runs
    one kernel: above this.)

    Compiled (``train.compile`` on a GPU), as the dry run's trace holds them, so that ``flopwise
    plan`` and ``flopwise preflight --dry-run`` find the same largest micro-batch: the
    partitioner's backward graph before inductor fuses it -- SwiGLU's three float32 (B, T, F)
    intermediates and the down projection's input gradient, GELU's six float32 ones -- the
    residual stream's gradient and the down projection's float32 weight gradient before it joins
    ``.grad``; against them, what that backward has freed of the block's saved tensors by then
    (the down projection's input; GELU's, also its other (B, T, F) input). Inductor fuses some
    of these: the figure, like the trace's, is an upper bound there. Squared ReLU, mixtures of
    experts and FSDP2's bf16 blocks keep the eager count."""
    d = _dtypes(settings)
    c, r = d["compute"], d["residual"]
    F, D = cfg.ffn_hidden, cfg.d_model
    traced = settings.compiled and cfg.mlp in ("swiglu", "gelu") and not settings.sharded
    if cfg.is_moe or not traced:
        width = 2 * cfg.moe_top_k * cfg.expert_ffn_hidden if cfg.is_moe else 2 * F
        return N * (c * width + r * D), 0
    if cfg.mlp == "swiglu":
        return N * (3 * 4 * F + c * F + r * D) + D * F * 4, N * c * F
    return N * (6 * 4 * F + r * D) + D * F * 4, 2 * N * c * F


def _transient(cfg: ModelConfig, B: int, T: int, settings: MemorySettings, terms: dict[str, int],
               final_norm: int, recomputed: int = 0) -> tuple[int, int, int]:
    """Temporaries on top of the saved tensors at the worst moment of the step.

    Returns ``(transient, loss_tmp, block_tmp)``. The loss backward allocates the
    (B*T, V) float32 gradient of ``nll_loss`` and then that of ``log_softmax`` while the
    saved log-softmax still exists: ``8 * B*T*V``; the chunked loss peaks in its forward
    (:func:`_chunked_loss_tmp`). By the time the last block's backward runs, the log-softmax
    (or the chunked loss's input gradient) and the final norm's tensors are freed; that block
    then holds the gradients of its MLP's backward (:func:`_block_backward`) -- or for
    ``eager`` attention the float32 gradients of the (B, H, T, T) probabilities and scores,
    while its MLP half is already freed. With the plain loss the loss usually dominates
    (measured on CPU with ``MemTracker`` in the tests); with the chunked loss, at a large
    micro-batch, the block does.
    """
    c, r = _dtypes(settings)["compute"], _dtypes(settings)["residual"]
    N, V = B * T, cfg.vocab_size
    loss_tmp = 8 * N * V
    chunked = settings.loss == "chunked"
    if chunked:
        loss_tmp = _chunked_loss_tmp(cfg, N, settings)
    in_graph = settings.loss == "plain" and settings.loss_in_graph
    if in_graph:  # compiled with the model: recomputed logits and their gradients (MemorySettings.loss_in_graph)
        loss_tmp = 12 * N * V
    block_freed = 0
    if settings.attention == "eager":
        block_tmp = 2 * B * cfg.n_heads * T * T * 4 - terms["mlp_norm"] - terms.get("swiglu", 0) \
            - terms.get("experts", 0)
    elif recomputed:  # the recomputed block's largest gradient buffer
        width = 2 * cfg.moe_top_k * cfg.expert_ffn_hidden if cfg.is_moe else 2 * cfg.ffn_hidden
        block_tmp = N * c * width
    else:
        block_tmp, block_freed = _block_backward(cfg, N, settings)
    # the log-softmax (plain) or the loss's input gradient (chunked), and the final norm
    freed = (4 * N * V if settings.loss == "plain" and not in_graph else 0) + final_norm \
        + (N * cfg.d_model * r if chunked else 0)
    if recomputed:
        # The recomputed block (``recomputed`` bytes, counted in `activations`) exists only during
        # its own backward, after the loss temporaries are gone: the worst moment is either.
        block_tmp = max(recomputed + block_tmp - freed, 0)
        return (max(loss_tmp, block_tmp) - recomputed if B else 0), loss_tmp, block_tmp
    block_tmp = max(block_tmp - freed - block_freed, 0)
    return (max(loss_tmp, block_tmp) if B else 0), loss_tmp, block_tmp


def _sharding(settings: MemorySettings) -> str:
    """How the states note says the states are spread over the GPUs ("" on one)."""
    if settings.n_gpus < 2:
        return ""
    hsdp = (f" (a shard group of {settings.shard_ranks}, replicated across {settings.n_gpus // settings.shard_ranks} "
            "groups)" if settings.strategy == "hsdp" else "")
    return f", sharded {settings.strategy} over {settings.n_gpus}{hsdp}"


def estimate(cfg: ModelConfig, micro_batch: int, seq_len: int, settings: MemorySettings) -> MemoryEstimate:
    """Bytes per GPU at the peak of a training step with ``micro_batch`` sequences of ``seq_len``."""
    settings.validate()
    if micro_batch < 0 or seq_len < 1:
        raise ValueError(f"micro_batch must be >= 0 and seq_len >= 1, got {micro_batch}, {seq_len}")
    if settings.strategy == "diloco":  # the inner strategy over the group, plus the outer state
        est = estimate(cfg, micro_batch, seq_len, settings.inner())
        n = param_counts(cfg)["total"]
        # the sync comes after the step, when its activations and temporaries are freed: it adds
        # to the peak only what it needs beyond them
        sync = max(0, outer_sync_bytes(n, settings) - (est.activations + est.logits + est.transient))
        outer = outer_state_bytes(n, settings) + sync
        note = (f"outer: diloco in groups of {settings.group_ranks} ({settings.inner_strategy} inside): anchor 4 B + "
                f"outer momentum 4 B per param, and at a sync the fp32 pseudo-gradient + its "
                f"{settings.outer_dtype} all-reduce buffer beyond the step's freed activations"
                + (f", sharded over {settings.group_ranks}" if settings.inner_strategy == "fsdp2" else ""))
        return replace(est, outer=outer, total=est.total + outer, notes=[*est.notes, note])
    d = _dtypes(settings)
    c, r = d["compute"], d["residual"]
    counts = param_counts(cfg)
    L, D, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
    B, T = micro_batch, seq_len
    N = B * T
    notes: list[str] = []

    st = state_bytes(counts["total"], settings, n_tensors=n_param_tensors(cfg))
    notes.append(f"states: {counts['total']:,} params; {settings.precision}: param {d['param']} B, grad "
                 f"{d['grad']} B, AdamW m+v 2x{d['opt']} B, master {d['master']} B per param{_sharding(settings)}")

    # Blocks recomputed in backward: they keep only their input in forward.
    R = settings.recomputed_blocks(L)
    kept = L - R

    # autocast's 2-byte copies of every matmul weight (all experts: any may be used by a batch)
    block_params = (counts["attention"] + counts["mlp"] + counts["norm"] - D) // L if L else 0
    block_matmul = (counts["attention"] + counts["mlp"]) // L if L else 0
    weight_copies = 0
    if settings.autocast and not settings.sharded:
        # the head's copy (tied: the cast embedding), those of the blocks that are not
        # recomputed, and one recomputed block's during its recompute: a checkpointed block
        # saves none, its cast cache dies with the autocast context of its forward
        # (selective_op: none saved, every block's casts are recomputed; one block's at the peak)
        cast_blocks = 1 if settings.op_checkpointed and L else kept + (1 if R else 0)
        # the chunked loss casts the head for itself, only during its forward (_chunked_loss_tmp)
        head = 0 if settings.loss == "chunked" else V * D
        weight_copies = 2 * (head + cast_blocks * block_matmul)
        notes.append(f"weight_copies: {settings.precision} autocast casts of the matmul weights, saved by linear "
                     "for backward")

    fsdp_buffers = 0
    if settings.sharded and settings.shard_ranks > 1:
        gather = 4 if settings.precision == "float32" else 2
        root = counts["embedding"] + counts["lm_head"] + D
        fsdp_buffers = (2 * block_params + root) * gather + (block_params + root) * gather
        notes.append("fsdp_buffers: unsharded params of 2 blocks (current + prefetch) and the root "
                     "(embedding/head/norm), unsharded grads of 1 block and the root before reduce-scatter")

    terms = layer_activation_terms(cfg, B, T, settings)
    per_layer = sum(terms.values())
    if settings.compiled and settings.attention == "sdpa" and not cfg.is_moe and not settings.op_checkpointed:
        # the partitioner's saved set, and each block's graph's own cast of RoPE's cos and sin tables
        per_layer = sum(compiled_layer_terms(cfg, B, T, settings).values()) \
            + (2 * T * cfg.resolved_head_dim * c if cfg.pos_emb == "rope" and c != 4 else 0)
        notes.append("activations: compiled, the min-cut partitioner's saved set (matmul inputs, the block's "
                     "input, SDPA's outputs); norms, RoPE and activation functions are recomputed in backward")
    ids = N * 8  # int64 token ids saved by the embedding
    # final norm: fp32 input, rstd, y and the head's input (cast); no input kept by the chunked loss
    final_norm = N * (4 * D + 4 + r * D + (0 if settings.loss == "chunked" else c * D))
    # a recomputed block keeps only its input (B, T, D); at the peak one block is recomputed
    recomputed = per_layer if R else 0
    activations = ids + kept * per_layer + R * N * D * r + final_norm + recomputed
    if settings.op_checkpointed and L:
        # every block keeps its input and its matmul and attention outputs; at the peak one block's
        # rest is recomputed (eager's count: inductor's fused recompute is not modelled apart)
        kept_terms = selective_op_layer_terms(cfg, B, T, settings)
        recomputed = _selective_op_recompute(cfg, B, T, settings, terms)
        activations = ids + L * sum(kept_terms.values()) + final_norm + recomputed
        notes.append("activations: selective_op keeps each block's input and its matmul and attention outputs "
                     f"({'compiled: ' if settings.compiled else ''}"
                     f"{', '.join(kept_terms)}); one block's norms, RoPE and activations are recomputed during "
                     "its backward (counted at the peak)")
    if R:
        k = settings.activation_checkpointing_every
        which = "each block" if R == L else f"{R} of {L} blocks (0, {k}, {2 * k}, ...)"
        notes.append(f"activations: checkpointing keeps only the input of {which}; one block's activations "
                     "are recomputed during its backward (counted at the peak)")
    logits = _logits_bytes(cfg, B, T, settings)
    transient, loss_tmp, block_tmp = _transient(cfg, B, T, settings, terms, final_norm, recomputed)
    notes.append("logits: (B,T,V) logits in compute dtype + fp32 log-softmax saved by cross_entropy; "
                 f"transient: max(loss backward {loss_tmp:,} B, one block's backward {block_tmp:,} B)")
    buffers = 2 * cfg.max_seq_len * cfg.resolved_head_dim * 4  # RoPE cos/sin tables, float32
    overhead = int(settings.overhead_gb * GIB)
    total = (sum(st.values()) + buffers + weight_copies + fsdp_buffers + activations + logits + transient + overhead)
    return MemoryEstimate(
        params=st["params"], grads=st["grads"], optimizer=st["optimizer"], master=st["master"],
        activations=activations, logits=logits, total=total, weight_copies=weight_copies,
        fsdp_buffers=fsdp_buffers, buffers=buffers, transient=transient, overhead=overhead, per_layer=per_layer,
        per_layer_terms=terms, notes=notes,
    )


def max_micro_batch(cfg: ModelConfig, seq_len: int, memory_bytes: int, settings: MemorySettings,
                    headroom: float = 0.9, limit: int = 4096) -> int:
    """Largest micro-batch (<= ``limit``) whose ``total`` is at most ``headroom * memory_bytes``;
    0 when not even 1 fits. Binary search: the total grows monotonically with the micro-batch."""
    budget = headroom * memory_bytes

    def fits(b: int) -> bool:
        return estimate(cfg, b, seq_len, settings).total <= budget

    if not fits(1):
        return 0
    lo, hi = 1, max(1, int(limit))
    if fits(hi):
        return hi
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


__all__ = ["GIB", "MemoryEstimate", "MemorySettings", "estimate", "layer_activation_terms", "max_micro_batch",
           "n_param_tensors", "outer_state_bytes", "outer_sync_bytes", "selective_op_layer_terms", "state_bytes"]
