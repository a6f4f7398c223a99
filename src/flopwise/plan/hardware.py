"""Dense peak TFLOP/s per device and dtype: the denominator of MFU.

Datasheets often print tensor-core numbers *with 2:4 structured sparsity*; every value
here is the dense one (half the sparse figure). GeForce cards run bf16/fp16 tensor
cores at half rate when accumulating in fp32 (which is what training does), so their
bf16 entries are the fp32-accumulate numbers.

An unknown device has no entry: MFU is then reported as n/a, never computed against a
guessed denominator. ``train.peak_tflops`` (or ``--peak-tflops``) supplies one.

Names are matched exactly, never by prefix or substring: a name (what a user types
for ``plan --gpu``, or what ``torch.cuda.get_device_name()`` returns) is reduced by
:func:`name_key` to a sorted tuple of tokens -- lower case, vendor words (NVIDIA,
GeForce, Tesla, "Generation", "Edition", ...) dropped, spaces, dashes and underscores
ignored, ``40GB``/``40 GB``/``40GiB`` read as one memory token, ``SXM2/4/5`` read as
``SXM``, letters split from digits (``rtx4090`` = ``RTX 4090``) -- and that key must equal
the key of an entry's name or of one of its aliases. So ``a100-40gb``, ``A100 40GB`` and
``NVIDIA A100-SXM4-40GB`` are the 40 GB A100, while ``a100x``, ``h100x``, ``l40`` or a MIG
slice (``... MIG 1g.5gb``) are unknown. A bare family name means the current SXM part
(``a100`` = A100 SXM 80GB, ``h100`` = H100 SXM); the plan prints the entry it took.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any


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
    aliases: tuple[str, ...] = ()  # other names (user spellings, torch.cuda.get_device_name() strings)

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes, reading the marketed GB as GiB (what the HBM stacks hold);
        the driver keeps a few hundred MiB of it, which a planner's headroom absorbs."""
        return int(self.memory_gb * 1024**3)


