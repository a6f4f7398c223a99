"""What ``auto`` becomes for the speed settings on this device, and why.

With no switches a run takes the fastest correct path the device has: on CUDA, bf16
autocast (``precision.resolve``), the model compiled with its LM head and loss as one graph
(``train.compile=auto`` -> ``model``) -- or, inside a DDP, ZeRO-1 or FSDP2 wrapper, each block
compiled on its own (``blocks``), which traces without the graph breaks the wrapper's hooks cut
into a whole-model graph --, the plain loss inside the whole-model graph unless the memory
model says its full logits do not fit (then the fused kernel or the chunked loss), SDPA or
flash attention (``model.configure_attention``) and fused AdamW (``optim.build_optimizer``).
On a CPU: not compiled (compiling costs more than it saves in a CPU-sized run) and the
chunked loss. The choices are resolved on a copy of the configuration, so the run's
``config.yaml`` keeps ``auto`` and a resumption on another device decides again; the
start-up summary prints each choice with its reason.

And what the training device is: its name for the log (:func:`device_label`) and its dense
peak FLOP/s at the run's precision (:func:`device_peak`, MFU's denominator, from
``plan/hardware.py``'s table).

torch is imported where a function needs it: ``flopwise plan`` resolves ``auto`` for a named GPU
with these rules (:func:`resolve_compile`, :func:`step_wrapper`) and never imports torch.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from flopwise.config import Compile, RunConfig
from flopwise.plan import hardware

if TYPE_CHECKING:
    import torch

MEMORY_HEADROOM = 0.9  # the share of the GPU's memory the memory model's peak may use


# The data-parallel wrappers. Around a whole-model graph the dry run traces breaks: torch runs
# DDP's forward (ZeRO-1's too: DDP underneath) uncompiled and cuts the graph around it, and FSDP2's
# gather/reshard hooks are compiler-disabled (docs/planning.md, the dry run). Compiled a block at a time -- what
# torchtitan does under FSDP2 -- each block is one graph and the hooks run between them.
WRAPPERS = ("ddp", "zero1", "fsdp2", "hsdp")


def step_wrapper(cfg: RunConfig, world: int) -> str:
    """The data-parallel wrapper the step's model runs in at ``world`` ranks: ``ddp``, ``zero1``,
    ``fsdp2``, ``hsdp`` (``auto`` over several ranks picks one of ddp, zero1, fsdp2: ``ddp, zero1 or fsdp2``), the
    inner strategy of a DiLoCo group of several ranks; ``""`` for none (one rank, ``single``)."""
    strategy = cfg.parallel.strategy
    if world <= 1 or strategy == "single":
        return ""
    if strategy == "auto":
        return "ddp, zero1 or fsdp2"
    if strategy == "diloco":
        from flopwise.parallel.diloco import group_size  # lazy: torch, and only DiLoCo asks

        inner = cfg.parallel.inner_strategy
        return inner if group_size(cfg.parallel, world) > 1 and inner in WRAPPERS else ""
    return strategy if strategy in WRAPPERS else ""


def resolve_compile(choice: Compile, device: torch.device | str, wrapper: str = "") -> tuple[Compile, str]:
    """``train.compile`` as ``(mode, why)``; ``why`` is empty when it was not ``auto``. ``device``
    a torch device or its type (``cuda``, ``cpu``); ``wrapper`` what :func:`step_wrapper` says."""
    if choice != "auto":
        return choice, ""
    if getattr(device, "type", device) != "cuda":
        return "off", "CPU: compiling costs more than it saves in a CPU-sized run"
    if wrapper:
        return "blocks", (f"CUDA under {wrapper}: one graph per block, no graph break; the whole model breaks "
                          "around the wrapper's hooks")
    return "model", "CUDA: forward, LM head and loss as one graph"


def plain_logits_problem(cfg: RunConfig, device: torch.device, precision: str, world: int,
                         total_bytes: int | None = None) -> str | None:
    """None when the plain loss (full logits) fits the memory model's budget on this GPU, else
    the reason. ``total_bytes`` (default: the device's memory) is there for tests. The strategy
    counted is the one asked for, or under ``auto`` the one that keeps the most per GPU (single
    or ddp): a run that would only fit sharded gets the loss that needs no full logits."""
    import torch  # lazy: see the module's docstring

    from flopwise.parallel.strategy import predicted_peak  # lazy: torch

    if device.type != "cuda" and total_bytes is None:
        return None
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(device).total_memory
    strategy = cfg.parallel.strategy
    if strategy == "auto":
        strategy = "single" if world == 1 else "ddp"
    peak = predicted_peak(cfg, strategy, world, precision, "plain")
    if peak <= MEMORY_HEADROOM * total_bytes:
        return None
    return (f"with full logits the memory model's peak is {peak / 2**30:.1f} GiB > {MEMORY_HEADROOM:.0%} of "
            f"{total_bytes / 2**30:.0f} GiB")


def resolve_speed(cfg: RunConfig, device: torch.device, precision: str, world: int,
                  total_bytes: int | None = None) -> tuple[RunConfig, dict[str, str]]:
    """A copy of ``cfg`` whose ``train.compile`` and ``train.loss`` are concrete, and for each
    ``auto`` resolved, what it became and why (``{"compile": "auto -> model (why)", ...}``)."""
    from flopwise.model.loss import resolve_loss_impl  # lazy: torch

    out = copy.deepcopy(cfg)
    t, notes = out.train, {}
    t.compile, why = resolve_compile(t.compile, device, step_wrapper(out, world))
    if why:
        notes["compile"] = f"auto -> {t.compile} ({why})"
    fits = None
    if t.loss == "auto" and t.compile == "model":
        fits = plain_logits_problem(out, device, precision, world, total_bytes)
    t.loss, why = resolve_loss_impl(t.loss, out.model, t, device, fits)
    if why:
        notes["loss"] = f"auto -> {t.loss} ({why})"
    return out, notes


# --------------------------------------------------------------------------- the device


def tf32_matmuls_allowed() -> bool:
    """Whether float32 CUDA matmuls run on TF32 tensor cores (newer torch: ``fp32_precision``)."""
    import torch  # lazy: see the module's docstring

    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if isinstance(precision, str) and precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(getattr(matmul, "allow_tf32", False))


def device_peak(device: torch.device, precision: str, user_tflops: float) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device and a note on where it came from."""
    import torch  # lazy: see the module's docstring

    if user_tflops > 0:
        return user_tflops * 1e12, f"{user_tflops:g} TFLOP/s (train.peak_tflops)"
    if device.type != "cuda":
        return None, "no peak for CPUs (set train.peak_tflops for MFU)"
    name = torch.cuda.get_device_name(device)
    key = {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16"}.get(
        precision, "tf32" if tf32_matmuls_allowed() else "fp32")
    spec, peak = hardware.lookup(name), hardware.peak_tflops(name, key)
    if spec is None or peak is None:  # no peak without a table entry
        return None, f"{name!r} not in the hardware table (set train.peak_tflops for MFU)"
    return peak * 1e12, f"{peak:g} TFLOP/s dense {key} ({spec.name})"


def device_label(device: torch.device) -> str:
    import torch  # lazy: see the module's docstring

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"
