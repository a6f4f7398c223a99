"""Data parallelism: which strategy, and what it wraps around the model and the optimizer.

- ``single``: one process, nothing wrapped.
- ``ddp``: every rank holds the whole model; gradients are averaged by DDP's bucketed
  all-reduce (``parallel.bucket_mb``), overlapped with the backward. Only the last
  micro-batch of an accumulation synchronises (``no_sync`` on the others).
- ``zero1``: DDP for the gradients, and ``ZeroRedundancyOptimizer``: each rank keeps the
  AdamW state of ~1/N of the parameters, steps those and broadcasts them (one flat bucket
  per rank: ``parameters_as_bucket_view``).
- ``fsdp2``: ``fully_shard`` on every transformer block and then on the root (embedding,
  final norm, head): parameters, gradients and optimizer state are all sharded; a block's
  weights are gathered just before it runs. Under bf16 a ``MixedPrecisionPolicy``
  gathers bf16 weights and reduces gradients in float32 (the sharded fp32 parameters are
  the master copy). ``parallel.reshard_after_forward=false`` keeps gathered blocks until
  backward (less communication, more memory).
- ``hsdp``: FSDP2 over a 2-D device mesh (``fully_shard`` with it, torch's own hybrid
  sharding): sharded within a group of ``parallel.group_size`` ranks (0: one node), each group a
  replica of the others; a step's gradients are reduce-scattered within the group and the
  shards all-reduced across groups -- the one collective that crosses the slower network.
- ``diloco``: worker groups that train apart for ``parallel.inner_steps`` steps and
  all-reduce the change once (``parallel/diloco.py``); inside a group ``parallel.inner_strategy``
  (ddp or fsdp2) over the group's own process group (``DistEnv.group``).
- ``auto``: single with one process; otherwise the first of ddp, zero1, fsdp2 whose
  memory model (``plan/memory.py``) fits the GPU, with the reason logged.

DDP does not broadcast buffers before each forward (``broadcast_buffers=False``, named
``forward_sync_buffers`` from torch 2.13): the RoPE tables are computed from the config,
the same on every rank.

Wrapping order, in one place (``wrap.py`` then :func:`apply_data_parallel`): activation
checkpointing -> compile -> DDP/FSDP. Checkpoint formats: see ``train/dist_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flopwise.config import ConfigError, RunConfig
from flopwise.parallel.diloco import group_size, layout_problems
from flopwise.parallel.distributed import DistEnv
from flopwise.plan.budget import memory_settings_for_run
from flopwise.plan.fit import local_rank_count
from flopwise.plan.memory import SHARDED, estimate, numerics_change

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

HEADROOM = 0.9  # share of the GPU the memory model's peak may take for auto to pick a strategy


def shards_parameters(strategy: str) -> bool:
    """Whether ``strategy`` shards parameters with FSDP2 (fsdp2 over every rank, hsdp within groups)."""
    return strategy in SHARDED  # the planner's vocabulary: one list for planning and training


def is_fsdp_module(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` made ``model`` an FSDP2 module. FSDP is not imported to ask (about
    1 s of CPU in a process that has not loaded it): a process that never imported it has none."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


@dataclass
class Strategy:
    name: str  # single | ddp | zero1 | fsdp2 | hsdp | diloco
    why: str  # one line for the log
    inner: str = ""  # diloco: what wraps the model inside a worker group (ddp, fsdp2; single for one rank)

    @property
    def step(self) -> str:
        """What wraps the model and syncs its gradients in the step (diloco: the inner strategy)."""
        return self.inner or self.name


def predicted_peak(cfg: RunConfig, strategy: str, world: int, precision: str, loss: str) -> int:
    """The memory model's per-GPU peak bytes for one training step under ``strategy``."""
    settings = memory_settings_for_run(cfg, precision, loss, strategy, world, local_rank_count(world))
    return estimate(cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len, settings).total


def hsdp_layout_problems(cfg: RunConfig, world: int | None) -> list[str]:
    """Why ``world`` ranks cannot be cut into HSDP's shard groups (empty when they can, or when
    the world is not known yet)."""
    if world is None:
        return []
    size = group_size(cfg.parallel, world)
    if world % size:
        pc = cfg.parallel
        how = f"parallel.group_size={pc.group_size}" if pc.group_size else f"the {size} ranks per node"
        return [f"parallel.strategy=hsdp: {how} does not divide the {world} ranks into whole shard groups; "
                f"set parallel.group_size to a divisor of {world}"]
    return []


