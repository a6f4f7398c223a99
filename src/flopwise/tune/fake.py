"""A GPU that is not there: the fake-CUDA environment the dry run traces the training step in.

Under ``FakeTensorMode`` every op runs its shape and dtype logic and allocates nothing, so the
trainer's own step can run on tensors that say ``cuda`` on a machine without one. What a CPU
build of torch lacks for that, and what flopwise's CUDA path asks of the device, is supplied
here, all in one place (:func:`install`), in the worker process only:

- the C++ shim (``shim.py``, preloaded) answers device guards and CUDA hooks;
- ``torch.cuda`` answers for the GPU being traced: its name, compute capability, memory and
  count; streams and events are the generic ones, served by the shim's no-op guard;
- SDPA takes the kernel a CUDA build would choose (:func:`cuda_sdpa_choice`): a CPU build's
  fake tensors would silently take the math kernel and store (B, H, T, T) scores;
- ``torch.compile`` traces with a device-agnostic backend (no Triton): AOTAutograd with the
  min-cut partitioner inductor uses, so the saved activations are the compiled step's;
- the model is built as ``build_model`` builds it, minus the random values (none exist);
- DDP skips the cross-rank checks and broadcasts that read storage, and reduces buckets through
  a Python hook (the fake process group's works carry no tensors); its bucket order is kept;
- FSDP2's default device mesh is built outside fake mode (its rank map is read on the host);
- bf16-pure's deep copy of the model stays in the one fake mode.

Recorders that need no dispatch mode (one on the stack makes dynamo skip compiling without a
word): :class:`LiveMemory` counts every fake storage as it is made and freed. Recorders that
do: :class:`StepWatch` (host reads and collectives). ``tune/worker.py`` uses them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import re
import traceback
import types
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._dynamo  # noqa: F401 - loaded before anything is patched or built (see below)
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import flopwise.model.moe as moe
import flopwise.model.transformer as transformer
import flopwise.parallel.strategy as parallel
import flopwise.train.precision as precision
import flopwise.train.setup as setup


@dataclass(frozen=True)
class FakeGpu:
    name: str  # as torch.cuda.get_device_name reports it
    capability: tuple[int, int]
    memory_bytes: int
    count: int = 8  # GPUs torch.cuda says this node has


def shim_loaded() -> bool:
    """Whether the C++ shim is in this process (preloaded before torch initialised CUDA)."""
    import ctypes
    try:
        return bool(ctypes.CDLL(None).flopwise_fake_cuda_shim())
    except AttributeError:
        return False


_installed = False


def install(gpu: FakeGpu) -> None:
    """Make this process trace for ``gpu``, before building anything; once (a second call is a no-op).

    dynamo is imported with this module, before anything is patched or built: the patches below
    set its and functorch's configs, and a training process has it loaded before its model's
    parameters are made (torch's initialisers import it). Left to load on first use, inside
    the first trace, that trace failed ("Couldn't swap Embedding.weight": a weak reference to
    it) and the next ones found no ``torch._functorch.config``."""
    global _installed
    if _installed:
        return
    _installed = True
    _patch_cuda(gpu)
    _patch_streams()
    _patch_sdpa(gpu.capability)
    _patch_compile()
    _patch_device_mesh()
    _patch_ddp()
    _patch_flopwise(gpu)
    _patch_mxfp8()


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=False)


# --------------------------------------------------------------------------- torch.cuda

def _patch_cuda(gpu: FakeGpu) -> None:
    c: Any = torch.cuda  # patched: its functions replaced by looser ones (fake props, any device argument)
    props = types.SimpleNamespace(name=gpu.name, total_memory=gpu.memory_bytes, major=gpu.capability[0],
                                  minor=gpu.capability[1], multi_processor_count=132, is_integrated=False)
    c.is_available = lambda: True
    c.is_bf16_supported = lambda *a, **k: gpu.capability >= (8, 0)
    c.device_count = lambda: gpu.count
    c.current_device = lambda: 0
    c.set_device = lambda d: None
    c.synchronize = lambda *a, **k: None
    c.get_device_name = lambda d=None: gpu.name
    c.get_device_capability = lambda d=None: gpu.capability
    c.get_device_properties = lambda d=None: props
    c._lazy_init = lambda: None  # torch.accelerator's device index calls it back
    c.is_initialized = lambda: True

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        # dynamo saves and restores it around tracing; a recomputed random op (flash attention
        # in a checkpointed region) receives it in the step's own fake mode, where it is made
        return torch.zeros(16, dtype=torch.uint8)

    c.get_rng_state = get_rng_state
    c.get_rng_state_all = lambda: [get_rng_state()]
    c.set_rng_state = lambda *a, **k: None
    c.set_rng_state_all = lambda *a, **k: None
    # nn.Module._apply on fake tensors replaces parameters rather than swapping their payloads
    torch.__future__.set_overwrite_module_params_on_conversion(True)


def _patch_streams() -> None:
    """The CPU build's torch.cuda.Stream/Event are placeholders that raise; FSDP2 and DDP use
    them. The generic torch.Stream/Event on "cuda" go through the shim's guard: every stream is
    the default one and events are complete, so the order of work is not modelled."""
    c: Any = torch.cuda  # patched: its Stream/Event classes replaced by factories of the generic ones
    c.Stream = lambda device=None, priority=0, **kw: torch.Stream(device="cuda", priority=priority)
    c.Event = lambda enable_timing=False, blocking=False, interprocess=False: torch.Event(
        device="cuda", enable_timing=enable_timing)
    c.current_stream = lambda device=None: torch.accelerator.current_stream()
    c.default_stream = lambda device=None: torch.accelerator.current_stream()
    c.set_stream = lambda s: torch.accelerator.set_stream(s)

    @contextlib.contextmanager
    def stream(s: Any):
        if s is None:
            yield
            return
        previous = torch.accelerator.current_stream()
        torch.accelerator.set_stream(s)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    c.stream = stream


# --------------------------------------------------------------------------- attention

SDPA_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
SDPA_CHOICES: Counter = Counter()  # kernel name -> calls, outside compiled graphs
SDPA_ORDER: list[str] = []  # why SDPA tries the kernels in the order it does on the traced GPU (sdpa_order)
_sdpa = torch.nn.functional.scaled_dot_product_attention

# The cuDNN runtime PyPI's default CUDA wheel of each torch release bundles (its nvidia-cudnn
# requirement, read from the index): 2.9 and 2.10 are CUDA 12.8 builds with cuDNN 9.10; from 2.11
# the default wheel is a CUDA 13 build (cuDNN 9.19 in 2.11, 9.20 in 2.12, 9.24 in 2.14.1).
BUNDLED_CUDNN = ((2, 9), (9, 10)), ((2, 11), (9, 19))
CUDNN_FIRST_FROM = (9, 16)  # sdp_utils.cpp: cuDNN goes first only with a runtime cuDNN above 9.15.0
CUDNN_FIRST_ARCHS = {9, 10}  # sm90, sm100 and sm103 (majors 9 and 10; any minor on a CUDA 13 build)


def sdpa_order(capability: tuple[int, int], torch_version: str, environ: dict[str, str]) -> tuple[bool, str]:
    """Whether SDPA tries cuDNN's attention first on a GPU of ``capability`` with the CUDA wheel
    of ``torch_version``, and why, in words. From PyTorch 2.9 ``sdp_utils.cpp`` puts cuDNN first
    on sm90 and sm100 when the runtime cuDNN is above 9.15 and ``TORCH_CUDNN_SDPA_DEPRIORITIZED``
    is not set; elsewhere flash comes first. The tracing torch is a CPU build, so the cuDNN is
    the one its release's default CUDA wheel bundles (:data:`BUNDLED_CUDNN`)."""
    arch = f"sm{capability[0]}{capability[1]}"
    if capability[0] not in CUDNN_FIRST_ARCHS:
        return False, f"flash first: PyTorch prefers cuDNN's attention only on sm90/sm100, not {arch}"
    release = tuple(int(x) for x in re.findall(r"\d+", torch_version)[:2])
    if release < (2, 9):
        return False, f"flash first: torch {torch_version} predates cuDNN-first SDPA (PyTorch 2.9)"
    if environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") not in ("", "0"):
        return False, "flash first: TORCH_CUDNN_SDPA_DEPRIORITIZED is set"
    since, cudnn = max((since, c) for since, c in BUNDLED_CUDNN if release >= since)
    wheel = (f"torch {'.'.join(map(str, release))}'s CUDA wheel bundles cuDNN "
             f"{'≥ ' if release > since else ''}{cudnn[0]}.{cudnn[1]}")
    if cudnn < CUDNN_FIRST_FROM:
        return False, f"flash first: {wheel}; PyTorch puts cuDNN first on {arch} only above cuDNN 9.15"
    return True, f"cuDNN first on {arch}: {wheel}, above 9.15; TORCH_CUDNN_SDPA_DEPRIORITIZED=1 asks for flash"


def cuda_sdpa_choice(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None,
                     capability: tuple[int, int], cudnn_first: bool = False) -> int:
    """The kernel a CUDA build of torch picks for SDPA (``sdp_utils.cpp``, its main rules): with
    ``cudnn_first`` (:func:`sdpa_order`) cuDNN's for fp16/bf16 at head_dim <= 128 and a multiple
    of 8 (GQA and masks included; 256 needs a cuDNN newer than the wheels', not assumed); then
    flash for fp16/bf16 without a mask, head_dim <= 256 and a multiple of 8, on sm80+ (GQA
    included); memory-efficient with a mask when query and key heads match (it takes no GQA);
    else math."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    hd = q.shape[-1]
    if cudnn_first and half and hd <= 128 and hd % 8 == 0:
        return 3
    if half and attn_mask is None and hd <= 256 and hd % 8 == 0 and capability >= (8, 0):
        return 1
    if q.shape[1] == k.shape[1] and hd % 8 == 0:
        return 2
    return 0


def _bias(attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """An SDPA mask as the fused kernels take it: a boolean mask turned into a -inf bias, as CUDA
    SDPA does, expanded to (batch, heads, queries, keys)."""
    if attn_mask is None:
        return None
    bias = attn_mask
    if bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill_(~bias, float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _patch_sdpa(capability: tuple[int, int]) -> None:
    cudnn_first, why = sdpa_order(capability, torch.__version__, dict(os.environ))
    SDPA_ORDER[:] = [why]

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "cuda":
            return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        choice = cuda_sdpa_choice(q, k, attn_mask, capability, cudnn_first)
        if not torch.compiler.is_compiling():  # a global changed while tracing would guard and recompile
            SDPA_CHOICES[SDPA_KERNELS[choice]] += 1
        if choice == 3:
            return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, _bias(attn_mask, q, k), True, dropout_p,
                                                                      is_causal, False, scale=scale)[0]
        if choice == 1:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
        if choice == 2:
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, _bias(attn_mask, q, k), True,
                                                                          dropout_p, is_causal, scale=scale)[0]
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = sdpa


# --------------------------------------------------------------------------- compile

COMPILED_BACKEND_NAME = "aot_eager_decomp_partition"
SAVED: list[dict[str, Any]] = []  # each backward graph compiled: what the partitioner saved for it


def _saved_activations(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """The storage a backward graph takes from its forward (its inputs but the incoming
    gradients; views of one storage counted once), split into activations -- tensors with the
    batch's leading dimension, or its batch x time rows -- and the rest (parameters, their
    compute-dtype copies, RoPE tables)."""
    vals = [node.meta.get("val") for node in gm.graph.nodes
            if node.op == "placeholder" and not node.name.startswith("tangents")]
    vals = [v for v in vals if isinstance(v, torch.Tensor)]
    big = max((v for v in vals if v.dim() >= 3), key=lambda v: v.numel(), default=None)
    batch, rows = (big.shape[0], big.shape[0] * big.shape[1]) if big is not None else (None, None)
    acts, other, seen = 0, 0, set()
    for v in vals:
        storage = v.untyped_storage()
        if storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        if batch is not None and (v.dim() >= 3 and v.shape[0] == batch or v.dim() == 2 and v.shape[0] == rows):
            acts += storage.nbytes()
        else:
            other += storage.nbytes()
    return {"activation_bytes": acts, "other_bytes": other}


def traced_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """``aot_eager_decomp_partition`` (inductor's decompositions and min-cut partitioner, no
    code generation) that also records each backward graph's saved tensors in :data:`SAVED`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    def backward(bw: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        SAVED.append(_saved_activations(bw))
        return boxed_nop(bw, inputs)

    with functorch_config.patch({"unlift_effect_tokens": True}):
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=backward, decompositions=select_decomp_table,
                            partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                           compiler="inductor"))(gm, example_inputs)