# Sources (dense = the datasheet's "with sparsity" figure halved, rounded as printed):
# - A100 (all four): NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4):
#   bf16/fp16 312 (624 sparse), tf32 156, fp32 19.5 for 40GB and 80GB, SXM and PCIe alike;
#   bandwidth 1,555 GB/s (40GB), 1,935 GB/s (80GB PCIe), 2,039 GB/s (80GB SXM).
# - H100 SXM / PCIe / NVL: NVIDIA H100 datasheet: bf16 1,979 / 1,513 / 1,671 sparse -> 989.4
#   (whitepaper's 989.4) / 756.5 / 835 (NVL per GPU, 1,671/2 rounded); 80 / 80 / 94 GB;
#   3.35 / 2.0 / 3.9 TB/s. H200, H200 NVL: NVIDIA H200 datasheet (1,979 / 1,671 sparse).
# - H100 SXM 96GB: the HBM2e SXM H100 of Meta's Grand Teton hosts, on which torchtitan's and
#   torchao's H100 benchmarks ran (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md:
#   "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "the default 500W power limit, although
#   tuning it up to 700W TDP can ..."). The same SXM5 GH100 (132 SMs) as the H100 SXM, so the SXM's
#   dense peaks at its 700 W TDP; what its 500 W default limit costs is in plan/steptime.py.
# - GH200 (96 GB HBM3, "GH200 480GB"), B200 (HGX B200 datasheet, per GPU: 4.5 PF sparse bf16;
#   tf32 1,125 and fp32 80 as the DGX B200 datasheet gives them). GB200 (per GPU of a GB200 NVL72:
#   bf16 2,500, fp8 5,000, tf32 1,250, fp32 80; 186 GB HBM3e at 8 TB/s).
# - RTX PRO 6000 Blackwell: the RTX Blackwell whitepaper's bf16 dense tensor rate, 503.8 for the
#   Workstation Edition (600 W) and 438.9 for the Max-Q (300 W), not halved for fp32 accumulate on
#   these pro parts (a measured 418 TFLOP/s square bf16 GEMM on the Workstation is above half of
#   503.8); no fp8 or tf32 figure of theirs is published: fp8 is **derived** as twice bf16 (the
#   ratio of every other tensor-core part with fp32 accumulate, Ada and Hopper), tf32 is not
#   entered. The Server Edition's datasheet is not at hand: **derived**, the Workstation's 503.8
#   (the same GB202 with 188 SMs and the same 600 W; a measured 409 TFLOP/s bf16 GEMM is
#   consistent with it). 96 GB GDDR7, 1,792 GB/s.
# - RTX 4070 (12 GB) and RTX 3060 (12 GB): no whitepaper line; **derived** as the GeForce tensor
#   rate per SM and clock (512 FLOP/clk/SM with fp32 accumulate on Ada and Ampere GeForce, measured
#   with mma.sync on an sm_89 part) x SMs x boost clock: 46 x 2.475 GHz and 28 x 1.777 GHz -> 58.3
#   and 25.5; fp8 on the 4070 twice that (fp32 accumulate), none on Ampere; 504 and 360 GB/s.
# - L4: L4 datasheet bf16 242 sparse -> 121, fp8 485 -> 242.5, tf32 120 -> 60, fp32 30.3.
# - L40S: L40S datasheet bf16 "362.05 | 733" (dense | sparse), fp8 733 dense, tf32 183.
# - A10, A10G (AWS), RTX 6000 Ada, RTX A6000, RTX PRO 6000 Blackwell: their datasheets;
#   Blackwell workstation bf16 derived from the fp4 figure (4 PFLOPS sparse fp4 -> 500 dense bf16).
# - RTX 3090 / 4090 / 5090: GA102 / AD102 / GB202 whitepapers, fp16-with-fp32-accumulate
#   tensor rate (71 / 165.2 / 209.5), what bf16 training runs at on GeForce cards.
# - V100 SXM2 (fp16 125, fp32 15.7; no bf16), T4 (fp16 65): their datasheets.
# Each entry matches only its own name and aliases (see name_key); order does not matter.
DEVICES: tuple[DeviceSpec, ...] = (
    #          name              bf16    fp16    fp8     tf32    fp32  GB    TB/s
    DeviceSpec("H200 NVL",       835.0,  835.0,  1670.0, 417.5,  60.0, 141, 4.8, ("h200 nvl 141gb",)),
    DeviceSpec("H200",           989.4,  989.4,  1978.9, 494.7,  66.9, 141, 4.8,
               ("h200 sxm", "h200 141gb", "h200 sxm 141gb")),
    DeviceSpec("GH200",          989.4,  989.4,  1978.9, 494.7,  66.9, 96, 4.0, ("gh200 96gb", "GH200 480GB")),
    DeviceSpec("H100 NVL",       835.0,  835.0,  1670.0, 417.5,  60.0, 94, 3.9, ("h100 nvl 94gb", "h100 94gb")),
    DeviceSpec("H100 PCIe",      756.5,  756.5,  1513.0, 378.0,  51.2, 80, 2.0, ("h100 pcie 80gb",)),
    DeviceSpec("H100 SXM 96GB",  989.4,  989.4,  1978.9, 494.7,  66.9, 96, 2.4,
               ("h100 96gb", "h100 96gb hbm2e", "h100 sxm 96gb hbm2e", "h100 hbm2e")),
    DeviceSpec("H100 SXM",       989.4,  989.4,  1978.9, 494.7,  66.9, 80, 3.35,
               ("h100", "h100 80gb", "h100 sxm 80gb", "NVIDIA H100 80GB HBM3")),
    DeviceSpec("B200",           2250.0, 2250.0, 4500.0, 1125.0, 80.0, 180, 8.0, ("b200 180gb", "b200 192gb")),
    DeviceSpec("GB200",          2500.0, 2500.0, 5000.0, 1250.0, 80.0, 186, 8.0, ("gb200 186gb", "gb200 nvl72")),
    DeviceSpec("A100 SXM 80GB",  312.0,  312.0,  None,   156.0,  19.5, 80, 2.039,
               ("a100", "a100 80gb", "a100 sxm", "NVIDIA A100-SXM4-80GB")),
    DeviceSpec("A100 PCIe 80GB", 312.0,  312.0,  None,   156.0,  19.5, 80, 1.935,
               ("a100 pcie", "NVIDIA A100 80GB PCIe")),
    DeviceSpec("A100 SXM 40GB",  312.0,  312.0,  None,   156.0,  19.5, 40, 1.555,
               ("a100 40gb", "NVIDIA A100-SXM4-40GB")),
    DeviceSpec("A100 PCIe 40GB", 312.0,  312.0,  None,   156.0,  19.5, 40, 1.555,
               ("NVIDIA A100-PCIE-40GB",)),
    DeviceSpec("A10G",           70.0,   70.0,   None,   35.0,   31.2, 24, 0.6, ("a10g 24gb",)),
    DeviceSpec("A10",            125.0,  125.0,  None,   62.5,   31.2, 24, 0.6, ("a10 24gb",)),
    DeviceSpec("L40S",           362.05, 362.05, 733.0,  183.0,  91.6, 48, 0.864, ("l40s 48gb",)),
    DeviceSpec("L4",             121.0,  121.0,  242.5,  60.0,   30.3, 24, 0.3, ("l4 24gb",)),
    DeviceSpec("RTX PRO 6000 Blackwell Workstation", 503.8, 503.8, 1007.6, None, 125.0, 96, 1.792,
               ("rtx pro 6000", "rtx pro 6000 96gb", "rtx pro 6000 blackwell", "rtx pro 6000 workstation",
                "NVIDIA RTX PRO 6000 Blackwell Workstation Edition")),
    DeviceSpec("RTX PRO 6000 Blackwell Max-Q", 438.9, 438.9, 877.8, None, None, 96, 1.792,
               ("rtx pro 6000 max-q", "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition")),
    DeviceSpec("RTX PRO 6000 Blackwell Server", 503.8, 503.8, 1007.6, None, None, 96, 1.792,
               ("rtx pro 6000 server", "NVIDIA RTX PRO 6000 Blackwell Server Edition")),
    DeviceSpec("RTX 6000 Ada",   364.2,  364.2,  728.5,  182.1,  91.1, 48, 0.96,
               ("rtx 6000 ada 48gb", "NVIDIA RTX 6000 Ada Generation")),
    DeviceSpec("RTX A6000",      154.8,  154.8,  None,   77.4,   38.7, 48, 0.768, ("a6000", "rtx a6000 48gb")),
    DeviceSpec("RTX 5090",       209.5,  209.5,  419.0,  104.8,  104.8, 32, 1.792, ("5090", "rtx 5090 32gb")),
    DeviceSpec("RTX 4090",       165.2,  165.2,  330.3,  82.6,   82.6, 24, 1.008, ("4090", "rtx 4090 24gb")),
    DeviceSpec("RTX 3090",       71.0,   71.0,   None,   35.6,   35.6, 24, 0.936, ("3090", "rtx 3090 24gb")),
    DeviceSpec("RTX 4070",       58.3,   58.3,   116.6,  29.1,   29.1, 12, 0.504, ("4070", "rtx 4070 12gb")),
    DeviceSpec("RTX 3060 12GB",  25.5,   25.5,   None,   12.7,   12.7, 12, 0.36, ("3060", "rtx 3060", "rtx 3060 12gb")),
    DeviceSpec("V100 SXM2 32GB", None,   125.0,  None,   None,   15.7, 32, 0.9,
               ("v100", "v100 32gb", "Tesla V100-SXM2-32GB")),
    DeviceSpec("V100 SXM2 16GB", None,   125.0,  None,   None,   15.7, 16, 0.9, ("v100 16gb", "Tesla V100-SXM2-16GB")),
    DeviceSpec("T4",             None,   65.0,   None,   None,   8.1, 16, 0.32, ("t4 16gb", "Tesla T4")),
)

