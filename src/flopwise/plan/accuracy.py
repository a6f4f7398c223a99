"""How far a predicted step time is expected to be off: the range the evidence supports.

The step-time model (``plan/steptime.py``) was held against public measurements it was not
calibrated on: ``benchmarks/predict_vs_public.py --holdout``, whose rows are below
(:data:`HELD_OUT`, from :data:`SOURCE`). Each is the ratio of the predicted to the measured
tokens/s of one public run, so the run's real step time is the predicted one times that ratio.
:func:`band` picks the rows of a prediction's regime -- the GPU's architecture, the model's size
class, one node or several -- and gives the range of their ratios: "likely between".

A regime with fewer than :data:`MIN_CASES` rows is widened (first across node counts, then across
sizes, then across architectures) and the band says which rows it took. The rows are runs of
other stacks, priced with their own attention kernels where those were measured: flopwise's own
step has never been measured on a GPU, and every band says so. Plain arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SOURCE = "benchmarks/results/predict-vs-public-all-traced-2026-11-29.json"
MIN_CASES = 3
SIZES = ((0.5e9, "under 0.5B"), (3e9, "0.5-3B"), (float("inf"), "over 3B"))  # parameters, upper bound
ARCH_NAMES = {"sm80": "A100-class (sm80)", "sm90": "H100-class (sm90)"}


@dataclass(frozen=True)
class Evidence:
    """One held-out public run: its case id, the architecture it ran on, the model's parameters (as
    flopwise counts them), GPUs and nodes, and predicted / measured tokens/s."""

    case: str
    arch: str
    params: float
    gpus: int
    nodes: int
    ratio: float


# benchmarks/predict_vs_public.py --holdout, rows of its "held out" set (SOURCE): case, arch,
# parameters, GPUs, nodes, predicted / measured tokens/s per GPU (the source's attention kernel)
HELD_OUT: tuple[Evidence, ...] = (
    Evidence("MF-125m-a100-1k", "sm80", 124.5e6, 8, 1, 0.991),
    Evidence("MF-125m-a100-4k", "sm80", 126.9e6, 8, 1, 0.989),
    Evidence("MF-125m-a100-8k", "sm80", 130.0e6, 8, 1, 0.983),
    Evidence("MF-350m-a100-1k", "sm80", 354.9e6, 8, 1, 0.990),
    Evidence("MF-350m-a100-4k", "sm80", 358.1e6, 8, 1, 0.953),
    Evidence("MF-350m-a100-8k", "sm80", 362.3e6, 8, 1, 0.963),
    Evidence("MF-760m-a100-1k", "sm80", 758.9e6, 8, 1, 1.182),
    Evidence("MF-760m-a100-4k", "sm80", 763.6e6, 8, 1, 0.960),
    Evidence("MF-760m-a100-8k", "sm80", 769.9e6, 8, 1, 0.944),
    Evidence("MF-1b-a100-1k", "sm80", 1.31e9, 8, 1, 0.999),
    Evidence("MF-1b-a100-4k", "sm80", 1.32e9, 8, 1, 0.970),
    Evidence("MF-1b-a100-8k", "sm80", 1.33e9, 8, 1, 0.971),
    Evidence("MF-760m-h100-1k", "sm90", 758.9e6, 8, 1, 1.043),
    Evidence("MF-760m-h100-4k", "sm90", 763.6e6, 8, 1, 0.993),
    Evidence("MF-760m-h100-8k", "sm90", 769.9e6, 8, 1, 0.940),
    Evidence("MF-1b-h100-1k", "sm90", 1.31e9, 8, 1, 1.117),
    Evidence("MF-1b-h100-4k", "sm90", 1.32e9, 8, 1, 0.993),
    Evidence("MF-1b-h100-8k", "sm90", 1.33e9, 8, 1, 0.956),
    Evidence("TT-13a", "sm80", 13.02e9, 64, 8, 0.836),
    Evidence("TT-13b", "sm80", 13.02e9, 64, 8, 0.944),
    Evidence("TT-70a", "sm80", 70.55e9, 64, 8, 1.009),
    Evidence("TT-70b", "sm80", 68.98e9, 64, 8, 0.962),
    Evidence("TTH-8", "sm90", 8.03e9, 8, 1, 1.134),
    Evidence("TTH-8c", "sm90", 8.03e9, 8, 1, 1.241),
    Evidence("TTH-128", "sm90", 8.03e9, 128, 16, 1.123),
    Evidence("TTH-128c", "sm90", 8.03e9, 128, 16, 1.215),
    Evidence("F-1-bf16", "sm90", 8.03e9, 8, 1, 1.328),
    # torchtitan's H100 float8 rows (torchao tensorwise, fp8 all-gather)
    Evidence("TTH-8f", "sm90", 8.03e9, 8, 1, 1.176),
    Evidence("TTH-128f", "sm90", 8.03e9, 128, 16, 1.139),
    Evidence("TTH-32k-f8", "sm90", 8.03e9, 8, 1, 1.249),
)


def size_class(params: float) -> str:
    return next(name for bound, name in SIZES if params < bound)


def band(arch: str, params: float, gpus: int, nodes: int,
         evidence: tuple[Evidence, ...] = HELD_OUT) -> dict[str, Any] | None:
    """The range of predicted/measured ratios of the held-out runs in this regime, widened until it
    holds :data:`MIN_CASES` of them: ``{"low", "high", "cases", "regime"}`` (the real step is the
    predicted one times a ratio between ``low`` and ``high``); None without evidence at all."""
    several = nodes > 1
    size = size_class(params)
    arch_name = ARCH_NAMES.get(arch, arch)
    widenings = [
        (lambda e: e.arch == arch and size_class(e.params) == size and (e.nodes > 1) == several,
         f"{arch_name}, {size}, {'several nodes' if several else 'one node'}"),
        (lambda e: e.arch == arch and size_class(e.params) == size, f"{arch_name}, {size}, any node count"),
        (lambda e: e.arch == arch, f"{arch_name}, any size"),
        (lambda e: True, "every GPU and size"),
    ]
    for keep, regime in widenings:
        rows = [e for e in evidence if keep(e)]
        if len(rows) >= MIN_CASES:
            ratios = [e.ratio for e in rows]
            return {"low": min(ratios), "high": max(ratios), "cases": [e.case for e in rows], "regime": regime}
    return None


def band_text(b: dict[str, Any]) -> str:
    """Where the band comes from, in words, for a prediction's line."""
    return (f"the errors of {len(b['cases'])} held-out public runs ({b['regime']}): predicted/measured "
            f"{b['low']:.2f}-{b['high']:.2f}; flopwise's own step was never measured on a GPU")