COMPILED_BACKEND = traced_backend


def _patch_compile() -> None:
    """Whatever mode flopwise asks for, trace with :data:`COMPILED_BACKEND`: the same graphs,
    breaks and recompiles, and the activations the partitioner saves for backward."""
    compile_ = torch.compile

    def compile_traced(model: Any = None, **kwargs: Any):
        kwargs.pop("mode", None)
        kwargs.pop("options", None)
        kwargs["backend"] = COMPILED_BACKEND
        return compile_(model, **kwargs) if model is not None else compile_(**kwargs)

    torch.compile = compile_traced
    # Recomputed random ops (checkpointed regions) carry the CUDA generator's state through the
    # graph; a CPU build has no CUDA generators to clone: the older functionalisation instead.
    torch._functorch.config.graphsafe_rng_functionalization = False
    # DDP's graph split at bucket boundaries (DDPOptimizer) re-fakes the step's own fake
    # parameters in a mode of its own ("Mixing fake modes"); a trace does not model the
    # overlap it is for, so the graphs are traced whole.
    torch._dynamo.config.optimize_ddp = False
    module_compile = torch.nn.Module.compile

    def compile_module(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("mode", None)
        kwargs.pop("options", None)
        module_compile(self, backend=COMPILED_BACKEND, **kwargs)

    torch.nn.Module.compile = compile_module  # type: ignore[method-assign]  # the traced backend, always


# --------------------------------------------------------------------------- data parallel

def _patch_device_mesh() -> None:
    """fully_shard builds its default mesh inside the caller's fake mode, where the rank map (a
    torch.arange) is fake and its .tolist() has no values: build it outside."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init

    original = device_mesh.init_device_mesh

    def init_device_mesh(*args: Any, **kwargs: Any):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    device_mesh.init_device_mesh = init_device_mesh
    fsdp_init.init_device_mesh = init_device_mesh


class _KeepBuckets:
    """DDP's reducer, less the bucket rebuild after the first step (it broadcasts rank 0's order
    through storage written in C++; one process has nothing to agree with). The buckets it
    starts with are the rebuilt ones' sizes instead (:func:`_steady_buckets`)."""

    def __init__(self, reducer: Any):
        object.__setattr__(self, "_reducer", reducer)

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _allreduce_hook(state, bucket):  # unannotated: DDP checks the annotations it finds
    """DDP's default reduction in Python (the fake process group's works carry no tensors, which
    the built-in C++ hook asserts on), in the order the C++ reducer runs it: the bucket divided
    by the world *before* its all-reduce (``Reducer::mark_variable_ready_dense`` divides each
    gradient as it is copied into, or already lies in, its bucket), then a sum. Nothing on the
    compute stream reads the reduced bucket until the backward ends (``finalize_backward`` waits
    for every bucket's work there), so each bucket's all-reduce overlaps the backward after it.
    Dividing after the all-reduce, as this hook once did, made the compute stream wait for every
    bucket at once: no overlap at all."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state))  # state: the wrapper's process group (a DiLoCo worker group's)
    dist.all_reduce(buf, group=state)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _steady_buckets(ddp: Any) -> None:
    """DDP puts every gradient in one bucket for the first step and rebuilds buckets of
    ``bucket_cap_mb`` in the order gradients became ready; the trace keeps its first buckets,
    so they are made at the rebuilt size from the start (in reverse parameter order, which is
    the ready order of a stack of blocks)."""
    config = getattr(ddp, "_BucketCapacityConfig", None)  # torch 2.13; older releases decide inline
    if config is None or not hasattr(config, "compute_bucket_size_limits"):
        return

    def limits(self: Any, static_graph: bool, find_unused_parameters: bool) -> tuple[list[int], list[int]]:
        if self.has_custom_per_bucket_caps:
            caps = list(self.per_bucket_bytes_caps)
            return caps, caps
        if self.first_bucket_bytes_cap < self.bucket_bytes_cap:
            return [self.first_bucket_bytes_cap, self.bucket_bytes_cap], []
        return [self.bucket_bytes_cap], []

    config.compute_bucket_size_limits = limits


def _patch_ddp() -> None:
    import torch.nn.parallel.distributed as ddp

    _steady_buckets(ddp)

    ddp._verify_param_shape_across_processes = lambda *a, **k: None  # reads storage; one process anyway
    ddp._sync_module_states = lambda *a, **k: None

    class TracedDDP(ddp.DistributedDataParallel):
        __signature__ = inspect.signature(ddp.DistributedDataParallel)  # flopwise asks it which options exist

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.register_comm_hook(self.process_group, _allreduce_hook)
            self.reducer = _KeepBuckets(self.reducer)  # type: ignore[assignment]  # forwards to the Reducer

    parallel.DDP = TracedDDP  # type: ignore[misc]  # flopwise's DDP, for the trace


# --------------------------------------------------------------------------- flopwise's own pieces

def _build_model_shapes(cfg: Any, device: Any = "cpu", seed: int = 1337) -> transformer.Transformer:
    """``build_model`` without the random values (none exist here, and a CPU build has no CUDA
    generator): built on the meta device outside fake mode, materialised on the fake device,
    RoPE tables recomputed there, attention configured as build_model configures it."""
    with unset_fake_temporarily(), torch.device("meta"):
        model = transformer.Transformer(cfg)
    if torch.device(device).type == "meta":
        return model
    fake = next(m for m in _get_current_dispatch_mode_stack() if isinstance(m, FakeTensorMode))
    allow, fake.allow_non_fake_inputs = fake.allow_non_fake_inputs, True  # the meta parameters, only here
    try:
        model.to_empty(device=device)
    finally:
        fake.allow_non_fake_inputs = allow
    model.reset_rope()
    transformer.configure_attention(model, torch.device(device), torch.float32)
    return model


def _deepcopy_in_mode(obj: Any, memo: dict | None = None) -> Any:
    """copy.deepcopy of a module of fake tensors, in the current fake mode (a plain deep copy
    gives each copy a fake mode of its own, which the first master->model copy refuses)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.nn.Module):
        for t in obj.parameters():
            memo.setdefault(id(t), torch.nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad))
        for b in obj.buffers():
            memo.setdefault(id(b), b.clone())
    return copy.deepcopy(obj, memo)