# CUDA compute capability of each entry (NVIDIA's CUDA GPUs list): what the dry run tells a
# traced step's kernel choices (flash attention needs 8.0+, fp8 8.9+) about the GPU it traces.
CAPABILITY: dict[str, tuple[int, int]] = {
    "H200 NVL": (9, 0), "H200": (9, 0), "GH200": (9, 0), "H100 NVL": (9, 0), "H100 PCIe": (9, 0), "H100 SXM": (9, 0),
    "H100 SXM 96GB": (9, 0),
    "B200": (10, 0), "GB200": (10, 0), "A100 SXM 80GB": (8, 0), "A100 PCIe 80GB": (8, 0), "A100 SXM 40GB": (8, 0),
    "A100 PCIe 40GB": (8, 0), "A10G": (8, 6), "A10": (8, 6), "L40S": (8, 9), "L4": (8, 9),
    "RTX PRO 6000 Blackwell Workstation": (12, 0), "RTX PRO 6000 Blackwell Max-Q": (12, 0),
    "RTX PRO 6000 Blackwell Server": (12, 0), "RTX 6000 Ada": (8, 9), "RTX A6000": (8, 6), "RTX 5090": (12, 0),
    "RTX 4090": (8, 9), "RTX 3090": (8, 6), "RTX 4070": (8, 9), "RTX 3060 12GB": (8, 6), "V100 SXM2 32GB": (7, 0),
    "V100 SXM2 16GB": (7, 0), "T4": (7, 5),
}


