"""Throughput, MFU and memory, measured the same way everywhere.

Timing is taken between logging points, where the host synchronises anyway (reading the
loss with ``.item()``), so the training step itself never waits on the device just to be
timed. Steps before ``warmup_steps`` (compilation, allocator warm-up, first data reads)
are excluded from the run averages.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import TypedDict

import torch


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB: allocated/peak/reserved on CUDA; resident set (and its peak) on CPU."""
    gib = 1024**3
    if device.type == "cuda":
        return {
            "mem_alloc_gb": torch.cuda.memory_allocated(device) / gib,
            "mem_peak_gb": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gb": torch.cuda.memory_reserved(device) / gib,
        }
    return {"mem_rss_gb": _rss_bytes() / gib, "mem_rss_peak_gb": _peak_rss_bytes() / gib}


def _rss_bytes() -> int:
    try:  # Linux: resident pages are the second field of statm
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def format_memory(mem: dict[str, float]) -> str:
    if "mem_alloc_gb" in mem:
        return (f"mem {mem['mem_alloc_gb']:.2f}/{mem['mem_peak_gb']:.2f}/{mem['mem_reserved_gb']:.2f} GiB "
                "(alloc/peak/reserved)")
    return f"rss {mem['mem_rss_gb']:.2f} GiB"


class WindowRates(TypedDict):
    """One logged window's rates (:meth:`ThroughputMeter.window`)."""

    tok_per_s: float
    step_time_s: float
    mfu: float | None  # None without a peak to divide by


@dataclass
class ThroughputMeter:
    """Tokens/s and MFU over logging windows and over the whole run after warm-up.

    ``flops_per_token`` follows :func:`flopwise.plan.flops.flops_per_token`;
    ``peak_flops`` is the dense peak of all devices together (FLOP/s), or None when
    unknown, which makes MFU None ("n/a").
    """

    flops_per_token: float
    peak_flops: float | None
    warmup_steps: int = 3
    _window_start: float = 0.0
    _window_steps: int = 0
    _window_tokens: int = 0
    _steady_time: float = 0.0
    _steady_tokens: int = 0
    _steady_steps: int = 0
    _steps_seen: int = 0

    def __post_init__(self) -> None:
        self._window_start = time.perf_counter()

    def step(self, tokens: int) -> None:
        """Count one optimizer step of ``tokens`` tokens (call after issuing the step)."""
        self._steps_seen += 1
        self._window_steps += 1
        self._window_tokens += tokens

    def window(self) -> WindowRates:
        """Close the current window (the caller has synchronised) and return its rates."""
        now = time.perf_counter()
        dt = max(now - self._window_start, 1e-9)
        tok_s = self._window_tokens / dt
        # A window counts towards the run average only if all its steps are past warm-up.
        if self._steps_seen - self._window_steps >= self.warmup_steps:
            self._steady_time += dt
            self._steady_tokens += self._window_tokens
            self._steady_steps += self._window_steps
        out: WindowRates = {
            "tok_per_s": tok_s,
            "step_time_s": dt / max(self._window_steps, 1),
            "mfu": self.mfu(tok_s),
        }
        self._window_start, self._window_steps, self._window_tokens = now, 0, 0
        return out

    def pace(self) -> float | None:
        """Seconds per step over every steady-state window so far (None before the first): what an
        ETA is paced by, so that one slow or fast window on a loaded machine moves it by its share
        of the run, not by itself (a window's own step time made the ETA jump 0m54s -> 6m29s -> 5m22s)."""
        return self._steady_time / self._steady_steps if self._steady_steps else None

    def pause(self) -> None:
        """Restart the window clock, so time spent in evaluation or saving is not counted."""
        self._window_start = time.perf_counter()

    def mfu(self, tok_per_s: float) -> float | None:
        if not self.peak_flops:
            return None
        return tok_per_s * self.flops_per_token / self.peak_flops

    def summary(self) -> dict[str, float | None]:
        """Averages over the steady-state (post warm-up) windows."""
        if self._steady_time <= 0:
            return {"tok_per_s": None, "mfu": None, "steady_time_s": 0.0}
        tok_s = self._steady_tokens / self._steady_time
        return {"tok_per_s": tok_s, "mfu": self.mfu(tok_s), "steady_time_s": self._steady_time}


# Differences below this share of tok/s are noise whatever a measurement's own spread says: a
# few timed windows under-estimate the run-to-run variation (a preflight choice once flipped on 1.5%).
MIN_NOISE = 0.02


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2

