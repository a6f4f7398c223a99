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
    fp8: float | None  # dense fp8 tensor-core TFLOP/s (Hopper, Ada, Blackwell); None where absent
    tf32: float | None
    fp32: float | None  # non-tensor FP32
    memory_gb: float  # as marketed; an "80GB" card holds 80 GiB of HBM (~79.6 GiB usable)
    bandwidth_tbs: float  # memory bandwidth, TB/s
    pattern: str  # regex matched against torch.cuda.get_device_name()

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes, reading the marketed GB as GiB (what the HBM stacks hold);
        the driver keeps a few hundred MiB of it, which a planner's headroom absorbs."""
        return int(self.memory_gb * 1024**3)


# Sources: NVIDIA datasheets (A100, H100, H200, B200/HGX B200, L40S, L4, A10, RTX 6000 Ada,
# RTX PRO 6000 Blackwell) and architecture whitepapers (GA102, AD102, GB202) for the GeForce
# and workstation cards; each datasheet value marked "with sparsity" was halved. Blackwell
# workstation bf16 is derived from the fp4 figure (4 PFLOPS sparse fp4 -> 500 dense bf16).
# Ordered: the first matching pattern wins, so specific variants precede generic ones.
DEVICES: tuple[DeviceSpec, ...] = (
    #          name                  bf16    fp16    fp8     tf32    fp32  GB    TB/s
    DeviceSpec("H200 NVL",           835.0,  835.0,  1670.0, 417.5,  60.0, 141, 4.8, r"H200.*NVL"),
    DeviceSpec("H200",               989.4,  989.4,  1978.9, 494.7,  66.9, 141, 4.8, r"H200"),
    DeviceSpec("GH200",              989.4,  989.4,  1978.9, 494.7,  66.9, 96, 4.0, r"GH200"),
    DeviceSpec("H100 NVL",           835.0,  835.0,  1670.0, 417.5,  60.0, 94, 3.9, r"H100.*NVL"),
    DeviceSpec("H100 PCIe",          756.5,  756.5,  1513.0, 378.0,  51.2, 80, 2.0, r"H100.*PCIe"),
    DeviceSpec("H100 SXM",           989.4,  989.4,  1978.9, 494.7,  66.9, 80, 3.35, r"H100"),
    DeviceSpec("B200",               2250.0, 2250.0, 4500.0, 1100.0, 75.0, 180, 8.0, r"B200"),
    DeviceSpec("A100",               312.0,  312.0,  None,   156.0,  19.5, 80, 2.039, r"A100"),
    DeviceSpec("A10G",               70.0,   70.0,   None,   35.0,   31.2, 24, 0.6, r"A10G"),
    DeviceSpec("A10",                125.0,  125.0,  None,   62.5,   31.2, 24, 0.6, r"\bA10\b"),
    DeviceSpec("L40S",               362.05, 362.05, 733.0,  183.0,  91.6, 48, 0.864, r"L40S"),
    DeviceSpec("L4",                 121.0,  121.0,  242.5,  60.0,   30.3, 24, 0.3, r"\bL4\b"),
    DeviceSpec("RTX PRO 6000 Blackwell", 500.0, 500.0, 1000.0, 250.0, 125.0, 96, 1.792, r"RTX PRO 6000"),
    DeviceSpec("RTX 6000 Ada",       364.2,  364.2,  728.5,  182.1,  91.1, 48, 0.96, r"RTX 6000 Ada"),
    DeviceSpec("RTX A6000",          154.8,  154.8,  None,   77.4,   38.7, 48, 0.768, r"A6000"),
    DeviceSpec("RTX 5090",           209.5,  209.5,  419.0,  104.8,  104.8, 32, 1.792, r"RTX 5090"),
    DeviceSpec("RTX 4090",           165.2,  165.2,  330.3,  82.6,   82.6, 24, 1.008, r"RTX 4090"),
    DeviceSpec("RTX 3090",           71.0,   71.0,   None,   35.6,   35.6, 24, 0.936, r"RTX 3090"),
    DeviceSpec("V100",               None,   125.0,  None,   None,   15.7, 32, 0.9, r"V100"),
    DeviceSpec("T4",                 None,   65.0,   None,   None,   8.1, 16, 0.32, r"\bT4\b"),
)

DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")


def lookup(device_name: str) -> DeviceSpec | None:
    """The table entry for a device name such as ``"NVIDIA H100 80GB HBM3"``, or None."""
    for spec in DEVICES:
        # Whole model numbers only: "H100" must not match "GH100" or "H1000".
        if re.search(rf"(?<![0-9a-z]){spec.pattern}(?![0-9])", device_name, flags=re.IGNORECASE):
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
    """Dense peak for the precision the matmuls run in (``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``).

    ``float32`` training on a GPU counts against the TF32 peak when TF32 matmuls are
    allowed and the FP32 peak otherwise; the caller decides which by passing ``tf32`` or
    ``fp32``.
    """
    spec = lookup(device_name)
    if spec is None:
        return None
    key = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp8": "fp8",
           "tf32": "tf32", "fp32": "fp32", "float32": "fp32"}.get(precision)
    return getattr(spec, key) if key else None


@dataclass(frozen=True)
class Link:
    """A link gradients cross in an all-reduce: its bus bandwidth per GPU in GB/s (one
    direction), the figure that ring all-reduce time is computed against."""

    name: str
    gb_per_s: float
    description: str


# Nominal per-GPU, one-direction bandwidths. Real all-reduce bus bandwidth (nccl-tests
# "busbw") lands below these: typically 70-90% of NVLink and ~80% of a PCIe link.
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("pcie3", 16.0, "PCIe 3.0 x16 (no NVLink; traffic through the host or a PCIe switch)"),
    Link("pcie4", 32.0, "PCIe 4.0 x16 (e.g. A100 PCIe, RTX 3090/4090/A6000 servers)"),
    Link("pcie5", 64.0, "PCIe 5.0 x16 (e.g. H100 PCIe, L40S, RTX 5090 servers)"),
    Link("nvlink3", 300.0, "NVLink 3 (A100 SXM, 600 GB/s bidirectional)"),
    Link("nvlink4", 450.0, "NVLink 4 (H100/H200 SXM, 900 GB/s bidirectional)"),
    Link("nvlink5", 900.0, "NVLink 5 (B200, 1.8 TB/s bidirectional)"),
    Link("ib-hdr", 25.0, "InfiniBand HDR 200 Gb/s, one NIC per GPU"),
    Link("ib-ndr", 50.0, "InfiniBand NDR 400 Gb/s, one NIC per GPU"),
    Link("eth-100g", 12.5, "100 Gb/s Ethernet / RoCE, one NIC per GPU"),
    Link("eth-25g", 3.125, "25 Gb/s Ethernet shared by the node"),
)}


def default_link(spec: DeviceSpec | None) -> str:
    """The usual intra-node link for a device: NVLink on SXM parts, PCIe otherwise."""
    if spec is None:
        return "pcie4"
    return {"H200": "nvlink4", "GH200": "nvlink4", "H100 SXM": "nvlink4", "B200": "nvlink5",
            "A100": "nvlink3", "H100 PCIe": "pcie5", "H100 NVL": "pcie5", "H200 NVL": "pcie5",
            "L40S": "pcie4", "RTX 5090": "pcie5", "RTX PRO 6000 Blackwell": "pcie5"}.get(spec.name, "pcie4")