# Streaming multiprocessors of each entry (NVIDIA's architecture whitepapers: GA100 as shipped in
# A100 108, GH100 in H100 SXM (80 GB and 96 GB HBM2e) / H200 / GH200 132 and in H100 PCIe 114, GB100 in B200 148; the
# product datasheets of the others): what a matrix multiply's tiles are spread over in waves
# (plan/steptime.py). An entry without one gets no predicted step time. **Derived** where no page
# states it (:data:`DERIVED`): GB200 148 (B200's dual-die GB100, the count no GB200 page gives),
# RTX 3090 82 (10,496 CUDA cores / 128 per SM), RTX A6000 84 (the full GA102), L4 58 (121 TFLOP/s
# / (512 x 2 x boost); pages disagree, 58 or 60).
SMS: dict[str, int] = {
    "H200 NVL": 132, "H200": 132, "GH200": 132, "H100 NVL": 132, "H100 PCIe": 114, "H100 SXM": 132, "B200": 148,
    "GB200": 148, "RTX PRO 6000 Blackwell Max-Q": 188, "RTX PRO 6000 Blackwell Server": 188, "RTX 4070": 46,
    "RTX 3060 12GB": 28,
    "H100 SXM 96GB": 132,
    "A100 SXM 80GB": 108, "A100 PCIe 80GB": 108, "A100 SXM 40GB": 108, "A100 PCIe 40GB": 108, "A10G": 80, "A10": 72,
    "L40S": 142, "L4": 58, "RTX PRO 6000 Blackwell Workstation": 188, "RTX 6000 Ada": 142, "RTX A6000": 84,
    "RTX 5090": 170,
    "RTX 4090": 128, "RTX 3090": 82, "V100 SXM2 32GB": 80, "V100 SXM2 16GB": 80, "T4": 40,
}

# The constants above that no source states for the part itself, each with what it is derived
# from: a prediction that uses one says so ("derived: ...").
DERIVED: dict[str, tuple[str, ...]] = {
    "GB200": ("SM count 148: B200's GB100",),
    "RTX PRO 6000 Blackwell Server": ("dense bf16 peak 503.8: the Workstation Edition's (same GB202, 600 W)",
                                      "fp8 peak: twice bf16"),
    "RTX PRO 6000 Blackwell Workstation": ("fp8 peak: twice bf16",),
    "RTX PRO 6000 Blackwell Max-Q": ("fp8 peak: twice bf16",),
    "RTX 5090": ("fp8 peak 419: twice bf16, as on Ada (not published)",),
    "RTX 4070": ("dense bf16 peak 58.3: 512 FLOP/clk/SM x 46 SMs x 2.475 GHz",),
    "RTX 3060 12GB": ("dense bf16 peak 25.5: 512 FLOP/clk/SM x 28 SMs x 1.777 GHz",),
    "RTX 3090": ("SM count 82: 10,496 cores / 128",),
    "RTX A6000": ("SM count 84: the full GA102",),
    "L4": ("SM count 58: 121 TFLOP/s / (1,024 FLOP/clk/SM x 2.04 GHz); pages say 58 or 60",),
}

DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")

# Words that say nothing about which card it is.
# ("workstation" and "server" are not: they name two editions of the RTX PRO 6000 Blackwell.)
_NOISE = frozenset({"nvidia", "geforce", "tesla", "generation", "edition", "gpu", "graphics", "card"})


def name_key(name: str) -> tuple[str, ...]:
    """The matching key of a GPU name: sorted tokens, see the module docstring.

    >>> name_key("NVIDIA A100-SXM4-40GB") == name_key("a100 sxm 40 gb") == ('100', '40gb', 'a', 'sxm')
    True
    """
    s = re.sub(r"(\d+)\s*gi?b\b", r" \1gb ", name.lower())  # "40 GB", "40GiB" -> one "40gb" token
    tokens = re.findall(r"\d+gb|[a-z]+|\d+", s)
    out: list[str] = []
    for i, tok in enumerate(tokens):
        if tok in _NOISE:
            continue
        if tok.isdigit() and i > 0 and tokens[i - 1] == "sxm":  # SXM2/SXM4/SXM5 -> SXM
            continue
        out.append(tok)
    return tuple(sorted(out))


def _index() -> dict[tuple[str, ...], DeviceSpec]:
    index: dict[tuple[str, ...], DeviceSpec] = {}
    for spec in DEVICES:
        for alias in (spec.name, *spec.aliases):
            key = name_key(alias)
            other = index.setdefault(key, spec)
            if other is not spec:  # a table mistake, caught at import (and by the tests)
                raise AssertionError(f"GPU alias {alias!r} of {spec.name} also names {other.name}")
    return index