def incompatibilities(cfg: RunConfig, strategy: str, precision: str, world: int | None = None) -> list[str]:
    """Why ``strategy`` cannot run this configuration (empty when it can); ``world``: the ranks,
    when known (HSDP's groups must divide them)."""
    out = []
    if strategy == "diloco":
        return [p.replace(f"parallel.strategy={cfg.parallel.inner_strategy}",
                          f"parallel.strategy=diloco with parallel.inner_strategy={cfg.parallel.inner_strategy}")
                for p in incompatibilities(cfg, cfg.parallel.inner_strategy, precision)]
    if strategy == "hsdp":
        return [p.replace("parallel.strategy=fsdp2", "parallel.strategy=hsdp") for p in incompatibilities(
            cfg, "fsdp2", precision)] + hsdp_layout_problems(cfg, world)
    if strategy in ("zero1", "fsdp2") and cfg.optim.name == "muon":
        out.append(f"parallel.strategy={strategy} with optim.name=muon: Muon orthogonalises whole matrices and "
                   "this strategy splits the optimizer state; use ddp (Muon's state is replicated) or optim.name=adamw")
    if strategy == "zero1" and cfg.train.fp8 and cfg.train.fp8_recipe == "mxfp8":
        out.append("parallel.strategy=zero1 with train.fp8_recipe=mxfp8: ZeRO-1 broadcasts each rank's updated "
                   "weights into flat buckets that torchao's MXFP8 weight wrappers do not read, so the ranks would "
                   "drift apart silently (seen at 2 ranks); use ddp or fsdp2")
    if strategy == "fsdp2" and precision == "bf16-pure":
        out.append("parallel.strategy=fsdp2 with train.precision=bf16-pure: FSDP2 keeps sharded fp32 weights and "
                   "computes in bf16 through its MixedPrecisionPolicy already; use train.precision=bf16")
    if strategy == "fsdp2" and precision == "fp16":
        out.append("parallel.strategy=fsdp2 with train.precision=fp16: the gradient scaler is not wired for "
                   "sharded gradients; use bf16 (or ddp/zero1 for fp16)")
    return out


def resolve_strategy(cfg: RunConfig, env: DistEnv, device: torch.device, precision: str, loss: str,
                     capacity: int | None = None) -> Strategy:
    """The strategy to run, explained; a requested one that cannot run is a ConfigError.
    ``capacity``: bytes of one GPU (default: this rank's CUDA device; none on a CPU)."""
    asked = cfg.parallel.strategy
    world = env.world_size
    if asked != "auto":
        problems = incompatibilities(cfg, asked, precision, world)
        if problems:
            raise ConfigError(problems)
        if asked == "single":
            return Strategy("single", "parallel.strategy=single")
        if asked == "diloco":
            return diloco_strategy(cfg, world)
        if asked == "hsdp":
            size = group_size(cfg.parallel, world)
            return Strategy("hsdp", f"parallel.strategy=hsdp over {world} rank(s): sharded within {world // size} "
                                    f"group(s) of {size}, replicated across them")
        return Strategy(asked, f"parallel.strategy={asked} over {world} rank(s)")
    if not env.distributed or world == 1:
        return Strategy("single", "auto: one process")
    if capacity is None and device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    if capacity is None:
        return Strategy("ddp", f"auto: {world} CPU ranks, no device memory limit to plan against: ddp")
    budget = HEADROOM * capacity
    tried = []
    for name in ("ddp", "zero1", "fsdp2"):
        if incompatibilities(cfg, name, precision):
            continue
        need = predicted_peak(cfg, name, world, precision, loss)
        tried.append(f"{name} {need / 2**30:.1f} GiB")
        if need <= budget:
            change = numerics_change(name, "ddp", precision)  # ddp's numbers are auto's reference
            return Strategy(name, f"auto: predicted peak per GPU {', '.join(tried)} of {capacity / 2**30:.0f} GiB "
                                  f"(x{HEADROOM:g} headroom): {name}" + (f" ({change}: the others do not fit)"
                                                                         if change else ""))
    fallback = "fsdp2" if not incompatibilities(cfg, "fsdp2", precision) else "ddp"
    return Strategy(fallback, f"auto: nothing fits the memory model's {budget / 2**30:.1f} GiB ({', '.join(tried)}); "
                              f"{fallback}, the most frugal that runs this config -- lower train.micro_batch_size "
                              "or turn on train.activation_checkpointing")