def _patch_flopwise(gpu: FakeGpu) -> None:
    setup.build_model = _build_model_shapes
    # MoE experts: torch._grouped_mm runs bf16 on sm80+ (moe.py probes it by running it: no values here)
    for index in range(gpu.count):
        moe._GROUPED_MM_OK[("cuda", index, torch.bfloat16)] = gpu.capability >= (8, 0)
    precision.copy = types.SimpleNamespace(deepcopy=_deepcopy_in_mode)  # type: ignore[assignment]  # its deepcopy


def mxfp8_linear_torch_casts(input_hp: torch.Tensor, weight_hp: torch.Tensor, kernel_preference: Any,
                             scale_calculation_mode: Any, wgrad_with_hp: bool = False) -> torch.Tensor:
    """torchao's MXFP8 linear (``_to_mxfp8_then_scaled_mm``) with its casts as torch ops.

    torchao runs each cast as a Triton kernel (along rows) or a CUDA-extension one (along
    columns), neither of which a CPU build can load. torchao's own ``TORCH`` cast choice makes the
    same fp8 data and e8m0 scales from amax, scale and cast ops, which compile fuses into one pass
    over the input as those kernels make one (torchao measures ``to_mx`` under compile at 6.5 TB/s
    on a B200, faster than its Triton kernel's 5.8). The GEMM is the one that runs: ``_scaled_mm``
    with e8m0 scales."""
    from torchao.prototype.moe_training import mxfp8_linear
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice

    e4m3 = torch.float8_e4m3fn
    return mxfp8_linear.mx_mm.apply(input_hp, weight_hp, e4m3, e4m3, e4m3, 32, kernel_preference,
                                    MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                                    scale_calculation_mode, wgrad_with_hp)