_INDEX = _index()


def lookup(device_name: str) -> DeviceSpec | None:
    """The table entry for a name such as ``"NVIDIA H100 80GB HBM3"`` or ``"a100 40gb"``, or None.

    Exact on the normalised name (:func:`name_key`): a name that is not an entry's name or
    alias is unknown, never taken for a card with a similar name.
    """
    return _INDEX.get(name_key(device_name))


def find(name: str) -> DeviceSpec | None:
    """Look up by table name (``"h100 sxm"``, ``"a100 40gb"``) or by a device-name string."""
    return lookup(name)


def accepted_names(spec: DeviceSpec) -> list[str]:
    """The spellings a user is shown for an entry: its name and its short aliases."""
    return [spec.name] + [a for a in spec.aliases if not a.lower().startswith(("nvidia", "tesla"))]


def unknown_gpu_message(name: str, flag: str = "--gpu") -> str:
    """Why ``name`` is refused: a did-you-mean and every known name."""
    def compact(s: str) -> str:  # "NVIDIA A100-40GB" -> "a10040gb": what the user typed, in order
        return "".join(w for w in re.findall(r"[a-z]+|\d+", s.lower()) if w not in _NOISE)

    candidates = {compact(a): a for spec in DEVICES for a in accepted_names(spec)}
    close = difflib.get_close_matches(compact(name), list(candidates), n=1, cutoff=0.5)
    hint = f" (did you mean {candidates[close[0]]!r}?)" if close else ""
    known = ", ".join(spec.name for spec in DEVICES)
    what = "names no GPU" if not name.strip() else "is not in the hardware table"
    return (f"{flag} {name!r} {what}{hint}; known GPUs: {known} (see --list-gpus for "
            "the accepted spellings), or give --peak-tflops and --memory-gb")


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
    aliases: tuple[str, ...] = ()  # other names --interconnect / --network accept (``25gbit``)
    # A network whose NIC the node's GPUs share (eth-25g), not one NIC per GPU. One ring over every
    # GPU crosses it once each way and has all of it; collectives that run side by side from each
    # GPU of a node (HSDP's and DiLoCo's per-shard all-reduces across groups) split it.
    shared: bool = False


def side_by_side(shared: bool, per_node: int, on_node: int) -> int:
    """How many collectives share a network's rate at once when every GPU of a node runs one that
    has ``on_node`` of its members on the node: per_node / on_node on a NIC the node's GPUs share
    (8 for HSDP's shard all-reduces on 8-GPU nodes, 1 for a ring over all of them), else 1."""
    return max(1, per_node // max(1, on_node)) if shared else 1


# Nominal per-GPU, one-direction bandwidths. Real all-reduce bus bandwidth (nccl-tests
# "busbw") lands below these: typically 70-90% of NVLink and ~80% of a PCIe link.
# A network link is also accepted as ``<N>gbit`` (N Gbit/s = N/8 GB/s): the four rates below
# are aliases of their entries (``25gbit`` is ``eth-25g``), any other N a link of its own.
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("pcie3", 16.0, "PCIe 3.0 x16 (no NVLink; traffic through the host or a PCIe switch)"),
    Link("pcie4", 32.0, "PCIe 4.0 x16 (e.g. A100 PCIe, RTX 3090/4090/A6000 servers)"),
    Link("pcie5", 64.0, "PCIe 5.0 x16 (e.g. H100 PCIe, L40S, RTX 5090 servers)"),
    Link("nvlink3", 300.0, "NVLink 3 (A100 SXM, 600 GB/s bidirectional)"),
    Link("nvlink4", 450.0, "NVLink 4 (H100/H200 SXM, 900 GB/s bidirectional)"),
    Link("nvlink5", 900.0, "NVLink 5 (B200, 1.8 TB/s bidirectional)"),
    Link("ib-hdr", 25.0, "InfiniBand HDR 200 Gb/s, one NIC per GPU", ("200gbit",)),
    Link("ib-ndr", 50.0, "InfiniBand NDR 400 Gb/s, one NIC per GPU", ("400gbit",)),
    Link("eth-100g", 12.5, "100 Gb/s Ethernet / RoCE, one NIC per GPU", ("100gbit",)),
    Link("eth-25g", 3.125, "25 Gb/s Ethernet shared by the node", ("25gbit",), shared=True),
)}

