"""What the training device is and what it can do: its name for the log, and its dense peak
FLOP/s at the run's precision (MFU's denominator, from ``plan/hardware.py``'s table)."""

from __future__ import annotations

import torch

from flopwise.plan import hardware


def tf32_matmuls_allowed() -> bool:
    """Whether float32 CUDA matmuls run on TF32 tensor cores (newer torch: ``fp32_precision``)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if isinstance(precision, str) and precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(getattr(matmul, "allow_tf32", False))


def device_peak(device: torch.device, precision: str, user_tflops: float) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device and a note on where it came from."""
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
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"
