"""Where a training step's time goes, the profiler, and NVTX ranges.

:class:`StepTimer` splits each step into waiting for data, forward+backward, optimizer
and logging, summed over a logging window:

- host times (``time.perf_counter``) for data, logging and the whole step; on a CPU the
  forward+backward and optimizer times are host times too;
- on CUDA the forward+backward and optimizer times come from CUDA events recorded
  around them: recording never waits, and the events are read at the logging step, where
  the loop synchronises anyway. The events' spans over the step's wall time give the
  **CPU overhead** share: the time the GPU sat idle waiting for the host (launches,
  Python, data) -- **at least** that much: an idle gap *inside* a span (the host
  launching slower than the GPU runs, a data wait between micro-batches) lies between
  the two events and counts as busy. Only the profiler (``train.profile``) sees those,
  so the log prints the share as a lower bound (``cpu overhead ≥N%``).

:func:`profiler` is a null context unless ``train.profile``; :func:`nvtx` likewise
unless ``train.nvtx`` on CUDA, so neither costs anything when off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

# Told ``(done, of)`` micro-batches of each step as it goes (micro_batch_progress): the one
# place every step passes through -- the trainer's and a preflight trial's alike -- so a caller
# that reports progress within long steps (preflight) reaches it without a parameter threaded
# through the trainer's setup.
_progress: ContextVar[Callable[[int, int], None] | None] = ContextVar("micro_batch_progress", default=None)


@contextlib.contextmanager
def micro_batch_progress(tell: Callable[[int, int], None]) -> Iterator[None]:
    """Within it (this thread and context), every step's :meth:`StepTimer.timed_batches` calls
    ``tell(done, of)``: ``done`` 0 as a step of ``of`` micro-batches starts, then after each."""
    token = _progress.set(tell)
    try:
        yield
    finally:
        _progress.reset(token)


class StepTimer:
    PARTS = ("data", "fwd_bwd", "optim", "log")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.host = dict.fromkeys(self.PARTS, 0.0)
        self.events: dict[str, list[tuple]] = {"fwd_bwd": [], "optim": []}
        self.wall = 0.0
        self.steps = 0

    @contextlib.contextmanager
    def part(self, name: str):
        """Time a section; on CUDA, fwd_bwd and optim are also bracketed by events."""
        ev = None
        if self.cuda and name in self.events:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.host[name] += time.perf_counter() - t
            if ev is not None:
                ev[1].record()
                self.events[name].append(ev)

    def timed_batches(self, next_batch, n: int):
        """``n`` micro-batches from ``next_batch``, the time spent fetching them counted as data;
        the :func:`micro_batch_progress` callback, if one is set, told of each one done."""
        tell = _progress.get()
        for i in range(n):
            if tell is not None:
                tell(i, n)  # i done: 0 as the step starts
            t = time.perf_counter()
            batch = next_batch()
            self.host["data"] += time.perf_counter() - t
            yield batch
        if tell is not None:
            tell(n, n)

    def end_step(self, wall_s: float) -> None:
        self.wall += wall_s
        self.steps += 1

    def window(self) -> dict[str, float | None]:
        """Mean seconds per step of each part over the window (and the CPU overhead share on
        CUDA); resets. Data time was counted inside fwd_bwd's host time and is taken out."""
        n = max(self.steps, 1)
        out: dict[str, float | None] = {"time_data_s": self.host["data"] / n}
        if self.cuda:
            torch.cuda.synchronize()  # the events of this window are done by now anyway
            gpu = {k: sum(a.elapsed_time(b) for a, b in v) / 1000 for k, v in self.events.items()}
            out["time_fwd_bwd_s"] = gpu["fwd_bwd"] / n
            out["time_optim_s"] = gpu["optim"] / n
            busy = gpu["fwd_bwd"] + gpu["optim"]
            out["cpu_overhead"] = max(0.0, 1.0 - busy / self.wall) if self.wall > 0 else None
        else:
            out["time_fwd_bwd_s"] = max(self.host["fwd_bwd"] - self.host["data"], 0.0) / n
            out["time_optim_s"] = self.host["optim"] / n
        out["time_log_s"] = self.host["log"] / n
        self.reset()
        return out


def format_breakdown(parts: Mapping[str, float | None], step_s: float) -> str:
    if step_s <= 0:
        return ""
    # the parts' times are never None (only cpu_overhead is, when no wall time was counted)
    share = {k: 100 * (parts[f"time_{k}_s"] or 0.0) / step_s for k in ("data", "fwd_bwd", "optim")}
    text = f"data {share['data']:.1f}% · fwd+bwd {share['fwd_bwd']:.0f}% · opt {share['optim']:.0f}%"
    if (overhead := parts.get("cpu_overhead")) is not None:
        text += f" · cpu overhead ≥{100 * overhead:.0f}%"  # a lower bound (module docstring)
    return text


def profiler(enabled: bool, out_dir: Path, wait: int, warmup: int, active: int):
    """``torch.profiler`` over one wait/warm-up/active cycle, TensorBoard traces in ``out_dir``;
    a null context (whose ``step`` does nothing) when off."""
    if not enabled:
        return _NoProfiler()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(out_dir)), record_shapes=True, with_stack=False)


class _NoProfiler:
    """What ``profiler`` gives when off: a context and a ``step`` that do nothing."""

    def __enter__(self) -> "_NoProfiler":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        pass


def nvtx(enabled: bool, name: str):
    """An NVTX range for Nsight Systems when enabled on CUDA, else a null context."""
    if enabled and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()
