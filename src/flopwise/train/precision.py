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


def fp8_problem(device: torch.device) -> str | None:
    """Why float8 training cannot run on ``device`` here, or None when it can: a CUDA GPU of
    compute capability 8.9+ (Ada, Hopper) and torchao installed."""
    if device.type != "cuda":
        return "train.fp8=true needs a CUDA GPU (Hopper or newer), not " + device.type
    if not torch.cuda.is_available():
        return "train.fp8=true needs a CUDA GPU: CUDA is not available here"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"train.fp8=true needs compute capability 8.9+ (Ada/Hopper), this GPU has {major}.{minor}"
    if importlib.util.find_spec("torchao") is None:
        return "train.fp8=true needs torchao (pip install torchao)"
    return None


def apply_fp8(model: torch.nn.Module, device: torch.device, recipe: str = "tensorwise", fsdp: bool = False) -> str:
    """Swap the blocks' linear layers for float8 training ones (torchao's ``recipe``: tensorwise
    or rowwise scaling); the LM head stays in bf16. Under FSDP2 (``fsdp``) a tensorwise model
    all-gathers its weights in fp8, half the bytes of bf16's. Raises ConfigError with the reason
    when that cannot be done here."""
    problem = fp8_problem(device)
    if problem:
        raise ConfigError([problem])
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: torchao is optional

    config = Float8LinearConfig.from_recipe_name(recipe)
    gather = fsdp and recipe == "tensorwise"
    if gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise, as from_recipe_name's

    def only_blocks(module: torch.nn.Module, fqn: str) -> bool:
        # float8 GEMMs need both dimensions divisible by 16; the head stays higher precision
        return (fqn.startswith("layers.") and isinstance(module, torch.nn.Linear)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, config=config, module_filter_fn=only_blocks)
    n = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    return (f"fp8: {n} linear layers in float8 (torchao, {recipe} dynamic scaling"
            + ("; weights all-gathered in fp8 under FSDP2)" if gather else ")"))


def fp8_scales_for_fsdp(model: torch.nn.Module) -> None:
    """After an update under FSDP2 with fp8 all-gather (tensorwise): every float8 weight's amax
    in one all-reduce, the scales the next all-gather casts with (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``; without it each weight reduces its own)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # lazy: fp8 only

    precompute_float8_dynamic_scale_for_fsdp(model)