def _patch_mxfp8() -> None:
    """MXFP8's linears traced with their casts as torch ops (:func:`mxfp8_linear_torch_casts`)."""
    try:
        import torchao.prototype.moe_training.tensor as wrapped
    except ImportError:  # no torchao, or one without MXFP8 training: train.fp8 says what to install
        return
    wrapped._to_mxfp8_then_scaled_mm = mxfp8_linear_torch_casts


# --------------------------------------------------------------------------- recorders

class LiveMemory:
    """Bytes of fake CUDA storage alive, by kind, and their peak -- without a dispatch mode, so
    it sees compiled graphs run too. Every fake tensor is made through ``FakeTensor.__new__``;
    a storage counts from its first tensor until the storage is freed. Storages start as
    ``activations`` while :attr:`phase` says forward, ``temporaries`` otherwise; parameters,
    optimizer state, gradients and the loader's batches on the device are moved to their own
    kinds when told (:meth:`mark`)."""

    KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "batches")

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode  # tensors of other fake modes (dynamo's and AOTAutograd's, while tracing) are not memory
        self.live: dict[int, list] = {}  # storage -> [bytes, kind]
        self.by_kind = dict.fromkeys(self.KINDS, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_kind = dict(self.by_kind)
        self.phase = "temporaries"
        self._new: Callable | None = None
        self._resize: Callable | None = None

    def __enter__(self) -> "LiveMemory":
        new = self._new = FakeTensor.__new__
        tracker = self

        def tracked_new(cls: type[FakeTensor], *args: Any, **kwargs: Any) -> FakeTensor:
            t = new(cls, *args, **kwargs)
            if t.fake_mode is tracker.mode and t.device.type == "cuda":
                tracker._born(t)
            return t

        FakeTensor.__new__ = tracked_new  # type: ignore[method-assign, assignment]  # not generic in Self
        resize = self._resize = torch.UntypedStorage.resize_

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
            # FSDP2 frees and refills its unsharded parameters by resizing their storage in place
            result = resize(storage, size)
            entry = tracker.live.get(storage._cdata)
            if entry is not None:
                tracker._add(entry[1], size - entry[0])
                entry[0] = size
            return result

        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign, assignment]  # stub: _StorageBase
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._new is not None and self._resize is not None, "__exit__ follows __enter__, which saved them"
        FakeTensor.__new__ = self._new  # type: ignore[method-assign]
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def _born(self, t: torch.Tensor) -> None:
        # A storage is followed by its own Python object (torch keeps one per storage while the
        # storage lives), not by its tensors: a tensor can change storage under it (``p.data =
        # ...``, as ZeRO-1's bucket views do), and an address of a freed storage is reused.
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.live:
            self.live[key] = [storage.nbytes(), self.phase]
            self._add(self.phase, storage.nbytes())
            weakref.finalize(storage, self._died, key)

    def _died(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self._add(entry[1], -entry[0])

    def _add(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_kind = dict(self.by_kind)

    def mark(self, tensors: Any, kind: str) -> None:
        """Count these tensors' storages as ``kind`` from now on (local shards of DTensors)."""
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            if not isinstance(t, FakeTensor) or t.fake_mode is not self.mode:
                continue
            entry = self.live.get(t.untyped_storage()._cdata)
            if entry is not None and entry[1] != kind:
                self._add(entry[1], -entry[0])
                entry[1] = kind
                self._add(kind, entry[0])

    def reset_peak(self) -> None:
        self.peak, self.peak_by_kind = self.total, dict(self.by_kind)


def _source(skip: tuple[str, ...] = ("/torch/", "/flopwise/tune/", "contextlib.py", "<frozen")) -> str:
    """The innermost frames of flopwise's own code on the stack: where a host read came from."""
    frames = [f for f in traceback.extract_stack()[:-2] if not any(s in f.filename for s in skip)]
    out = []
    for f in frames[-3:]:
        name = f.filename.split(f"{os.sep}src{os.sep}", 1)[-1] if "flopwise" in f.filename else os.path.basename(
            f.filename)
        out.append(f"{name}:{f.lineno} ({f.name})")
    return " <- ".join(reversed(out))


class StepWatch(TorchDispatchMode):
    """Host reads of device data and collectives, as a dispatch mode (eager only: with it on the
    stack dynamo runs frames uncompiled). A read of a device scalar (``.item()``, ``.tolist()``)
    is answered with ``fill`` so the step goes on; the reads of one Python call (a
    ``.tolist()`` of several values) are one synchronisation."""

    SYNCING = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
                         "aten.masked_select.default", "aten.unique_consecutive.default", "aten._unique2.default",
                         "aten.equal.default", "aten.is_nonzero.default"})

    def __init__(self, fill: float = 1.0):
        super().__init__()
        self.fill = fill
        self.syncs: list[tuple[str, str]] = []  # (op, source)
        self.collectives: Counter = Counter()  # op -> calls
        self.collective_bytes: Counter = Counter()  # op -> bytes of the tensors it moves
        self._last: tuple[str, str] | None = None

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        first = args[0] if args else None
        if name in self.SYNCING and isinstance(first, torch.Tensor) and first.device.type == "cuda":
            self._sync(name)
            if name in ("aten._local_scalar_dense.default", "aten.item.default"):
                return self.fill if first.dtype.is_floating_point else int(self.fill)
        elif name in ("aten._to_copy.default", "aten.copy_.default"):
            assert first is not None, f"{name} takes a tensor first"
            src = args[1] if name == "aten.copy_.default" else first
            dst = str(first.device if name == "aten.copy_.default" else kwargs.get("device", src.device))
            # non_blocking (into pinned memory: train_step.PendingStep) returns without waiting
            waits = not (args[2] if name == "aten.copy_.default" and len(args) > 2 else kwargs.get("non_blocking"))
            if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst.startswith("cpu") and waits:
                self._sync(f"{name} cuda->cpu")
        elif func.namespace in ("c10d", "_c10d_functional"):
            op = name.split(".")[1]
            self.collectives[op] += 1
            self.collective_bytes[op] += _tensor_bytes(args)
        return func(*args, **kwargs)

    def _sync(self, op: str) -> None:
        where = _source()
        key = (op.split(" ")[0], where)
        if self._last == key and op.startswith("aten._local_scalar_dense"):  # the same .tolist()
            return
        self._last = key
        self.syncs.append((op, where))

    def step_done(self) -> None:
        self._last = None


def _tensor_bytes(args: Any) -> int:
    """Bytes of a collective: its largest tensor among ``args`` (lists of tensors included) -- the
    buffer all-reduced, the gathered output, the input reduce-scattered."""
    largest = 0
    stack = list(args)
    while stack:
        a = stack.pop()
        if isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, torch.Tensor):
            largest = max(largest, a.numel() * a.element_size())
    return largest
