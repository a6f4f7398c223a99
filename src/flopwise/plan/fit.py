"""Does the planned step fit the machine at hand? Asked before the model or a batch exists.

The planner (``plan/memory.py``) knows a step's peak bytes per rank from the config alone;
:func:`check_memory_fit` compares that with what this rank can use -- on CUDA the GPU's free
memory (``torch.cuda.mem_get_info``), on a CPU the memory the kernel says is available
(``MemAvailable``; lower where a cgroup limit leaves less) shared by the ranks on this host
(``LOCAL_WORLD_SIZE``) -- and refuses with both numbers and the changes that would fit
(``plan.budget.fit_suggestions``: the ones ``flopwise plan`` prints, as training overrides),
instead of the allocator's "can't allocate memory" or a CUDA OOM after the model was built.

The plan is an estimate (exact to ~0.1% on CPU, within a few percent with checkpointing:
``plan/memory.py``), so only a plan above all of the available memory is refused; the
changes suggested leave the planner's usual 10% headroom.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from flopwise.config import RunConfig
from flopwise.errors import FlopwiseError
from flopwise.plan.budget import GIB, build_plan, run_plan_inputs

SUGGESTION_HEADROOM = 0.9  # a suggested change leaves 10% of the available memory free, as `flopwise plan` does
_UNLIMITED = 1 << 60  # a cgroup v1 limit at least this large means "no limit"

# (bytes this rank may use, where that number comes from) or None when unknown
Available = tuple[int, str] | None


class MemoryFitError(FlopwiseError, RuntimeError):
    """The planned step does not fit the memory this rank has; nothing was allocated."""

    every_rank = True  # every rank plans the same step: rank 0 says it once


def _meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this container's memory limit leaves (limit - usage, reclaimable page cache not
    counted as used), or None without a limit. cgroup v2, else v1's memory controller."""
    for limit_file, usage_file, stat_key, stat_dir in (
            ("memory.max", "memory.current", "inactive_file", root),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file",
             root / "memory")):
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is None or usage is None or limit >= _UNLIMITED:
            continue
        used = max(0, usage - _stat(stat_dir / "memory.stat", stat_key))
        return max(0, limit - used)
    return None


def available_memory(device: torch.device, local_ranks: int = 1) -> Available:
    """The bytes one rank on ``device`` can use and where that number comes from; None where
    it is unknown (then nothing is checked). Tests replace this function to say "this machine
    has 1 GiB"."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return int(free), f"free on cuda:{index} (torch.cuda.mem_get_info)"
    if device.type != "cpu":
        return None
    host, source = _meminfo_available(), "MemAvailable in /proc/meminfo"
    if host is None:
        try:
            host, source = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"
        except (OSError, ValueError, AttributeError):
            return None
    limited = _cgroup_available()
    if limited is not None and limited < host:
        host, source = limited, "what the cgroup memory limit leaves"
    if local_ranks > 1:
        return host // local_ranks, f"{source}, shared by {local_ranks} ranks on this host"
    return host, source


def local_rank_count(world_size: int) -> int:
    """The ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``; all of them when it is not set)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "") or world_size))
    except ValueError:
        return max(1, world_size)


def _gib(n: float) -> str:
    return f"{n:,.2f} GiB"


def suggestions(cfg: RunConfig, device: torch.device, precision: str, loss: str, strategy: str, world: int,
                available: int) -> list[str]:
    """What ``flopwise plan`` would suggest for this run with ``available`` bytes per rank,
    as the training overrides that make it fit (each with the GiB it needs), cheapest first."""
    inp = run_plan_inputs(cfg, None, precision, loss=loss, gpus=world, strategy=strategy)
    plan = build_plan(replace(inp, gpu=None, memory_gb=available / GIB, headroom=SUGGESTION_HEADROOM))
    fit: dict[str, Any] = plan["fit"]
    out = []
    if fit.get("proposed"):
        out.append(f"parallel.strategy={fit['proposed']} "
                   f"({_gib(fit['per_strategy'][fit['proposed']]['memory_gb'])})")
    for way in fit.get("suggestions") or []:
        if way["gpus"] != world:  # more ranks: only more GPUs add memory (CPU ranks on one host share it)
            if device.type != "cuda":
                continue
            micro = f" train.micro_batch_size={way['micro_batch']}" if way.get("micro_batch") else ""
            full = (" train.activation_checkpointing=full"
                    if way["checkpointing"] == "full" and cfg.train.activation_checkpointing != "full" else "")
            out.append(f"{way['gpus']} GPUs with parallel.strategy={way['strategy']}{full}{micro} "
                       f"({_gib(way['memory_gb'])} per GPU)")
        elif way["checkpointing"] != cfg.train.activation_checkpointing:
            out.append(f"train.activation_checkpointing={way['checkpointing']} ({_gib(way['memory_gb'])})")
        else:
            out.append(f"train.micro_batch_size={way['micro_batch']} ({_gib(way['memory_gb'])}; the same global "
                       "batch, more accumulation)")
    return out


def check_memory_fit(cfg: RunConfig, plan: dict[str, Any], device: torch.device, precision: str, loss: str,
                     strategy: str, world: int, measure: Callable[[torch.device, int], Available] | None = None,
                     ) -> Available:
    """Refuse (:class:`MemoryFitError`) a run whose planned per-rank peak (``plan["memory_gb"]``,
    the plan of :func:`~flopwise.plan.budget.plan_for_run` with these arguments) exceeds what this
    rank has (``measure``, by default :func:`available_memory`, looked up when called so a test
    can replace it). Returns what was measured (None: unknown, nothing checked)."""
    measured = (measure or available_memory)(device, local_rank_count(world) if device.type == "cpu" else 1)
    if measured is None:
        return None
    available, source = measured
    need = plan["memory_gb"] * GIB
    if need <= available:
        return measured
    ways = suggestions(cfg, device, precision, loss, strategy, world, available)
    fix = ("fits with " + " or ".join(ways) if ways else
           "no smaller micro-batch, activation checkpointing or strategy fits: a smaller model or "
           "train.seq_len, or a machine with more memory")
    ranks = f" per rank ({world} ranks)" if world > 1 else ""
    raise MemoryFitError(
        f"the planned step needs {_gib(need / GIB)}{ranks} (the planner's estimate of parameters, gradients, "
        f"optimizer state and activations at micro-batch {cfg.train.micro_batch_size} x seq {cfg.train.seq_len}, "
        f"precision {precision}) but {device.type.upper()} memory available is {_gib(available / GIB)} ({source}); "
        f"nothing was allocated; {fix}")