def diloco_strategy(cfg: RunConfig, world: int) -> Strategy:
    """DiLoCo's layout at ``world`` ranks, or a ConfigError when the groups do not divide it."""
    problems = layout_problems(cfg.parallel, world)
    if problems:
        raise ConfigError(problems)
    pc, size = cfg.parallel, group_size(cfg.parallel, world)
    inner = pc.inner_strategy if size > 1 else "single"
    streaming = (f", streaming in {pc.fragments} fragments" + (f" overlapped over {pc.overlap_steps} step(s)"
                                                               if pc.overlap_steps else "")) if pc.fragments > 1 else ""
    return Strategy("diloco", f"parallel.strategy=diloco: {world // size} group(s) of {size} rank(s) ({inner} inside), "
                              f"outer sync every {pc.inner_steps} steps (Nesterov lr {pc.outer_lr:g}, momentum "
                              f"{pc.outer_momentum:g}, {pc.outer_dtype}){streaming}", inner=inner)


# --------------------------------------------------------------------------- model and optimizer

def apply_data_parallel(model: torch.nn.Module, strategy: str, env: DistEnv, device: torch.device,
                        cfg: RunConfig, compute_dtype: torch.dtype | None) -> tuple[torch.nn.Module, list[str]]:
    """Wrap (DDP) or shard (FSDP2, in place) the already checkpointed/compiled model.

    Returns the module the training step calls and notes for the log. Under FSDP2 that is
    ``model`` itself (``fully_shard`` changes the module in place); under DDP a wrapper
    whose ``.module`` is ``model``."""
    pc = cfg.parallel
    if strategy == "single":
        return model, []
    if strategy in ("ddp", "zero1"):
        # No buffer broadcast before each forward: the only buffers are the RoPE cos/sin tables,
        # a deterministic function of the config (non-persistent), identical on every rank, so
        # broadcasting them from rank 0 would be a wasted collective per micro-batch. torch
        # >= 2.13 names the switch forward_sync_buffers (broadcast_buffers is deprecated there).
        no_sync: dict[str, Any] = ({"forward_sync_buffers": False}
                                   if "forward_sync_buffers" in inspect.signature(DDP).parameters
                                   else {"broadcast_buffers": False})
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      bucket_cap_mb=pc.bucket_mb, gradient_as_bucket_view=True, process_group=env.group, **no_sync)
        return wrapped, [f"DDP: gradients all-reduced in {pc.bucket_mb:g} MB buckets during backward, once per "
                         "step (no_sync on the earlier micro-batches)"]
    if shards_parameters(strategy):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: ~4 s to import; fsdp2 only

        mp = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
              if compute_dtype is not None and compute_dtype != torch.float32 else MixedPrecisionPolicy())
        mesh: dict[str, Any] = {}
        if strategy == "hsdp":  # a 2-D mesh: fully_shard replicates over dim 0 and shards over dim 1
            mesh["mesh"] = hsdp_mesh(cfg, env, device)
        elif env.group is not None:  # a DiLoCo worker group: sharded over its ranks only
            from torch.distributed.device_mesh import DeviceMesh  # lazy: with fully_shard

            mesh["mesh"] = DeviceMesh.from_group(env.group, device.type)
        for block in cast(torch.nn.ModuleList, model.layers):  # a flopwise Transformer's blocks
            fully_shard(block, mp_policy=mp, reshard_after_forward=pc.reshard_after_forward, **mesh)
        # The root (embedding, final norm, head) stays gathered after forward: backward needs it
        # at once, and a loss that applies the head itself (chunked) reads it after forward.
        fully_shard(model, mp_policy=mp, reshard_after_forward=False, **mesh)
        gathered = f"gathered in {str(mp.param_dtype).replace('torch.', '')}" if mp.param_dtype else "gathered in fp32"
        where = f"over {env.world_size} rank(s)"
        if strategy == "hsdp":
            size = mesh["mesh"].size(1)
            where = (f"within {env.world_size // size} group(s) of {size} rank(s), each group a replica (HSDP: "
                     "gradient shards all-reduced across the groups)")
        return model, [f"FSDP2: parameters, gradients and optimizer state sharded {where}; "
                       f"each block {gathered}, reduced in fp32"
                       + ("; blocks resharded after forward" if pc.reshard_after_forward else
                          "; blocks kept gathered until backward (parallel.reshard_after_forward=false)")]
    raise ValueError(f"unknown strategy {strategy!r}")


