"""Time, cost, Chinchilla sizing, batch geometry and multi-GPU scaling: the numbers of
``flopwise plan``, each with the inputs of its formula.

All quantities come from three single sources: :mod:`flopwise.plan.flops` (parameters,
FLOPs per token), :mod:`flopwise.plan.hardware` (dense peaks, memory, links) and
:mod:`flopwise.plan.memory` (bytes per GPU). This module only combines them.

Formulas
--------
- total FLOPs          = FLOPs/token x tokens
  (FLOPs/token: ``palm`` = 6 N_matmul + 12 L d_attn T, the default; ``6n`` = 6 x params,
  what simple "training time calculators" use -- with ``--flops-formula 6n`` their
  result is reproduced exactly)
- effective FLOP/s     = dense peak per GPU x GPUs x MFU
- wall time            = total FLOPs / effective FLOP/s. An MFU, assumed (``--mfu``) or
  measured (flopwise's meter, every public figure), is end-to-end: the step's communication,
  data waits and host time are inside it. So the wall time is not charged for communication
  again, and the simple calculator, 6 x params x tokens / (peak x GPUs x MFU), is reproduced
  exactly at any GPU count (``--flops-formula 6n``). The communication estimate below is shown
  as the part of that time it would take, and flagged when it alone exceeds what the MFU leaves
  (a step at MFU m spends at most (1 - m) of its time off the peak). Only a predicted step
  (``plan --trace``) is built from compute plus exposed communication: its MFU is the result.
  GPU-hours = wall time x GPUs, cost = GPU-hours x price
- tokens affordable    = hours x 3600 x effective FLOP/s / FLOPs per token (``--hours`` is the
  wall time the user gave, either way)
- epochs               = tokens / the train split's tokens of the config's ``data.path``
- Chinchilla tokens    = 20 x parameters (Hoffmann et al. 2022; total parameters, or
  active parameters for a mixture of experts)
- ring all-reduce time = 2 (n-1)/n x gradient bytes / link bandwidth, once per optimizer
  step (DDP syncs only on the last micro-batch of an accumulation), assumed not
  overlapped with compute: a conservative bound on scaling efficiency. The traffic
  follows what flopwise's strategies send: DDP one all-reduce of the gradients per step;
  ZeRO-1 that plus the broadcast of each rank's updated parameters; FSDP2 two all-gathers
  of the parameters per micro-batch and one fp32 reduce-scatter per step.
- DiLoCo (``--strategy diloco``; :func:`diloco_comm`): G = GPUs / S worker groups of S GPUs
  (default S: a node). Each inner step costs the inner strategy's communication over the
  group (ddp or fsdp2 at S GPUs, over the intra-node link). Every H inner steps the
  pseudo-gradient (P parameters x 4 or 2 bytes, ``--outer-dtype``) is all-reduced once
  across groups, sharded: each of the S ranks all-reduces 1/S of it with its peers, so a
  node's network carries one model's worth: 2 (G-1)/G x P x outer bytes / network GB/s;
  then the group all-gathers the pieces: (S-1)/S x P x outer bytes / intra-node GB/s.
  Per inner step: inner communication + (outer all-reduce + all-gather) / H. The smallest H
  at which that is at most ``--comm-share`` of the step (compute + communication) is
  :func:`smallest_inner_steps`; none exists when the in-group communication alone exceeds it.
- HSDP (``--strategy hsdp``; :func:`hsdp_comm`): G = GPUs / S shard groups of S GPUs (default S:
  a node). Every step, inside a group, fsdp2's all-gathers and fp32 reduce-scatter over S GPUs
  (the intra-node link): (S-1)/S x P x (2 x gather bytes x micro-batches + 4) / intra-node GB/s;
  then across the groups each GPU all-reduces its fp32 gradient shard (4 B x P / S) with the G
  GPUs that hold the same shard: 2 (G-1)/G x 4 B x P / S / network GB/s -- about 1/S of ddp's
  all-reduce over the same network. Both every step, added (not overlapped).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from flopwise.config import ModelConfig, ParallelConfig, batch_split_problems
from flopwise.errors import FlopwiseError
from flopwise.plan import hardware, memory
from flopwise.plan.flops import flops_per_token, flops_per_token_6n, hardware_flops_per_token, param_counts
from flopwise.plan.memory import MemorySettings, estimate, max_micro_batch, state_bytes

if TYPE_CHECKING:
    from flopwise.config import RunConfig, TrainConfig

CHINCHILLA_TOKENS_PER_PARAM = 20.0
GIB = 1024**3


class PlanError(FlopwiseError, ValueError):
    """Bad planner input; the message names the flag."""


# The largest figure each numeric flag takes: far past any real run (the largest public
# pretraining runs are ~1e14 tokens on ~1e5 GPUs), yet small enough that every product the plan
# forms of them -- FLOPs, hours, GPU-hours, cost -- stays a finite float (JSON has no Infinity).
BOUNDS = {"--tokens": ("tokens", 1e16), "--hours": ("hours", 1e7), "--price-per-gpu-hour": ("price_per_gpu_hour", 1e6),
          "--params": ("params", 1e15), "--gpus": ("gpus", 1e6), "--peak-tflops": ("peak_tflops", 1e6),
          "--memory-gb": ("memory_gb", 1e6), "--seq-len": ("seq_len", 1e7), "--micro-batch": ("micro_batch", 1e7),
          "--grad-accum": ("grad_accum", 1e7), "--target-batch-tokens": ("target_batch_tokens", 1e12)}


def _out_of_bounds(inp: "PlanInputs") -> list[str]:
    """A problem for each numeric flag that is not a finite number or is above its bound."""
    problems = []
    for flag, (name, bound) in BOUNDS.items():
        value = getattr(inp, name)
        if not math.isfinite(value):
            problems.append(f"{flag} must be a finite number, got {value:g}")
        elif value > bound:
            problems.append(f"{flag} {value:g} is above the largest the plan takes ({bound:g})")
    # the divisors of the time: a rate too small to be one would overflow it
    if 0 < inp.peak_tflops < 1e-9:
        problems.append(f"--peak-tflops {inp.peak_tflops:g} is below the smallest the plan takes (1e-09)")
    if 0 < inp.mfu < 1e-6:
        problems.append(f"--mfu {inp.mfu:g} is below the smallest the plan takes (1e-06)")
    return problems


@dataclass
class PlanInputs:
    """What ``flopwise plan`` is asked. Either ``model`` or ``params`` describes the model."""

    model: ModelConfig | None = None
    model_name: str = ""
    params: int = 0  # raw size (``--params 8e9``) when there is no model config
    gpu: hardware.DeviceSpec | None = None
    peak_tflops: float = 0.0  # per GPU; overrides the table
    dtype: str = "bf16"  # which peak of the table: bf16 | fp16 | fp8 | tf32 | fp32
    memory_gb: float = 0.0  # per GPU; overrides the table (GiB)
    gpus: int = 1
    gpus_per_node: int = 8
    mfu: float = 0.40
    # where mfu came from: "" assumed (--mfu or the default); else the dry run's prediction for
    # the planned step on this GPU (plan --trace), whose step time holds its exposed communication
    mfu_predicted_by: str = ""
    # with mfu_predicted_by: the predicted step's MFU without its exposed communication, which the
    # scaling rows' compute per step is made of (their communication is added, not overlapped); 0 = mfu
    mfu_compute: float = 0.0
    # with mfu_predicted_by: the prediction's error band (plan/accuracy.py's ``band``: ``low`` and
    # ``high`` ratios of predicted to measured, ``cases``, ``regime``), what the plan's ``band`` ranges are of
    mfu_band: dict[str, Any] | None = None
    tokens: int = 0
    hours: float = 0.0
    chinchilla: bool = False
    # a configured run's own limits: what set its tokens (RunConfig.step_limit), and its
    # train.max_hours, at which it stops whatever its tokens -- the plan plans what the run will do
    limit: str = ""
    max_hours: float = 0.0
    price_per_gpu_hour: float = 0.0
    flops_formula: str = "palm"  # palm | 6n
    seq_len: int = 2048
    micro_batch: int = 0  # 0 = recommend
    grad_accum: int = 0  # 0 = recommend
    target_batch_tokens: int = 524_288  # tokens per optimizer step to aim for when recommending
    headroom: float = 0.9  # use at most this fraction of GPU memory
    memory: MemorySettings = field(default_factory=MemorySettings)
    interconnect: str = ""  # within a node; "" = the GPU's usual link
    network: str = ""  # between nodes; "" = hardware.DEFAULT_NETWORK (named as the default where used)
    # The strategy was not chosen by the user (plan's default): when it does not fit in
    # memory and another one does, the plan switches to that one and says so at the top.
    # (Never to diloco nor hsdp: those are planned only when asked for, as train's auto does.)
    auto_strategy: bool = False
    # --strategy diloco: inner steps between outer syncs (H), and the share of step time
    # DiLoCo's communication should stay under (the plan names the smallest H that does).
    # The inner strategy, group size and outer dtype are memory settings (they change memory).
    inner_steps: int = ParallelConfig.inner_steps  # train's default H, one number for both
    comm_share: float = 0.05
    # The data the run trains on (``data.path`` of a config), when it names one that is here:
    # its train split's tokens say how many epochs the token budget is.
    data_path: str = ""
    data_train_tokens: int = 0
    # How a default `train` sets compile and loss for memory settings of another strategy or GPU
    # count (a suggestion's): flopwise plan passes train/defaults.py's rule, which this layer
    # cannot import; None keeps them as they are.
    defaults: Callable[[MemorySettings], MemorySettings] | None = None

    def validate(self) -> None:
        """Raise :class:`PlanError` listing every bad flag."""
        p: list[str] = _out_of_bounds(self)
        if self.model is None and self.params <= 0:
            p.append("give a model (--model / --config) or a size (--params N)")
        if self.model is not None and self.params > 0:
            p.append("--params and --model/--config both describe the model: give one")
        if not 0 < self.mfu <= 1:
            p.append(f"--mfu must be in (0, 1], got {self.mfu:g}")
        if self.gpus < 1:
            p.append(f"--gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_node < 1:
            p.append(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        given = [name for name, on in (("--tokens", self.tokens != 0), ("--hours", self.hours != 0),
                                       ("--chinchilla", self.chinchilla)) if on]
        if len(given) > 1:
            p.append(f"{' and '.join(given)} were both given: choose one of --tokens, --hours, --chinchilla")
        if self.tokens < 0:
            p.append(f"--tokens must be > 0, got {self.tokens}")
        if self.hours < 0:
            p.append(f"--hours must be > 0, got {self.hours:g}")
        if self.price_per_gpu_hour < 0:
            p.append(f"--price-per-gpu-hour must be >= 0, got {self.price_per_gpu_hour:g}")
        if self.peak_tflops < 0:
            p.append(f"--peak-tflops must be > 0, got {self.peak_tflops:g}")
        if self.memory_gb < 0:
            p.append(f"--memory-gb must be > 0, got {self.memory_gb:g}")
        if self.flops_formula not in ("palm", "6n"):
            p.append(f"--flops-formula must be palm or 6n, got {self.flops_formula!r}")
        if self.flops_formula == "palm" and self.model is None and self.params > 0:
            p.append("--flops-formula palm needs the model's shape (--model/--config); with --params use 6n")
        if self.dtype not in hardware.DTYPES:
            p.append(f"--dtype must be one of {', '.join(hardware.DTYPES)}, got {self.dtype!r}")
        for flag, value in (("--seq-len", self.seq_len), ("--micro-batch", self.micro_batch),
                            ("--grad-accum", self.grad_accum), ("--target-batch-tokens", self.target_batch_tokens)):
            if value < 0 or (flag in ("--seq-len", "--target-batch-tokens") and value == 0):
                p.append(f"{flag} must be > 0, got {value}")
        if not 0 < self.headroom <= 1:
            p.append(f"--headroom must be in (0, 1], got {self.headroom:g}")
        for flag, link in (("--interconnect", self.interconnect), ("--network", self.network)):
            if link and hardware.find_link(link) is None:
                p.append(hardware.unknown_link_message(flag, link))
        if self.model is not None and self.seq_len > self.model.max_seq_len:
            p.append(f"--seq-len {self.seq_len} exceeds the model's max_seq_len {self.model.max_seq_len}")
        if self.gpu is not None and self.peak_tflops == 0 and getattr(self.gpu, self.dtype, None) is None:
            p.append(f"the {self.gpu.name} has no dense {self.dtype} peak in the table; choose another --dtype "
                     "or give --peak-tflops")
        mem = self.memory
        for flag, setting, choices in (("--precision", mem.precision, memory.PRECISIONS),
                                       ("--attention", mem.attention, memory.ATTENTIONS),
                                       ("--checkpointing", mem.activation_checkpointing, memory.CHECKPOINTING),
                                       ("--strategy", mem.strategy, memory.STRATEGIES),
                                       ("--loss", mem.loss, ("plain", "chunked")),
                                       ("--inner-strategy", mem.inner_strategy, memory.INNER_STRATEGIES),
                                       ("--outer-dtype", mem.outer_dtype, tuple(memory.OUTER_BYTES))):
            if setting not in choices:
                p.append(f"{flag} {setting!r}: choose {', '.join(choices)}")
        if mem.strategy == "diloco":
            if self.inner_steps < 1:
                p.append(f"--inner-steps must be >= 1, got {self.inner_steps}")
            if not 0 < self.comm_share < 1:
                p.append(f"--comm-share must be in (0, 1), got {self.comm_share:g}")
        p += self._group_problems()
        if mem.activation_checkpointing_every < 1:
            p.append(f"--checkpointing-every must be >= 1, got {mem.activation_checkpointing_every}")
        if p:
            raise PlanError("; ".join(p))

    # ---------------------------------------------------------------- derived inputs
    @property
    def peak_flops(self) -> float | None:
        """Dense peak FLOP/s of one GPU, or None when unknown."""
        if self.peak_tflops > 0:
            return self.peak_tflops * 1e12
        if self.gpu is not None:
            value = getattr(self.gpu, self.dtype)
            return None if value is None else value * 1e12
        return None

    def _group_problems(self) -> list[str]:
        """Why the GPUs cannot be cut into DiLoCo's worker groups or HSDP's shard groups (one
        problem at most; none for the other strategies)."""
        mem, group = self.memory, self.group_gpus
        if mem.strategy not in ("diloco", "hsdp"):
            return []
        if mem.group_size < 0:
            return [f"--group-size must be >= 1, got {mem.group_size}"]
        if mem.strategy == "diloco":
            if group > self.gpus:
                return [f"--group-size {group} exceeds --gpus {self.gpus}"]
            return [f"--group-size {group} must divide --gpus {self.gpus} into equal worker groups"] \
                if self.gpus % group else []
        if not self.gpus % group:
            return []
        if mem.group_size:
            return [f"--strategy hsdp: shard groups of {group} GPUs (--group-size, parallel.group_size) do not divide "
                    f"--gpus {self.gpus} into whole groups; give a divisor of {self.gpus}"]
        return [f"--strategy hsdp shards within a node: --gpus-per-node {self.gpus_per_node} does not divide --gpus "
                f"{self.gpus} into whole shard groups; give whole nodes, or a --group-size that divides {self.gpus}"]

    @property
    def group_gpus(self) -> int:
        """GPUs in one DiLoCo worker group or HSDP shard group: ``--group-size``, else the GPUs of
        one node (all of them when fewer than a node are planned)."""
        return self.memory.group_size or min(self.gpus_per_node, self.gpus)

    @property
    def gpu_memory_bytes(self) -> int | None:
        if self.memory_gb > 0:
            return int(self.memory_gb * GIB)
        return self.gpu.memory_bytes if self.gpu is not None else None


# Named bands of planned tokens against Chinchilla's compute-optimal 20 per parameter: (upper
# bound of the ratio, name, the band as said). Hoffmann et al.'s IsoFLOP curves are flat near
# the optimum, so within 10% is "compute-optimal"; 0.5x and 2x are where the loss at the same
# compute is measurably worse, so each side has a near and a far band.
CHINCHILLA_BANDS: tuple[tuple[float, str, str], ...] = (
    (0.5, "far under-trained", "below 0.5x"),
    (0.9, "under-trained", "0.5x to 0.9x"),
    (1.1, "compute-optimal", "0.9x to 1.1x"),
    (2.0, "over-trained", "1.1x to 2x"),
    (math.inf, "far over-trained", "above 2x"),
)


def chinchilla_verdict(tokens: float, params: float, total_flops: float) -> str:
    """One line on where ``tokens`` stands against Chinchilla's 20 tokens per parameter: the
    ratio, its band of :data:`CHINCHILLA_BANDS` (named with its bounds), and what it means."""
    optimal = CHINCHILLA_TOKENS_PER_PARAM * params
    ratio = tokens / optimal
    # For a compute budget C = 6 N D with D = 20 N, the compute-optimal size is sqrt(C / 120).
    n_opt = math.sqrt(total_flops / (6 * CHINCHILLA_TOKENS_PER_PARAM)) if total_flops > 0 else 0.0
    # the band of the ratio as printed (0.499 reads 0.50x: the band from 0.5x)
    name, band = next((name, band) for upper, name, band in CHINCHILLA_BANDS if round(ratio, 2) < upper)
    head = f"{ratio:.2f}x the compute-optimal tokens (20 per parameter): {name} ({band})"
    if name.endswith("under-trained"):
        return (f"{head}; this compute would be spent best on a ~{_h(n_opt)}-parameter model trained on "
                f"{_h(CHINCHILLA_TOKENS_PER_PARAM * n_opt)} tokens")
    if name.endswith("over-trained"):
        return (f"{head}; a ~{_h(n_opt)}-parameter model would reach a lower loss with this compute, but this "
                "smaller model is cheaper to serve" + (" (SmolLM-style over-training)" if ratio > 2 else ""))
    return head


def _h(n: float) -> str:
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= threshold:
            return f"{n / threshold:.3g}{suffix}"
    return f"{n:.3g}"


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def recommend_batch(inp: PlanInputs, max_micro: int | None) -> dict[str, Any]:
    """Micro-batch, accumulation and global batch near ``target_batch_tokens`` per step.

    The micro-batch is the given one, or the largest power of two that fits (the memory
    model's ``max_micro_batch``) without exceeding the target by itself; accumulation
    then fills the step up to the target.
    """
    per_gpu_target = max(1, round(inp.target_batch_tokens / inp.seq_len / inp.gpus))
    if inp.micro_batch:
        micro, source = inp.micro_batch, "given"
    elif max_micro:
        micro, source = _pow2_floor(min(max_micro, per_gpu_target)), "largest power of two that fits"
    else:
        micro, source = 1, "memory unknown or nothing fits: 1"
    accum = inp.grad_accum or max(1, round(per_gpu_target / micro))
    global_batch = micro * accum * inp.gpus
    return {
        "seq_len": inp.seq_len,
        "micro_batch": micro,
        "micro_batch_source": source,
        "grad_accum": accum,
        "global_batch": global_batch,
        "tokens_per_step": global_batch * inp.seq_len,
        "target_tokens_per_step": inp.target_batch_tokens,
    }


def allreduce_seconds(grad_bytes: float, n: int, link_gb_per_s: float) -> float:
    """Ring all-reduce: each GPU sends and receives 2 (n-1)/n of the buffer."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * grad_bytes / (link_gb_per_s * 1e9)


def _find_link(name: str, flag: str) -> hardware.Link:
    link = hardware.find_link(name)
    if link is None:
        raise PlanError(hardware.unknown_link_message(flag, name))
    return link


def ring_link(inp: PlanInputs, gpus: int) -> hardware.Link:
    """The link a ring over ``gpus`` GPUs runs at: the intra-node one (``--interconnect``, else
    the GPU's usual link), or the slower of it and ``--network`` (else :data:`hardware.DEFAULT_NETWORK`)
    when the ring crosses nodes."""
    link = _find_link(inp.interconnect, "--interconnect") if inp.interconnect else \
        hardware.LINKS[hardware.default_link(inp.gpu)]
    if gpus > inp.gpus_per_node:  # the ring crosses nodes: the slowest hop sets the pace
        network = _find_link(inp.network or hardware.DEFAULT_NETWORK, "--network")
        link = min((link, network), key=lambda lk: lk.gb_per_s)
    return link


def side_by_side(inp: PlanInputs, link: hardware.Link, group: int) -> int:
    """How many of a node's GPUs put their across-group all-reduce through ``link`` at once when each
    GPU of a group of ``group`` reduces its own shard (HSDP, DiLoCo's outer sync): the GPUs of
    one group on a node, when ``link`` is a NIC they share (:attr:`hardware.Link.shared`), else 1."""
    return hardware.side_by_side(link.shared, min(group, inp.gpus_per_node), 1)


def _share(comm_s: float, compute_s: float | None) -> float | None:
    """Communication's share of a step that does not overlap it with compute."""
    return comm_s / (compute_s + comm_s) if compute_s else None


def scaling(inp: PlanInputs, fpt: float, tokens_per_step: int, n_params: int, micro_batches_per_step: int,
            gpus: int) -> dict[str, Any]:
    """Communication cost and scaling efficiency of one configuration at ``gpus`` GPUs."""
    if inp.memory.strategy == "diloco":
        return diloco_comm(inp, fpt, tokens_per_step, n_params, micro_batches_per_step, gpus)
    if inp.memory.strategy == "hsdp":
        return hsdp_comm(inp, fpt, tokens_per_step, n_params, micro_batches_per_step, gpus)
    peak = inp.peak_flops
    link = ring_link(inp, gpus)
    settings = inp.memory
    param_bytes = 2 if settings.precision == "bf16-pure" else 4
    grad_bytes = n_params * param_bytes  # gradients in parameter dtype
    share = (gpus - 1) / gpus if gpus > 1 else 0.0
    if settings.strategy == "fsdp2":
        # flopwise's FSDP2: every micro-batch all-gathers the parameters for forward and again
        # for backward (blocks reshard after forward) in the compute dtype; the gradients are
        # reduce-scattered once per step (no sync on the earlier micro-batches), in fp32.
        gather = 4 if settings.precision == "float32" else 2
        comm_bytes = share * n_params * (2 * gather * micro_batches_per_step + 4)
        comm_s = comm_bytes / (link.gb_per_s * 1e9)
    else:
        comm_bytes = 2 * share * grad_bytes
        if settings.strategy == "zero1":  # each rank broadcasts the parameters it stepped
            comm_bytes += share * n_params * param_bytes
        comm_s = comm_bytes / (link.gb_per_s * 1e9)
    out: dict[str, Any] = {
        "gpus": gpus,
        "link": link.name,
        "link_gb_per_s": link.gb_per_s,
        "grad_bytes": grad_bytes,
        "comm_bytes_per_gpu": comm_bytes,
        "comm_s": comm_s,
    }
    out.update(_step_parts(inp, tokens_per_step * fpt / gpus / peak if peak else None, comm_s))
    return out


REDUCE_BYTES = 4  # FSDP2 reduces gradients in fp32 (MixedPrecisionPolicy's reduce_dtype): fsdp2's and hsdp's


def hsdp_comm(inp: PlanInputs, fpt: float, tokens_per_step: int, n_params: int, micro_batches_per_step: int,
              gpus: int) -> dict[str, Any]:
    """HSDP's communication per step at ``gpus`` GPUs (the module docstring's formula), as a row of
    :func:`scaling` plus its two parts: G = ``gpus`` / S shard groups of S GPUs (``--group-size``,
    else a node; at most ``gpus``). ``in_group``: fsdp2's all-gathers and reduce-scatter over the S
    GPUs of a group (:func:`scaling`'s fsdp2 row at S GPUs, over the group's link); ``across_groups``:
    the ring all-reduce of each GPU's fp32 gradient shard (4 B x P / S) among the G GPUs that hold
    the same shard, over the link between them (the network when the GPUs span nodes), once per
    step. Both every step, added. With one group it is fsdp2's at ``gpus``."""
    mem = inp.memory
    group = min(mem.group_size or inp.gpus_per_node, gpus)
    groups = gpus // group
    inner = scaling(replace(inp, memory=replace(mem, strategy="fsdp2", n_gpus=group)), fpt,
                    tokens_per_step * group // gpus, n_params, micro_batches_per_step, group)
    cross_link = ring_link(inp, gpus)
    shard = REDUCE_BYTES * n_params / group  # a GPU's gradient shard, in the reduce dtype
    cross_bytes = 2 * (groups - 1) / groups * shard if groups > 1 else 0.0
    sharing = side_by_side(inp, cross_link, group)
    cross_s = allreduce_seconds(shard * sharing, groups, cross_link.gb_per_s)
    comm_s = inner["comm_s"] + cross_s
    link = cross_link if groups > 1 else ring_link(inp, group)
    peak = inp.peak_flops
    out: dict[str, Any] = {
        "gpus": gpus, "link": link.name, "link_gb_per_s": link.gb_per_s, "grad_bytes": inner["grad_bytes"],
        "comm_bytes_per_gpu": inner["comm_bytes_per_gpu"] + cross_bytes, "comm_s": comm_s,
        "group_size": group, "groups": groups,
        "in_group": {"strategy": "fsdp2", "gpus": group, "link": inner["link"], "link_gb_per_s": inner["link_gb_per_s"],
                     "between_nodes": group > inp.gpus_per_node, "micro_batches": micro_batches_per_step,
                     "gather_bytes_per_param": 4 if mem.precision == "float32" else 2,
                     "bytes": inner["comm_bytes_per_gpu"], "s": inner["comm_s"]},
        "across_groups": {"groups": groups, "link": cross_link.name, "link_gb_per_s": cross_link.gb_per_s,
                          "between_nodes": groups > 1 and gpus > inp.gpus_per_node, "shard_bytes": shard,
                          "sharing_the_nic": sharing,
                          "reduce_bytes_per_param": REDUCE_BYTES, "bytes": cross_bytes, "s": cross_s},
    }
    out.update(_step_parts(inp, tokens_per_step * fpt / gpus / peak if peak else None, comm_s))
    return out


def _step_parts(inp: PlanInputs, peak_s: float | None, comm_s: float) -> dict[str, Any]:
    """A scaling row's step: ``peak_s`` is its FLOPs' time at the peak. Under an MFU (assumed or
    measured: end-to-end) the step is ``peak_s / mfu`` and the communication estimate is a part of
    it: its ``comm_share``, and ``comm_exceeds_mfu`` when it alone takes more than the (1 - MFU)
    of the step that is not at the peak. Under a predicted step (``mfu_compute``), the compute is
    ``peak_s / mfu_compute`` and the communication is added to it (``efficiency``)."""
    if peak_s is None:
        return {"compute_s": None, "step_s": None, "comm_share": None, "efficiency": None, "comm_exceeds_mfu": None}
    if inp.mfu_compute:
        compute_s = peak_s / inp.mfu_compute
        step_s = compute_s + comm_s
        return {"compute_s": compute_s, "step_s": step_s, "comm_share": comm_s / step_s,
                "efficiency": compute_s / step_s, "comm_exceeds_mfu": None}
    step_s = peak_s / inp.mfu
    return {"compute_s": None, "step_s": step_s, "comm_share": comm_s / step_s, "efficiency": None,
            "comm_exceeds_mfu": comm_s > step_s * (1 - inp.mfu)}


def smallest_inner_steps(inner_s: float, outer_s: float, compute_s: float | None, share: float) -> int | None:
    """The smallest H at which DiLoCo's communication per inner step, ``inner_s + outer_s / H``,
    is at most ``share`` of the step (``compute_s`` + that communication): H = ceil(outer_s /
    (share / (1 - share) x compute_s - inner_s)), checked against the share itself. None when
    there is no compute time (no peak) or the in-group communication alone takes the share."""
    if not compute_s:
        return None

    def meets(h: int) -> bool:
        comm = inner_s + outer_s / h
        return comm / (compute_s + comm) <= share

    slack = share / (1 - share) * compute_s - inner_s  # communication time the share leaves the outer sync
    if outer_s <= 0:
        return 1 if meets(1) else None
    if slack <= 0:
        return None
    h = max(1, math.ceil(outer_s / slack))
    while h > 1 and meets(h - 1):  # floating point at the boundary: the share decides
        h -= 1
    while not meets(h):
        h += 1
    return h


def diloco_comm(inp: PlanInputs, fpt: float, tokens_per_step: int, n_params: int, micro_batches_per_step: int,
                gpus: int, inner_steps: int = 0) -> dict[str, Any]:
    """DiLoCo's communication per inner step at ``gpus`` GPUs (the module docstring's formula),
    as a row of :func:`scaling` plus its parts: G = ``gpus`` / S groups of S (``--group-size``,
    else a node, at most ``gpus``) GPUs; the inner strategy's :func:`scaling` row over S GPUs
    (same per-GPU batch, so the same compute time); the outer all-reduce of the pseudo-gradient
    across the G groups and the in-group all-gather of its pieces, both once per H
    (``inner_steps``, default ``inp.inner_steps``) inner steps. With one group (G = 1) nothing
    is reduced across groups and the outer sync costs nothing."""
    mem = inp.memory
    h = inner_steps or inp.inner_steps
    group = min(mem.group_size or inp.gpus_per_node, gpus)
    groups = gpus // group
    inner_inp = replace(inp, memory=replace(mem, strategy=mem.inner_strategy, n_gpus=group))
    inner = scaling(inner_inp, fpt, tokens_per_step * group // gpus, n_params, micro_batches_per_step, group)
    group_link, cross_link = ring_link(inp, group), ring_link(inp, gpus)
    outer_bytes = memory.OUTER_BYTES[mem.outer_dtype]
    pseudo_grad = n_params * outer_bytes
    cross_bytes = 2 * (groups - 1) / groups * pseudo_grad  # a node's (a group's) network traffic, ring
    # each GPU all-reduces its 1/S slice with its peers in the other groups, all S at once: on a NIC
    # per GPU in parallel, on a NIC the node's GPUs share one after another
    sharing = side_by_side(inp, cross_link, group)
    cross_s = allreduce_seconds(pseudo_grad / group * sharing, groups, cross_link.gb_per_s)
    gather_bytes = (group - 1) / group * pseudo_grad if groups > 1 else 0.0
    gather_s = gather_bytes / (group_link.gb_per_s * 1e9)
    outer_s = cross_s + gather_s
    comm_s = inner["comm_s"] + outer_s / h
    # the step DiLoCo's communication share is held against (--comm-share): the inner step's time
    # at the MFU, or its predicted compute; the outer sync is priced on top of it, as H is chosen by it
    compute_s = inner["compute_s"] or inner["step_s"]
    share = _share(comm_s, compute_s)
    return {
        "gpus": gpus,
        "link": (cross_link if groups > 1 else group_link).name,
        "link_gb_per_s": (cross_link if groups > 1 else group_link).gb_per_s,
        "grad_bytes": pseudo_grad,
        # per GPU and inner step: the inner strategy's, and 1/S of the outer all-reduce plus the all-gather, over H
        "comm_bytes_per_gpu": inner["comm_bytes_per_gpu"] + (cross_bytes / group + gather_bytes) / h,
        "comm_s": comm_s,
        "compute_s": compute_s,
        "comm_share": share,
        "efficiency": compute_s / (compute_s + comm_s) if compute_s else None,
        "group_size": group,
        "groups": groups,
        "inner_strategy": mem.inner_strategy,
        "inner_steps": h,
        "outer_dtype": mem.outer_dtype,
        "outer_bytes_per_param": outer_bytes,
        "pseudo_gradient_bytes": pseudo_grad,
        "inner": inner,
        "outer_allreduce": {"link": cross_link.name, "link_gb_per_s": cross_link.gb_per_s, "groups": groups,
                            "bytes": cross_bytes, "slice_bytes": pseudo_grad / group, "sharing_the_nic": sharing,
                            "s": cross_s},
        "outer_allgather": {"link": group_link.name, "link_gb_per_s": group_link.gb_per_s, "group_size": group,
                            "bytes": gather_bytes, "s": gather_s},
        "outer_s": outer_s,
        "outer_s_per_step": outer_s / h,
    }


def diloco_summary(inp: PlanInputs, fpt: float, tokens_per_step: int, n_params: int,
                   micro_batches_per_step: int) -> dict[str, Any]:
    """``plan["diloco"]``: DiLoCo at the GPUs and H asked beside ddp and fsdp2 at the same GPUs
    (each: communication per step, its share of the step), and the smallest H at which DiLoCo's
    communication is at most ``inp.comm_share`` of the step (``min_inner_steps``; None with
    ``none_reason`` when no H is)."""
    gpus = inp.gpus
    out = diloco_comm(inp, fpt, tokens_per_step, n_params, micro_batches_per_step, gpus)
    out["compare"] = {s: scaling(replace(inp, memory=replace(inp.memory, strategy=s)), fpt, tokens_per_step,
                                 n_params, micro_batches_per_step, gpus) for s in ("ddp", "fsdp2")}
    out["target_comm_share"] = inp.comm_share
    inner_s, compute_s = out["inner"]["comm_s"], out["compute_s"]
    for row in out["compare"].values():  # shares of the same step as DiLoCo's, communication added to it
        row["comm_share"] = _share(row["comm_s"], compute_s)
    h = smallest_inner_steps(inner_s, out["outer_s"], compute_s, inp.comm_share)
    out["min_inner_steps"] = h
    out["none_reason"] = None
    out["at_min_inner_steps"] = out["below_min_inner_steps"] = None
    if h is not None:
        for key, at in (("at_min_inner_steps", h), ("below_min_inner_steps", h - 1)):
            if at >= 1:
                comm = inner_s + out["outer_s"] / at
                out[key] = {"inner_steps": at, "comm_s": comm, "comm_share": _share(comm, compute_s)}
    elif not compute_s:
        out["none_reason"] = "no compute time without a peak (give --gpu or --peak-tflops)"
    else:
        out["none_reason"] = (f"the in-group communication alone ({out['inner_strategy']} over "
                              f"{out['group_size']} GPUs: {1000 * inner_s:.1f} ms, "
                              f"{100 * (_share(inner_s, compute_s) or 0):.1f}% of the step) exceeds "
                              f"{100 * inp.comm_share:g}%")
    return out


# least communication first, least memory last: what a set-up that does not fit is switched to. Never
# diloco nor hsdp (train's auto picks neither); hsdp is offered beside fsdp2 across nodes (_alternatives).
STRATEGY_ORDER = ("ddp", "zero1", "fsdp2")


def build_plan(inp: PlanInputs) -> dict[str, Any]:
    """Every quantity of the plan as a JSON-able dict (see :mod:`flopwise.plan.budget`).

    When the set-up does not fit in memory, ``plan["fit"]`` says so and names the
    strategy that would (``proposed``): with a model, the first of zero1, fsdp2 (in that
    order, after the one asked) whose memory fits; with ``--params`` only fsdp2, because
    only the states are counted there and fsdp2 leaves the most room for the uncounted
    activations. With ``auto_strategy`` (the user did not choose one) the whole plan --
    memory, time, cost, scaling -- is then that strategy's, and ``fit["switched"]`` is
    True; otherwise the plan stays as asked and ``plan["runnable"]`` is False. Across
    nodes hsdp is checked beside fsdp2 and, where it fits, offered (``fit["offered"]``), never
    switched to; an hsdp set-up that does not fit is checked against fsdp2 alone.
    """
    inp.validate()
    if inp.memory.strategy in ("diloco", "hsdp"):  # the group size as planned (default: a node), the memory model's
        inp = replace(inp, memory=replace(inp.memory, group_size=inp.group_gpus))
    plan = _build_plan(inp)
    asked = inp.memory.strategy
    fit: dict[str, Any] = {
        "asked": asked, "asked_memory_gb": plan["memory_gb"], "asked_fits": plan["fits"],
        "strategy": asked, "states_only": inp.model is None, "per_strategy": {}, "proposed": None,
        "switched": False,
    }
    if plan["fits"] is False and inp.gpus > 1 and asked == "diloco":
        # diloco is only ever planned as asked: no other strategy is proposed for it, but an
        # fsdp2 inner strategy (sharded over the group) is tried when ddp's does not fit
        fit["per_strategy"][asked] = {"memory_gb": plan["memory_gb"], "fits": False,
                                      "max_micro_batch": plan["max_micro_batch"]}
        if inp.memory.inner_strategy == "ddp":
            alt = _build_plan(replace(inp, memory=replace(inp.memory, inner_strategy="fsdp2")))
            fit["inner_alternative"] = {"inner_strategy": "fsdp2", "memory_gb": alt["memory_gb"],
                                        "fits": alt["fits"], "max_micro_batch": alt["max_micro_batch"]}
    elif plan["fits"] is False and inp.gpus > 1:
        fit["per_strategy"][asked] = {"memory_gb": plan["memory_gb"], "fits": False,
                                      "max_micro_batch": plan["max_micro_batch"]}
        others = _alternatives(inp, asked)
        for strategy, alt in others.items():
            fit["per_strategy"][strategy] = {"memory_gb": alt["memory_gb"], "fits": alt["fits"],
                                             "max_micro_batch": alt["max_micro_batch"]}
        fitting = [s for s, alt in others.items() if alt["fits"] and s in STRATEGY_ORDER]
        if inp.model is None:
            fit["proposed"] = "fsdp2" if "fsdp2" in fitting else None
        else:
            fit["proposed"] = fitting[0] if fitting else None
        if fit["proposed"] and others.get("hsdp", {}).get("fits"):
            fit["offered"] = _offered(others, fit["proposed"])
        if fit["proposed"] and inp.auto_strategy:
            plan = others[fit["proposed"]]
            fit.update(strategy=fit["proposed"], switched=True)
    if plan["fits"] is False:
        fit["suggestions"] = fit_suggestions(inp)
    plan["fit"] = fit
    plan["runnable"] = plan["fits"] is not False
    return plan


def _alternatives(inp: PlanInputs, asked: str) -> dict[str, dict[str, Any]]:
    """The plans a set-up of ``asked`` that does not fit is checked against: the strategies after
    it in :data:`STRATEGY_ORDER` (single: like ddp); for hsdp, fsdp2 alone (it shards the same
    states over every GPU, not a group's). Beside fsdp2, when the GPUs are whole nodes of more than
    one, hsdp sharded within a node: fsdp2's memory at a node's GPUs, less traffic between nodes."""
    if asked == "hsdp":
        order: tuple[str, ...] = ("fsdp2",)
    else:
        order = STRATEGY_ORDER[STRATEGY_ORDER.index(asked) + 1 if asked in STRATEGY_ORDER else 1:]
    out = {s: _build_plan(replace(inp, memory=replace(inp.memory, strategy=s))) for s in order}
    node = inp.gpus_per_node
    if asked != "hsdp" and "fsdp2" in out and inp.gpus > node and inp.gpus % node == 0:
        out["hsdp"] = _build_plan(replace(inp, memory=replace(inp.memory, strategy="hsdp", group_size=node)))
    return out


def _offered(others: dict[str, dict[str, Any]], proposed: str) -> dict[str, Any]:
    """``fit["offered"]``: hsdp, which fits, beside the strategy ``proposed``: its memory per GPU,
    shard group and communication per step (and the part of it between the groups), and
    ``proposed``'s communication per step at the same GPUs."""
    hsdp, alt = others["hsdp"], others[proposed]
    at = hsdp["scaling"]["at_gpus"]
    return {"strategy": "hsdp", "memory_gb": hsdp["memory_gb"], "group_size": at["group_size"],
            "comm_s": at["comm_s"], "across_groups_s": at["across_groups"]["s"],
            "across_groups_link": at["across_groups"]["link"], "beside": proposed,
            "beside_comm_s": alt["scaling"]["at_gpus"]["comm_s"]}


MAX_SUGGESTED_GPUS = 1024


def fit_suggestions(inp: PlanInputs) -> list[dict[str, Any]]:
    """What would make a set-up that does not fit in memory fit, the change to the run that
    costs least first, each as the flags that plan it and the memory per GPU it needs:

    1. a smaller micro-batch (when one was given) on the GPUs asked: the same global batch,
       more accumulation;
    2. full activation checkpointing on the GPUs asked (recomputing the forward costs about
       a third of a step);
    3. the fewest GPUs (a power of two) that fit with fsdp2, and with fsdp2 and full
       checkpointing where that needs fewer; at the micro-batch the planner picks there (the
       largest that fits), named when one was given.

    Empty when nothing up to ``MAX_SUGGESTED_GPUS`` fits (one sequence is too big: shorten
    it). With ``--params`` only the GPU count is suggested: only the states are counted."""
    out: list[dict[str, Any]] = []
    asked = inp.memory.strategy if inp.gpus > 1 else "single"

    def plan_of(gpus: int, strategy: str, checkpointing: str, micro_batch: int = -1) -> dict[str, Any]:
        mem = replace(inp.memory, strategy=strategy, activation_checkpointing=checkpointing, n_gpus=gpus)
        mem = inp.defaults(mem) if inp.defaults else mem  # what a default train compiles there
        return _build_plan(replace(inp, gpus=gpus, memory=mem,
                                   micro_batch=inp.micro_batch if micro_batch < 0 else micro_batch))

    def need_gb(gpus: int, strategy: str, checkpointing: str, micro_batch: int = -1) -> float | None:
        p = plan_of(gpus, strategy, checkpointing, micro_batch)
        return p["memory_gb"] if p["fits"] else None

    def add(flags: str, gpus: int, strategy: str, checkpointing: str, gb: float, **more: Any) -> None:
        out.append({"flags": flags, "gpus": gpus, "strategy": strategy, "checkpointing": checkpointing,
                    "memory_gb": gb, **more})

    ckpt = inp.memory.activation_checkpointing
    if inp.model is not None and inp.micro_batch > 1:
        b = inp.micro_batch // 2
        while b >= 1:
            gb = need_gb(inp.gpus, asked, ckpt, b)
            if gb is not None:
                add(f"--micro-batch {b}", inp.gpus, asked, ckpt, gb, micro_batch=b)
                break
            b //= 2
    if inp.model is not None and ckpt != "full":
        gb = need_gb(inp.gpus, asked, "full")
        if gb is not None:
            add("--checkpointing full", inp.gpus, asked, "full", gb)
    fewest = MAX_SUGGESTED_GPUS + 1
    if asked == "diloco":  # more GPUs add groups, not memory: no other strategy is suggested for it
        return out
    for checkpointing in ([ckpt, "full"] if inp.model is not None and ckpt != "full" else [ckpt]):
        n = 2
        while n < fewest and n <= MAX_SUGGESTED_GPUS:
            p = plan_of(n, "fsdp2", checkpointing, 0)  # the planner's micro-batch: the largest that fits there
            if p["fits"]:
                if n > inp.gpus:
                    extra = " --checkpointing full" if checkpointing == "full" and ckpt != "full" else ""
                    micro = p["batch"]["micro_batch"]
                    if inp.micro_batch and micro != inp.micro_batch:
                        extra += f" --micro-batch {micro}"
                    add(f"--gpus {n} --strategy fsdp2{extra}", n, "fsdp2", checkpointing, p["memory_gb"],
                        micro_batch=micro)
                fewest = n
                break
            n *= 2
    return out


def _build_plan(inp: PlanInputs) -> dict[str, Any]:
    """The plan of ``inp`` as asked, section by section (:func:`build_plan` adds the fit check)."""
    plan: dict[str, Any] = {"model": inp.model_name or ("custom" if inp.model else f"{_h(inp.params)} parameters")}
    plan.update(_params_and_flops(inp))
    fpt, n_params = plan["flops_per_token"], plan["params"]
    # Chinchilla counts active parameters: for a mixture of experts, only the experts a token is routed to
    active = plan["params_breakdown"]["active"] if plan["params_breakdown"] else n_params
    peak = inp.peak_flops
    effective = peak * inp.gpus * inp.mfu if peak else None
    plan.update(gpu=_gpu(inp), gpus=inp.gpus, mfu=inp.mfu, effective_flops=effective,
                mfu_source=inp.mfu_predicted_by or "assumed")
    # the batch sets the communication per step: the memory, batch and scaling are planned first
    memory_and_batch = _memory_and_batch(inp, n_params)
    batch = memory_and_batch["batch"]
    scaling_plan = _scaling_plan(inp, fpt, batch, n_params)
    # an MFU, assumed or predicted, is of the whole step, its communication included: not counted twice
    plan.update(tokens_time_cost(inp, fpt, active, effective))
    plan["comm_hours"] = comm_hours(plan["tokens"], batch["tokens_per_step"], scaling_plan["at_gpus"])
    if inp.mfu_predicted_by and inp.mfu_band:
        plan["band"] = predicted_range(inp.mfu_band, plan)
    plan.update(memory_and_batch)
    if plan["tokens"] is not None:
        batch["steps"] = math.ceil(plan["tokens"] / batch["tokens_per_step"])
    plan["scaling"] = scaling_plan
    plan.update(_data_epochs(inp, plan["tokens"]))
    if inp.memory.strategy == "diloco":
        plan["diloco"] = diloco_summary(inp, fpt, batch["tokens_per_step"], n_params, max(1, batch["grad_accum"]))
    return plan


def _params_and_flops(inp: PlanInputs) -> dict[str, Any]:
    """Parameters (with their breakdown when there is a model) and FLOPs per token under each
    formula: ``flops_per_token`` is the one asked (``--flops-formula``)."""
    m = inp.model
    breakdown: dict[str, Any] | None = None
    if m is not None:
        breakdown = param_counts(m)
        n_params = breakdown["total"]
        fpt_palm: float | None = flops_per_token(m, inp.seq_len)
        fpt_6n = flops_per_token_6n(m)
    else:
        n_params = inp.params
        fpt_palm, fpt_6n = None, 6 * inp.params
    fpt = fpt_6n if inp.flops_formula == "6n" else fpt_palm
    assert fpt is not None  # validate() refuses palm without a model
    # hardware FLOPs (HFU's numerator): the forward of the blocks recomputed in backward on top
    recomputed = (inp.memory.recomputed_blocks(m.n_layers) / m.n_layers) if m is not None and m.n_layers else 0.0
    fpt_hw = hardware_flops_per_token(m, inp.seq_len, recomputed) if m is not None and recomputed else None
    return dict(params=n_params, params_breakdown=breakdown, flops_formula=inp.flops_formula, flops_per_token=fpt,
                flops_per_token_palm=fpt_palm, flops_per_token_6n=fpt_6n, flops_per_token_hardware=fpt_hw,
                recomputed_fraction=recomputed, seq_len=inp.seq_len)


def _gpu(inp: PlanInputs) -> dict[str, Any]:
    """``plan["gpu"]``: the device, its dense peak and memory, and where each came from."""
    peak = inp.peak_flops
    return {
        "name": inp.gpu.name if inp.gpu else None,
        "dtype": inp.dtype,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": "--peak-tflops" if inp.peak_tflops > 0 else ("hardware table" if peak else None),
        "memory_gb": inp.gpu_memory_bytes / GIB if inp.gpu_memory_bytes else None,
        "memory_source": "--memory-gb" if inp.memory_gb > 0 else ("hardware table" if inp.gpu else None),
    }


def tokens_time_cost(inp: PlanInputs, fpt: float, active_params: int, effective: float | None) -> dict[str, Any]:
    """Tokens (``--tokens``, Chinchilla's, or what ``--hours`` affords), ``hours``, the wall time
    they take at ``effective`` FLOP/s (:func:`wall_hours`: the MFU in it is end-to-end), the
    GPU-hours and cost of that wall time, and where the tokens stand against Chinchilla.
    ``--hours`` is the wall time the user gave: its tokens are what that time affords. A configured
    run's ``train.max_hours`` is its wall time when it comes first (:func:`_time_limit`), or when
    it is the run's only limit (no max_steps nor max_tokens): its tokens are then those it is
    expected to reach at the planned rate. ``hours_budget`` names the budget the wall time is
    (``--hours``, ``train.max_hours``; None when it is the tokens' time)."""
    chinchilla_tokens = CHINCHILLA_TOKENS_PER_PARAM * active_params
    time_alone = inp.max_hours > 0 and not (inp.tokens or inp.chinchilla or inp.hours)
    budget_hours = inp.hours or (inp.max_hours if time_alone else 0.0)
    tokens: float | None = None
    if inp.tokens:
        tokens = float(inp.tokens)
    elif inp.chinchilla:
        tokens = chinchilla_tokens
    elif budget_hours and effective:
        tokens = tokens_in(budget_hours, effective, fpt)
    compute_hours = wall_hours(tokens * fpt, effective) if tokens is not None and effective else None
    limit = inp.limit or ("--tokens" if inp.tokens else "--chinchilla" if inp.chinchilla else
                          "--hours" if inp.hours else "")
    hours_budget = "--hours" if inp.hours else None
    if time_alone:
        hours_budget = "train.max_hours"
        limit = (f"train.max_hours ({inp.max_hours:g} h, the run's only limit: "
                 + ("the tokens it is expected to reach at the planned rate)" if tokens is not None else
                    "no peak, so no tokens -- give --gpu or --peak-tflops)"))
    elif inp.max_hours and not inp.hours and compute_hours is not None and effective and \
            compute_hours > inp.max_hours:
        # the run stops at train.max_hours with the tokens that time affords
        limit = _time_limit(inp.max_hours, limit, tokens or 0, compute_hours)
        tokens = tokens_in(inp.max_hours, effective, fpt)
        compute_hours, hours_budget = inp.max_hours, "train.max_hours"
    hours = budget_hours if budget_hours else compute_hours
    total_flops = tokens * fpt if tokens is not None else None
    return dict(
        tokens=tokens,
        limit=limit,
        total_flops=total_flops,
        compute_hours=compute_hours,
        hours=hours,
        hours_given=bool(inp.hours),  # the wall time is the user's --hours, not a result
        hours_budget=hours_budget,
        gpu_hours=hours * inp.gpus if hours is not None else None,
        price_per_gpu_hour=inp.price_per_gpu_hour or None,
        cost=hours * inp.gpus * inp.price_per_gpu_hour if hours is not None and inp.price_per_gpu_hour else None,
        chinchilla_tokens=chinchilla_tokens,
        tokens_per_param=tokens / active_params if tokens is not None else None,
        chinchilla_ratio=tokens / chinchilla_tokens if tokens is not None else None,
        verdict=(chinchilla_verdict(tokens, active_params, total_flops)
                 if tokens is not None and total_flops is not None else None),
    )


def _time_limit(max_hours: float, limit: str, tokens: float, hours: float) -> str:
    """The limit's words when ``train.max_hours`` comes before the run's tokens (``limit``, the
    one that set them), which would take ``hours``."""
    return (f"train.max_hours ({max_hours:g} h, before {limit.split(' (')[0] or 'its tokens'}: "
            f"{_h(tokens)} tokens would take {hours:.3g} h)")


def wall_hours(total_flops: float, effective_flops: float) -> float:
    """The wall time, in hours, of ``total_flops`` at ``effective_flops`` = peak x GPUs x MFU: the
    one definition of a planned time. The MFU is end-to-end (communication, data and host time are
    in it), so nothing is added to this. The report's planned tokens/s is its inverse."""
    return total_flops / effective_flops / 3600


def tokens_in(hours: float, effective_flops: float, fpt: float) -> float:
    """The tokens ``hours`` of wall time afford at ``effective_flops``: :func:`wall_hours` inverted."""
    return hours * 3600 * effective_flops / fpt


def comm_hours(tokens: float | None, tokens_per_step: int, at_gpus: dict[str, Any]) -> float | None:
    """The part of the wall time the communication estimate of the scaling row at the GPUs planned
    would take (its per-step time x the steps), None on one GPU or without tokens."""
    if tokens is None or at_gpus["gpus"] <= 1 or not at_gpus["comm_s"]:
        return None
    return math.ceil(tokens / tokens_per_step) * at_gpus["comm_s"] / 3600


def predicted_range(band: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """The range of the figures :func:`tokens_time_cost` priced at a predicted rate (``figures``),
    by the prediction's error ``band`` (plan/accuracy.py: the real step is the predicted one times a
    ratio from ``low`` to ``high``): ``hours``, ``gpu_hours`` and ``cost`` times ``[low, high]`` --
    or, where the wall time is a budget (``--hours``, a run's ``train.max_hours``), the ``tokens`` it
    affords over ``[high, low]`` --, the others None; with the band's own ``low``, ``high``, ``cases``
    and ``regime``."""
    low, high = band["low"], band["high"]
    out: dict[str, Any] = {k: band[k] for k in ("low", "high", "cases", "regime")}

    budget = figures.get("hours_given") or figures.get("hours_budget")  # the wall time is a budget, not a result

    def times(key: str) -> list[float] | None:
        value = figures.get(key)
        return None if value is None or budget else [value * low, value * high]

    out.update(hours=times("hours"), gpu_hours=times("gpu_hours"), cost=times("cost"), tokens=None)
    if budget and figures.get("tokens") is not None:
        out["tokens"] = [figures["tokens"] / high, figures["tokens"] / low]
    return out


# Past this many epochs the plan warns: Muennighoff et al. 2023 ("Scaling Data-Constrained
# Language Models") found up to about 4 epochs of repeated data almost as good as new data,
# and each further repetition worth less, hardly anything past some 16.
EPOCHS_WARN = 4.0


def epochs_text(epochs: float) -> str:
    """``3.00 epochs``, ``7,565 epochs``: two decimals while they tell epochs apart."""
    return f"{epochs:.2f} epochs" if epochs < 100 else f"{epochs:,.0f} epochs"


def _data_epochs(inp: PlanInputs, tokens: float | None) -> dict[str, Any]:
    """``plan["data"]``: the data named (``inp.data_path``), its train tokens, the epochs the
    planned tokens make of them and, past :data:`EPOCHS_WARN`, the warning; None without data."""
    if not inp.data_path:
        return {"data": None}
    epochs = tokens / inp.data_train_tokens if tokens is not None and inp.data_train_tokens > 0 else None
    warning = epochs_warning(tokens or 0, inp.data_train_tokens, inp.data_path) if epochs is not None else None
    return {"data": {"path": inp.data_path, "train_tokens": inp.data_train_tokens, "epochs": epochs,
                     "warning": warning}}


def epochs_warning(tokens: float, train_tokens: int, data_path: str) -> str | None:
    """The warning when ``tokens`` are more than :data:`EPOCHS_WARN` passes over the
    ``train_tokens`` of ``data_path``, else None: the plan's and the preflight's one line."""
    if train_tokens <= 0 or tokens / train_tokens <= EPOCHS_WARN:
        return None
    return (f"{_h(tokens)} tokens are {epochs_text(tokens / train_tokens)} of the {train_tokens:,} train tokens "
            f"of {data_path}: past about {EPOCHS_WARN:g} epochs repeated tokens are worth less than new "
            "ones, and hardly anything after some 16 (Muennighoff et al. 2023, Scaling Data-Constrained "
            "Language Models); more data, fewer tokens or a smaller model")


# what the plan also prices the memory of: (label, the change to the memory settings)
MEMORY_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("sdpa", {"attention": "sdpa"}), ("eager", {"attention": "eager"}),
    ("sdpa+checkpointing", {"attention": "sdpa", "activation_checkpointing": "full"}))


def _memory_and_batch(inp: PlanInputs, n_params: int) -> dict[str, Any]:
    """Memory per GPU and whether it fits, with the batch it is counted at: the largest
    micro-batch that fits and the recommended batch (:func:`recommend_batch`), and the memory
    of :data:`MEMORY_VARIANTS`. With ``--params`` only the states are counted."""
    m, mem_bytes = inp.model, inp.gpu_memory_bytes
    if m is not None:
        max_micro = (max_micro_batch(m, inp.seq_len, mem_bytes, inp.memory, headroom=inp.headroom)
                     if mem_bytes else None)
        batch = recommend_batch(inp, max_micro)
        est = estimate(m, batch["micro_batch"], inp.seq_len, inp.memory)
        mem_total = est.total
        out: dict[str, Any] = {
            "memory": {"settings": _settings_dict(inp.memory), **est.gb()},
            "memory_variants": _memory_variants(inp, m, batch["micro_batch"]),
            "max_micro_batch": max_micro,
        }
    else:
        states = state_bytes(n_params, inp.memory)
        mem_total = sum(states.values())
        out = {
            "memory": {"settings": _settings_dict(inp.memory), **{k: v / GIB for k, v in states.items()},
                       "activations": None, "total": mem_total / GIB,
                       "counted": "parameters, gradients, optimizer states and master weights only: "
                                  "activations, logits and FSDP gather buffers are NOT counted (--params "
                                  "gives no model shape; give --model or --config to count them)"},
            "memory_variants": None,
            "max_micro_batch": None,
        }
        batch = recommend_batch(inp, None)
    out.update(memory_gb=mem_total / GIB, headroom=inp.headroom,
               fits=(mem_total <= inp.headroom * mem_bytes) if mem_bytes else None, batch=batch)
    return out


def _memory_variants(inp: PlanInputs, m: ModelConfig, micro_batch: int) -> dict[str, Any]:
    """Each of :data:`MEMORY_VARIANTS`: its memory per GPU at ``micro_batch``, and its own
    largest micro-batch that fits (None when the GPU's memory is unknown)."""
    mem_bytes = inp.gpu_memory_bytes
    variants = {}
    for label, change in MEMORY_VARIANTS:
        settings = replace(inp.memory, **change)
        variants[label] = {
            "total_gb": estimate(m, micro_batch, inp.seq_len, settings).total / GIB,
            "max_micro_batch": (max_micro_batch(m, inp.seq_len, mem_bytes, settings, headroom=inp.headroom)
                                if mem_bytes else None),
        }
    return variants


def _scaling_plan(inp: PlanInputs, fpt: float, batch: dict[str, Any], n_params: int) -> dict[str, Any]:
    """``plan["scaling"]``: the strategy's :func:`scaling` rows at 1, 2, 4, 8 (16 past 8) and
    the GPUs asked, each with the same global batch (under diloco and hsdp: one group below its
    size, whole groups above)."""
    counts_to = sorted({1, 2, 4, 8, inp.gpus} | ({16} if inp.gpus > 8 else set()))
    if inp.memory.strategy in ("diloco", "hsdp"):
        counts_to = [n for n in counts_to if n <= inp.group_gpus or n % inp.group_gpus == 0]
    rows = [scaling(inp, fpt, batch["tokens_per_step"], n_params, max(1, batch["grad_accum"] * inp.gpus // n), n)
            for n in counts_to]
    mine = next(r for r in rows if r["gpus"] == inp.gpus)
    out: dict[str, Any] = {
        "strategy": inp.memory.strategy,
        "assumption": ("communication not overlapped with compute"
                       if inp.mfu_compute or inp.memory.strategy == "diloco" else
                       "the step at the MFU, which holds its communication; comm: an unoverlapped estimate"),
        "at_gpus": mine,
        "table": rows,
    }
    if any(n > inp.gpus_per_node for n in counts_to):  # rows that cross nodes: the network they assumed
        network: dict[str, Any] = hardware.network_facts(inp.network) or {}  # validate() refused an unknown one
        out["network"] = {**network, "gpus_per_node": inp.gpus_per_node}
    return out


def _settings_dict(s: MemorySettings) -> dict[str, Any]:
    d = asdict(s)
    if s.strategy != "diloco":  # DiLoCo's own settings only where they apply (hsdp: its shard group)
        for key in ("inner_strategy", "outer_dtype") if s.strategy == "hsdp" else \
                ("inner_strategy", "group_size", "outer_dtype"):
            del d[key]
    return d


NOMINAL_MFU = 0.40


def memory_settings_for_run(cfg: "RunConfig", precision: str, loss: str = "plain", strategy: str = "single",
                            gpus: int = 1, gpus_per_node: int = 0) -> MemorySettings:
    """The memory model's settings for a run of ``cfg`` as it will run: ``precision`` the
    resolved ``train.precision`` (bf16, bf16-pure, fp16, float32: the memory model's names
    too), ``loss`` the resolved loss (plain; chunked; fused, Liger's kernel, which also never
    holds the full logits and is modelled as chunked), ``strategy`` the resolved
    ``parallel.strategy`` over ``gpus``. Activation checkpointing (none, full, selective
    with its every-k), the attention (eager or not), the micro-batches per step and whether
    it is compiled (``train.compile`` model or blocks, the loss in the graph under model; ``auto``
    as eager: resolve it first) are
    the config's. Under ``diloco`` so are ``parallel.inner_strategy`` and ``outer_dtype``, and
    the group is ``parallel.group_size`` ranks, its 0 meaning the ranks of one node:
    ``gpus_per_node`` when given, else all ``gpus``. Under ``hsdp`` the shard group is
    ``parallel.group_size`` ranks as given (the plan refuses one that does not divide ``gpus``),
    its 0 the ranks of one node as under diloco."""
    t = cfg.train
    pc = cfg.parallel
    groups: dict[str, Any] = {}  # diloco's and hsdp's own settings
    if strategy == "diloco":
        groups = dict(inner_strategy=pc.inner_strategy, outer_dtype=pc.outer_dtype,
                      group_size=min(pc.group_size or gpus_per_node or gpus, gpus))
    elif strategy == "hsdp":
        groups = dict(group_size=pc.group_size or min(gpus_per_node or gpus, gpus))
    return MemorySettings(
        precision=precision, attention="eager" if cfg.model.attention == "eager" else "sdpa",
        activation_checkpointing=t.activation_checkpointing,
        activation_checkpointing_every=t.activation_checkpointing_every,
        strategy=strategy, n_gpus=gpus,
        loss="plain" if loss == "plain" else "chunked", loss_chunk_tokens=t.loss_chunk_tokens,
        grad_accum=max(1, cfg.grad_accum_steps(gpus)), compiled=t.compile in ("model", "blocks"),
        loss_in_graph=t.compile == "model", **groups)


def peak_dtype(precision: str) -> str:
    """The hardware table's peak for a ``train.precision``: bf16, fp16, or fp32 for float32."""
    return {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16"}.get(precision, "fp32")


def planned_precision(precision: str, gpu: hardware.DeviceSpec | None) -> tuple[str, str]:
    """``(precision, note)``: ``train.precision`` as the trainer resolves it on ``gpu``
    (``auto``: bf16 on a GPU with bf16 -- or when no GPU is named --, fp16 on one without,
    like the V100 or T4); the note says what ``auto`` became (empty when it was not auto)."""
    if precision != "auto":
        return precision, ""
    if gpu is not None and gpu.bf16 is None:
        return "fp16", f"train.precision=auto is fp16 on the {gpu.name} (no bf16)"
    return "bf16", "train.precision=auto is bf16 on a GPU with bf16"


def planned_loss(t: "TrainConfig") -> tuple[str, str]:
    """``(loss, note)``: ``train.loss`` as the memory model sees it (plain or chunked) and,
    when that is not the name given, why: ``auto`` is plain under ``compile=model`` (and under
    ``compile=auto``, which is ``model`` on one GPU -- ``blocks`` under a data-parallel wrapper:
    ``flopwise plan`` resolves it first, with ``train/defaults.py``; the trainer picks the chunked loss instead
    when the full logits do not fit, which this plan then shows), else
    the chunked loss or, on CUDA with Liger-Kernel installed, the fused kernel -- which
    holds no full logits either and is modelled as chunked, as is ``fused``."""
    if t.loss in ("plain", "chunked"):
        return t.loss, ""
    if t.loss == "auto":
        if t.compile in ("model", "auto"):
            return "plain", f"train.loss=auto is plain under train.compile={t.compile} (compiled on a GPU)"
        return "chunked", "train.loss=auto is chunked (or fused on CUDA with Liger-Kernel: planned alike)"
    return "chunked", "train.loss=fused is planned as chunked (no full logits either)"


def plan_inputs_for_run(cfg: "RunConfig", gpus: int = 1, gpu: hardware.DeviceSpec | None = None,
                        strategy: str = "", gpus_per_node: int = 0) -> tuple[dict[str, Any], list[str]]:
    """What ``flopwise plan --config RUN.yaml`` plans: the run's own model, seq_len,
    micro-batch, accumulation (its global batch over ``gpus``), token budget, precision,
    loss, activation checkpointing (and its every-k), attention, strategy (its
    ``parallel.strategy`` unless ``strategy`` is given; ``auto`` stays the planner's choice,
    as the trainer's is), under diloco its inner steps, inner strategy, group size and outer
    dtype, and peak TFLOP/s. Returns ``(PlanInputs fields, notes)``: the notes
    say how each ``auto`` was resolved. A global batch that ``gpus`` cannot split is a PlanError."""
    t = cfg.train
    split = batch_split_problems(t, gpus)
    if split:
        raise PlanError(f"{split[0]} (with --gpus {gpus})")
    precision, note_p = planned_precision(t.precision, gpu)
    loss, note_l = planned_loss(t)
    run_strategy = "" if cfg.parallel.strategy == "auto" else cfg.parallel.strategy
    if run_strategy == "single" and gpus > 1:
        run_strategy = ""  # the trainer's `single` is one process: over several GPUs, plan as auto
    planned = strategy or run_strategy or ("ddp" if gpus > 1 else "single")
    fields = dict(
        model=cfg.model, seq_len=t.seq_len, micro_batch=t.micro_batch_size, grad_accum=cfg.grad_accum_steps(gpus),
        tokens=cfg.total_steps() * cfg.tokens_per_step, limit=cfg.step_limit(), max_hours=t.max_hours,
        peak_tflops=t.peak_tflops, dtype=peak_dtype(precision),
        memory=memory_settings_for_run(cfg, precision, loss, planned, gpus, gpus_per_node),
        auto_strategy=not (strategy or run_strategy),
    )
    if planned == "diloco":
        fields["inner_steps"] = cfg.parallel.inner_steps
    return fields, [n for n in (note_p, note_l) if n]


def run_plan_inputs(cfg: "RunConfig", device_name: str | None, precision: str, *, loss: str = "plain",
                    gpus: int = 1, strategy: str = "single", gpus_per_node: int = 0) -> PlanInputs:
    """What :func:`plan_for_run` plans (the arguments are its): also what the trainer's
    memory check (``plan/fit.py``) asks :func:`fit_suggestions` about."""
    spec = hardware.lookup(device_name) if device_name else None
    dtype = peak_dtype(precision)
    if spec is not None and getattr(spec, dtype) is None:
        spec = None  # e.g. bf16 on a V100: no peak to plan against
    inp = PlanInputs(
        model=cfg.model, model_name=cfg.preset, gpu=spec, peak_tflops=cfg.train.peak_tflops, dtype=dtype,
        gpus=gpus, mfu=NOMINAL_MFU,
        tokens=cfg.total_steps() * cfg.tokens_per_step, limit=cfg.step_limit(), max_hours=cfg.train.max_hours,
        seq_len=cfg.train.seq_len, micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.grad_accum_steps(gpus),
        memory=memory_settings_for_run(cfg, precision, loss, strategy, gpus, gpus_per_node),
    )
    if gpus_per_node > 0:
        inp.gpus_per_node = gpus_per_node
    if strategy == "diloco":
        inp.inner_steps = cfg.parallel.inner_steps
    return inp


def plan_for_run(cfg: "RunConfig", device_name: str | None, precision: str, *, loss: str = "plain",
                 gpus: int = 1, strategy: str = "single", gpus_per_node: int = 0) -> dict[str, Any]:
    """The plan of a training run as configured, written by ``flopwise train`` as ``plan.json``.

    What the config settles comes from ``cfg``: the model, the batch, the token budget and
    ``train.peak_tflops`` (0: the hardware table's peak). The rest is how the trainer resolved
    the run on this machine: ``device_name`` is the CUDA device's name (None on CPU, where no
    peak is known); ``precision`` the resolved one (bf16, bf16-pure, fp16 or float32), which
    picks the peak (:func:`peak_dtype`) and the memory model's precision; ``loss`` and
    ``strategy`` the resolved ``train.loss`` and ``parallel.strategy`` over ``gpus`` ranks
    (:func:`memory_settings_for_run`); ``gpus_per_node`` the ranks of one host (0: unknown, then
    a diloco group of ``parallel.group_size=0`` is all ``gpus``). The MFU is the nominal
    :data:`NOMINAL_MFU`.
    """
    plan = build_plan(run_plan_inputs(cfg, device_name, precision, loss=loss, gpus=gpus, strategy=strategy,
                                      gpus_per_node=gpus_per_node))
    plan["device"] = device_name or "cpu"
    return plan