_GBIT = re.compile(r"(\d+(?:\.\d+)?)\s*gbit(?:/s)?")


def _gbit(text: str) -> float | None:
    """N of ``<N>gbit`` (also ``N gbit``, ``Ngbit/s``), else None."""
    m = _GBIT.fullmatch(text.strip().lower())
    return float(m.group(1)) if m else None


def find_link(name: str) -> Link | None:
    """The link ``--interconnect`` / ``--network`` name: a table name (``eth-25g``), an alias
    (``25gbit``), or ``<N>gbit`` for a rate the table has no entry for (``10gbit``: 1.25 GB/s).
    None when it is none of these.

    >>> find_link("25gbit").name, find_link("10gbit").gb_per_s
    ('eth-25g', 1.25)
    """
    key = name.strip().lower()
    for link in LINKS.values():
        if key == link.name or key in link.aliases:
            return link
    gbit = _gbit(key)
    if gbit is None or gbit <= 0:
        return None
    for link in LINKS.values():  # "25 gbit", "25.0gbit/s": still the alias's entry
        if gbit in (_gbit(a) for a in link.aliases):
            return link
    return Link(f"{gbit:g}gbit", gbit / 8, f"{gbit:g} Gb/s network link, one NIC per GPU ({gbit:g}/8 GB/s)")


def link_choices() -> str:
    """The names ``--interconnect`` / ``--network`` accept, for an error message."""
    return ", ".join(LINKS) + ", or <N>gbit (N Gbit/s, e.g. 25gbit, 100gbit, 400gbit)"


def unknown_link_message(flag: str, name: str) -> str:
    """Why ``name`` is refused as a link, in one line naming the choices."""
    return f"{flag} {name!r} is not known; choose one of {link_choices()}"


# The network between nodes when --network is not given, for every multi-node figure: plan (its
# scaling rows and wall time), plan --trace, preflight --dry-run and its --rank. 400 Gb/s a GPU
# (InfiniBand NDR, one NIC per GPU) is what a multi-node cluster of the dry run's default GPU, the
# H100 SXM, typically has -- NVIDIA's DGX H100 and its SuperPOD give each GPU its own ConnectX-7
# NDR port, and the clouds' H100 nodes match it (AWS p5: 3,200 Gb/s of EFA for 8 GPUs; Azure ND
# H100 v5: 400 Gb/s InfiniBand a GPU) -- and H200/B200 nodes keep it. Older or cheaper clusters are
# slower: DGX A100 has HDR, 200 Gb/s a GPU (--network ib-hdr); Ethernet between rented nodes is
# often 25-100 Gb/s shared by the node (--network 25gbit). Every output that used it says so.
DEFAULT_NETWORK = "ib-ndr"


def find_network(name: str | None) -> Link | None:
    """The link ``--network`` names (:func:`find_link`), :data:`DEFAULT_NETWORK`'s when none
    (or an empty name) is given; None for a name that is no link."""
    return find_link(name or DEFAULT_NETWORK)


def network_facts(name: str | None) -> dict[str, Any] | None:
    """What a multi-node figure says of the network it assumed (``--json``'s ``network``): the
    link's table name, its rate per GPU in Gb/s and GB/s, and whether it is the default (no
    ``--network``). None for a name that is no link."""
    link = find_network(name)
    if link is None:
        return None
    return {"name": link.name, "gbit_per_s": link.gb_per_s * 8, "gb_per_s": link.gb_per_s, "default": not name,
            "nic": "shared by the node" if link.shared else "one per GPU"}


def default_link(spec: DeviceSpec | None) -> str:
    """The usual intra-node link for a device: NVLink on SXM parts, PCIe otherwise."""
    if spec is None:
        return "pcie4"
    return {"H200": "nvlink4", "GH200": "nvlink4", "H100 SXM": "nvlink4", "H100 SXM 96GB": "nvlink4",
            "B200": "nvlink5",
            "A100 SXM 80GB": "nvlink3", "A100 SXM 40GB": "nvlink3", "H100 PCIe": "pcie5", "H100 NVL": "pcie5",
            "H200 NVL": "pcie5",
            "GB200": "nvlink5", "L40S": "pcie4", "RTX 5090": "pcie5", "RTX PRO 6000 Blackwell Workstation": "pcie5",
            "RTX PRO 6000 Blackwell Max-Q": "pcie5", "RTX PRO 6000 Blackwell Server": "pcie5"}.get(spec.name, "pcie4")
