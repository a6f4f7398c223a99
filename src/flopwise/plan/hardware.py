"""Dense peak TFLOP/s per device and dtype: the denominator of MFU.

Datasheets often print tensor-core numbers *with 2:4 structured sparsity*; every value
here is the dense one (half the sparse figure). GeForce cards run bf16/fp16 tensor
cores at half rate when accumulating in fp32 (which is what training does), so their
bf16 entries are the fp32-accumulate numbers.

An unknown device has no entry: MFU is then reported as n/a, never computed against a
guessed denominator. ``train.peak_tflops`` (or ``--peak-tflops``) supplies one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16: float | None  # dense TFLOP/s, tensor cores, fp32 accumulate
    fp16: float | None
    tf32: float | None
    fp32: float | None  # non-tensor FP32
    memory_gb: float
    pattern: str  # regex matched against torch.cuda.get_device_name()


# Ordered: the first matching pattern wins, so specific variants precede generic ones.
DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("H200 NVL", 835.0, 835.0, 417.5, 60.0, 141, r"H200.*NVL"),
    DeviceSpec("H200", 989.4, 989.4, 494.7, 66.9, 141, r"H200"),
    DeviceSpec("H100 NVL", 835.0, 835.0, 417.5, 60.0, 94, r"H100.*NVL"),
    DeviceSpec("H100 PCIe", 756.5, 756.5, 378.0, 51.2, 80, r"H100.*PCIe"),
    DeviceSpec("H100 SXM", 989.4, 989.4, 494.7, 66.9, 80, r"H100"),
    DeviceSpec("GH200", 989.4, 989.4, 494.7, 66.9, 96, r"GH200"),
    DeviceSpec("B200", 2250.0, 2250.0, 1100.0, 75.0, 180, r"B200"),
    DeviceSpec("A100", 312.0, 312.0, 156.0, 19.5, 80, r"A100"),
    DeviceSpec("A10G", 70.0, 70.0, 35.0, 31.2, 24, r"A10G"),
    DeviceSpec("A10", 125.0, 125.0, 62.5, 31.2, 24, r"\bA10\b"),
    DeviceSpec("L40S", 362.05, 362.05, 183.0, 91.6, 48, r"L40S"),
    DeviceSpec("L4", 121.0, 121.0, 60.0, 30.3, 24, r"\bL4\b"),
    DeviceSpec("RTX PRO 6000 Blackwell", 500.0, 500.0, 250.0, 125.0, 96, r"RTX PRO 6000"),
    DeviceSpec("RTX 6000 Ada", 364.2, 364.2, 182.1, 91.1, 48, r"RTX 6000 Ada"),
    DeviceSpec("RTX A6000", 154.8, 154.8, 77.4, 38.7, 48, r"A6000"),
    DeviceSpec("RTX 5090", 209.5, 209.5, 104.8, 104.8, 32, r"RTX 5090"),
    DeviceSpec("RTX 4090", 165.2, 165.2, 82.6, 82.6, 24, r"RTX 4090"),
    DeviceSpec("RTX 3090", 71.0, 71.0, 35.6, 35.6, 24, r"RTX 3090"),
    DeviceSpec("V100", None, 125.0, None, 15.7, 32, r"V100"),
    DeviceSpec("T4", None, 65.0, None, 8.1, 16, r"\bT4\b"),
)


def lookup(device_name: str) -> DeviceSpec | None:
    """The table entry for a device name such as ``"NVIDIA H100 80GB HBM3"``, or None."""
    for spec in DEVICES:
        if re.search(spec.pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


def find(name: str) -> DeviceSpec | None:
    """Look up by table name (``"h100 sxm"``, ``"a100"``) or by a device-name string."""
    key = name.strip().lower()
    for spec in DEVICES:
        if spec.name.lower() == key:
            return spec
    return lookup(name)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak for the precision the matmuls run in (``bf16``, ``fp16``, ``tf32``, ``fp32``).

    ``float32`` training on a GPU counts against the TF32 peak when TF32 matmuls are
    allowed and the FP32 peak otherwise; the caller decides which by passing ``tf32`` or
    ``fp32``.
    """
    spec = lookup(device_name)
    if spec is None:
        return None
    key = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
           "tf32": "tf32", "fp32": "fp32", "float32": "fp32"}.get(precision)
    return getattr(spec, key) if key else None
