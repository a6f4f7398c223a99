"""Numeric precision of training: what runs in which dtype, decided once.

=============  ====================  ===============  ========================================
precision      parameters            matmuls          optimizer state / notes
=============  ====================  ===============  ========================================
``float32``    fp32                  fp32 (TF32 opt.)  fp32 -- the CPU default
``bf16``       fp32                  bf16 (autocast)  fp32 -- the CUDA default with bf16
``bf16-pure``  bf16                  bf16             fp32 master copy of the weights and fp32
                                                      AdamW state (:class:`MasterWeights`)
``fp16``       fp32                  fp16 (autocast)  fp32, losses scaled by a GradScaler -- chosen
                                                      by ``auto`` on GPUs without bf16 (V100, T4)
=============  ====================  ===============  ========================================

fp8 linear layers (torchao, Hopper or newer) are a separate switch, ``train.fp8``, off by
default and refused with the reason when unavailable -- never silently on or off.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from flopwise.config import ConfigError


@dataclass
class Precision:
    name: str
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype
    scaler: "torch.amp.GradScaler | None" = None


def cpu_native_bf16() -> str | None:
    """The instructions with which this CPU multiplies bf16 matrices natively (``"AMX"``,
    ``"AVX-512 BF16"``), or None: without them oneDNN emulates bf16 through float32 and bf16
    autocast is no faster. torch asks cpuinfo, so this holds on any OS; non-x86 CPUs say None."""
    cpu = getattr(torch, "cpu", None)
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported"))
    for label, probe in probes:
        if getattr(cpu, probe, None) is not None and getattr(cpu, probe)():
            return label
    return None


def resolve(name: str, device: torch.device) -> Precision:
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            name = "float32"
    if name == "fp16" and device.type != "cuda":
        raise ConfigError([f"train.precision=fp16 needs a CUDA device (GradScaler), not {device.type}"])
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None
    return Precision(name, autocast, torch.bfloat16 if name == "bf16-pure" else torch.float32, scaler)


def autocast_factory(device: torch.device, dtype: torch.dtype | None):
    """A function returning the autocast context of ``dtype`` on ``device`` (a no-op for None)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class MasterWeights:
    """bf16 parameters trained through an fp32 copy: gradients are copied up, the optimizer
    steps the fp32 copy, and the result is rounded back down. Checkpoints save the fp32
    copy (``self.master``), so nothing is lost to bf16 between runs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.master = copy.deepcopy(model)  # fp32: built before the cast below
        with torch.no_grad():
            for p in model.parameters():  # parameters only: RoPE tables and other buffers stay fp32
                p.data = p.data.to(torch.bfloat16)
        self.pairs = list(zip(model.parameters(), self.master.parameters()))

    def grads_to_master(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)


def fp8_problem(device: torch.device, recipe: str = "tensorwise") -> str | None:
    """Why float8 training (torchao's ``recipe``) cannot run on ``device`` here, or None when it
    can: a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell) -- 10.x (B200, GB200,
    B300) for MXFP8, whose block-scaled matmuls are cuBLAS's on sm100 -- and torchao installed."""
    if device.type != "cuda":
        return "train.fp8=true needs a CUDA GPU (Hopper or newer), not " + device.type
    if not torch.cuda.is_available():
        return "train.fp8=true needs a CUDA GPU: CUDA is not available here"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"train.fp8=true needs compute capability 8.9+ (Ada/Hopper), this GPU has {major}.{minor}"
    if recipe == "mxfp8" and major != 10:
        return (f"train.fp8_recipe=mxfp8 needs a Blackwell data-centre GPU (compute capability 10.x: B200, "
                f"GB200, B300), this GPU has {major}.{minor}: choose tensorwise or rowwise")
    if importlib.util.find_spec("torchao") is None:
        return "train.fp8=true needs torchao (pip install torchao)"
    return None


def _in_blocks(module: torch.nn.Module, fqn: str, multiple: int = 16) -> bool:
    """The linears fp8 converts: the blocks' (the LM head stays higher precision), with both
    dimensions divisible by ``multiple``: 16 as float8 GEMMs need, 32 for MXFP8's blocks."""
    return (fqn.startswith("layers.") and isinstance(module, torch.nn.Linear)
            and module.in_features % multiple == 0 and module.out_features % multiple == 0)


def apply_fp8(model: torch.nn.Module, device: torch.device, recipe: str = "tensorwise", fsdp: bool = False) -> str:
    """Swap the blocks' linear layers for float8 training ones (torchao's ``recipe``: tensorwise
    or rowwise scaling, or MXFP8's block scaling); the LM head stays in bf16. Under FSDP2
    (``fsdp``) a tensorwise model all-gathers its weights in fp8, half the bytes of bf16's.
    Raises ConfigError with the reason when that cannot be done here."""
    problem = fp8_problem(device, recipe)
    if problem:
        raise ConfigError([problem])
    if recipe == "mxfp8":
        return _apply_mxfp8(model)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: torchao is optional

    config = Float8LinearConfig.from_recipe_name(recipe)
    gather = fsdp and recipe == "tensorwise"
    if gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise, as from_recipe_name's
    convert_to_float8_training(model, config=config, module_filter_fn=_in_blocks)
    n = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    return (f"fp8: {n} linear layers in float8 (torchao, {recipe} dynamic scaling"
            + ("; weights all-gathered in fp8 under FSDP2)" if gather else ")"))


def _apply_mxfp8(model: torch.nn.Module) -> str:
    """MXFP8 (torchao's ``mxfp8_rceil`` training recipe): each block linear's weight becomes a
    wrapper whose matmuls cast input, weight and gradient to float8 with a power-of-two scale per
    32 values and run cuBLAS's block-scaled GEMM; the weights stay bf16 tensors, all-gathered in
    bf16 under FSDP2."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe  # lazy: optional
    from torchao.quantization import quantize_

    taken: list[torch.nn.Module] = []

    def only_blocks(module: torch.nn.Module, fqn: str) -> bool:
        take = _in_blocks(module, fqn, 32)
        if take:
            taken.append(module)
        return take

    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL), filter_fn=only_blocks)
    for module in taken:
        module.register_state_dict_post_hook(_plain_weight)
    return (f"fp8: {len(taken)} linear layers in MXFP8 (torchao, a power-of-two scale per 32 values; "
            "all-gathers in bf16)")


def _plain_weight(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """An MXFP8 linear's weight saved as the plain tensor it wraps: a checkpoint, an export and
    a resume see the model's own values, and nothing a loader would have to unpickle as torchao's
    class (a ``weights_only`` load refuses it). Loading copies back into the wrapper as usual.
    Under FSDP2 the wrapper is a DTensor's local shard, unwrapped the same way."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and hasattr(value._local_tensor, "_data"):
        state_dict[key] = DTensor.from_local(value._local_tensor._data, value.device_mesh, value.placements,
                                             shape=value.shape, stride=value.stride())
    elif value is not None and hasattr(value, "_data") and type(value) is not torch.Tensor:
        state_dict[key] = value._data


def fp8_scales_for_fsdp(model: torch.nn.Module) -> None:
    """After an update under FSDP2 with fp8 all-gather (tensorwise): every float8 weight's amax
    in one all-reduce, the scales the next all-gather casts with (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``; without it each weight reduces its own)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # lazy: fp8 only

    precompute_float8_dynamic_scale_for_fsdp(model)