def zero1_optimizer(plain: Any) -> torch.optim.Optimizer:
    """A ``ZeroRedundancyOptimizer`` with ``plain``'s parameter groups and hyper-parameters
    (``plain`` -- built by ``build_optimizer`` and never stepped -- is discarded). Anything but
    an AdamW (Muon's combined optimizer included) is refused."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # lazy: ~1.5 s to import; zero1 only

    if not isinstance(plain, torch.optim.AdamW):
        raise ConfigError(["parallel.strategy=zero1 shards AdamW's state; optim.name must be adamw"])
    groups = [dict(g) for g in plain.param_groups]
    keys = ("lr", "betas", "eps", "weight_decay", "fused", "foreach")
    defaults = {k: plain.defaults[k] for k in keys if plain.defaults.get(k) is not None}
    # parameters_as_bucket_view: each rank's parameters live in one flat bucket per device, so
    # the post-step parameter sync is one broadcast per rank instead of one per tensor. Correct
    # here: every parameter it sees has one dtype (fp32; under bf16-pure it steps the fp32
    # master copy), all are trainable, and checkpoints load with load_state_dict's in-place
    # copy, which writes into the bucket views (an assignment of .data would detach them).
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(plain), parameters_as_bucket_view=True, **defaults)


def hsdp_mesh(cfg: RunConfig, env: DistEnv, device: torch.device) -> Any:
    """HSDP's 2-D device mesh: (replicas, ranks of a group), groups of ``parallel.group_size``
    consecutive ranks (0: one node's), so a group's all-gathers and reduce-scatters stay on the
    node's links and only the shards' all-reduce crosses between nodes."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: with fully_shard

    size = group_size(cfg.parallel, env.world_size)
    return init_device_mesh(device.type, (env.world_size // size, size), mesh_dim_names=("replicate", "shard"))


def grad_sync(wrapped: torch.nn.Module, strategy: str,
              accum: int) -> Callable[[int], contextlib.AbstractContextManager]:
    """``sync(i)`` for ``forward_backward`` of a step of ``accum`` micro-batches: gradients are
    reduced only on its last one. Made per step: under a batch ramp ``accum`` changes."""

    def sync(i: int) -> contextlib.AbstractContextManager:
        last = i == accum - 1
        if strategy in ("ddp", "zero1"):
            return contextlib.nullcontext() if last else cast(DDP, wrapped).no_sync()
        if shards_parameters(strategy):
            cast("FSDPModule", wrapped).set_requires_gradient_sync(last)  # fully_shard made it one
        return contextlib.nullcontext()

    return sync


def replica_group(strategy: str, env: DistEnv) -> dist.ProcessGroup | None:
    """The ranks that hold the whole model and, after the backward, the same averaged gradients:
    DDP's group (a DiLoCo worker group, else all ranks). An optimizer splits over it the work each
    of them would repeat (Muon's Newton-Schulz). None without such a group of 2 ranks or more
    (one process; ZeRO-1 and FSDP2 shard the optimizer themselves)."""
    if strategy != "ddp" or not env.distributed:
        return None
    group = env.group if env.group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def grads_set_to_none(strategy: str) -> bool:
    """Whether ``zero_grad`` drops the gradients (``set_to_none=True``) or zeroes them in place.

    In place under DDP and ZeRO-1: their gradients are views of DDP's buckets
    (``gradient_as_bucket_view``), which exist for the whole run. Dropped, each step's
    gradients would be fresh tensors that DDP copies into the buckets at the last
    micro-batch, a second copy of every gradient at the peak (the dry run's trace of
    smollm-135m at 8 ranks: +0.50 GiB, exactly its fp32 gradients)."""
    return strategy not in ("ddp", "zero1")


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm (over all ranks' shards under FSDP2), clipped to ``max_norm``."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and hasattr(grads[0], "to_local"):
        # FSDP2: this rank's shards' sums of squares, summed over ranks. (Not the DTensor
        # norm: torch's CPU float32 norm kernel is off by ~1e-4 relative on large tensors, and
        # differently for each way of cutting them; a sum of squares is accurate.)
        # Under HSDP the mesh is 2-D and each group holds the same shards: summed over the dim
        # the gradients are sharded on (the group's), not over the replicas.
        shards = cast("list[DTensor]", grads)  # FSDP2's gradients: DTensors (to_local)
        squared = torch.stack([g.to_local().float().pow(2).sum() for g in shards]).sum()
        mesh, placements = shards[0].device_mesh, shards[0].placements
        dim = next(i for i, p in enumerate(placements) if p.is_shard()) if mesh.ndim > 1 else 0
        dist.all_reduce(squared, group=mesh.get_group(mesh_dim=dim))
        total = squared.sqrt()
    else:
        total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
