"""Checkpoints of a data-parallel run: who writes what, and how any world size reads it.

Two formats, one directory protocol (``checkpoint.py``: hidden directory, CRC32 manifest,
``COMPLETE`` last, atomic rename):

- **full** (single, ddp, zero1): every rank holds the whole model, so rank 0 writes
  ``model.pt`` and ``optimizer.pt`` exactly as a one-process run does (ZeRO-1 first
  gathers the optimizer shards to rank 0: ``consolidate_state_dict``). Any number of
  ranks, under any of these strategies, resumes it.
- **sharded** (fsdp2): no rank holds the whole model; every rank writes its own shards
  with ``torch.distributed.checkpoint`` into ``sharded/`` (model and optimizer, keyed by
  parameter name, with the global shapes in ``sharded/.metadata``). DCP re-shards on load,
  so N ranks' checkpoint resumes at M ranks -- or in one process (eval, export, ``single``).
  Each rank checksums the files it wrote; rank 0 adds its entries to the manifest.

- **DiLoCo** (diloco): group 0's checkpoint as its inner strategy writes it (full under
  DDP, ``sharded/`` under FSDP2, by DCP over the group's ranks): what eval and export read,
  and after the run's last sync every group holds it. Beside it, in ``diloco/``: ``outer.pt``
  -- the anchor, the outer momentum and counters, the same in every group -- and
  ``group-K.pt``, group K's fragments in flight and, for K > 0 under DDP, its weights and
  inner optimizer state (under FSDP2 those are DCP's ``diloco/group-K/``, and both ``.pt``
  files are per rank of the group: ``outer-I.pt``, ``group-K-I.pt``). It resumes at the same
  groups and inner strategy; another strategy's checkpoint resumes under diloco with the
  anchor at its weights, and a DiLoCo one under another strategy only from an outer sync
  (:func:`flopwise.parallel.diloco.leave_diloco`: between syncs it is refused).

Around all: ``rng.pt`` holds rank 0's generator states at the top (what one process
reads) and every rank's under ``"ranks"``; ``state.json`` holds the loader position --
the epoch loader's is global, the random loader's is per rank (``"loader_ranks"``).
A full checkpoint resumed under fsdp2 is converted on the fly (each rank loads the full
state and keeps its shards); a sharded one cannot resume under zero1 (refused).

Reading either format safely -- DCP's pickled index through an allow-list, its non-tensor
values with ``weights_only=True`` -- is :mod:`flopwise.checkpoints`' (``load_checkpoint``), which
eval and export use too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flopwise.checkpoints import (
    SHARDED,
    first_failure,
    load_checkpoint,
    load_sharded,
    load_tensors,
    read_state,
    verify_checkpoint,
)
from flopwise.config import ConfigError
from flopwise.manifest import file_entry, write_checksummed
from flopwise.parallel.diloco import DiLoCo, leave_diloco
from flopwise.parallel.distributed import DistEnv
from flopwise.parallel.strategy import shards_parameters
from flopwise.train.checkpoint import begin_save, discard_save, rng_state, save_checkpoint, save_failed

DILOCO = "diloco"  # the directory of a DiLoCo checkpoint's own files


@dataclass(frozen=True)
class RankParts:
    """What this rank saves a checkpoint from and loads one into: the process group, the
    strategy (which laid out the model and optimizer), the model and optimizer (what the
    optimizer steps: fp32, sharded under fsdp2), the device (whose RNG is saved; where tensors
    load) and, in a DiLoCo run, its outer loop (whose files go beside group 0's checkpoint)."""

    env: DistEnv
    strategy: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    outer: DiLoCo | None = None


Entries = dict[str, dict[str, int]]  # a checkpoint file's path inside it -> its manifest entry (size, CRC32)


def save_distributed(run_dir: Path, step: int, parts: RankParts, state: dict[str, Any], config_yaml: str) -> Path:
    """Write step ``step``'s checkpoint from every rank (a collective); returns its path on all.
    ``state``: state.json's contents, this rank's loader position under ``"loader"`` (every
    rank's is kept, under ``"loader_ranks"``)."""
    env, model, optimizer = parts.env, parts.model, parts.optimizer
    rngs = env.gather(rng_state(parts.device))
    loaders = env.gather(state["loader"])
    state = dict(state)
    rng = None
    if env.is_main:
        assert rngs is not None  # gathered on the main rank
        rng = dict(rngs[0])
        if env.world_size > 1:
            rng["ranks"] = rngs
            state["loader_ranks"] = loaders

    def finish(written: Entries, weights: bool = False) -> Path:
        """The rest of the checkpoint and its manifest, around the files the ranks wrote; with
        ``weights``, ``model.pt`` and ``optimizer.pt`` too (group 0 of a DiLoCo run over DDP)."""
        return save_checkpoint(run_dir, step, model if weights else None, optimizer if weights else None, state,
                               config_yaml, rng=rng, prewritten=written)

    if parts.outer is not None:
        outer = parts.outer
        weights = not outer.sharded
        return _save_prewritten(run_dir, step, env,  # on_every_rank: a full disk on one rank raises on all
                                lambda tmp: env.on_every_rank(lambda: _write_diloco(tmp, parts, outer)),
                                lambda written: finish(written, weights))
    if not shards_parameters(parts.strategy):
        if parts.strategy == "zero1":
            # every rank sends its shard of the AdamW state (zero1: a ZeroRedundancyOptimizer)
            optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        return env.on_main(lambda: save_checkpoint(run_dir, step, model, optimizer, state, config_yaml, rng=rng))
    return _save_prewritten(run_dir, step, env, lambda tmp: _write_shards(tmp, parts), finish)


def _save_prewritten(run_dir: Path, step: int, env: DistEnv, write: Callable[[Path], Entries],
                     finish: Callable[[Entries], Path]) -> Path:
    """A save in which every rank writes files: rank 0 begins the checkpoint's hidden
    directory, every rank runs ``write(directory)``, which returns the manifest entries of the
    files it wrote and fails on every rank or on none; then rank 0 ``finish``-es the checkpoint
    with all ranks' entries. A failed write discards the directory and raises on every rank."""
    from torch.distributed.checkpoint import CheckpointException  # lazy: see _dcp_save

    tmp = env.on_main(lambda: begin_save(run_dir, step))
    try:
        mine = write(tmp)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - whatever a full disk looks like to DCP
        env.on_main(lambda: discard_save(run_dir, step))
        raise save_failed(run_dir, step, first_failure(e)) from e
    entries = env.gather(mine)

    def complete() -> Path:
        assert entries is not None  # on_main: gathered on this rank
        return finish({k: v for part in entries for k, v in part.items()})

    return env.on_main(complete)


def _dcp_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: Path, group: Any = None) -> None:
    """This rank's shards of ``model`` and ``optimizer`` into ``out``, by DCP over ``group`` (None:
    every rank), its files synced."""
    # lazy, as in checkpoints.load_sharded: DCP with the DTensor it brings costs up to 1.3 s of CPU
    # to import, paid by a process that never writes a sharded checkpoint unless it loaded them already
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(out, sync_files=True),
             process_group=group)


def _write_shards(tmp: Path, parts: RankParts) -> Entries:
    """fsdp2: this rank's shards of the model and optimizer into ``sharded/``, by DCP, which
    gathers every rank's outcome (a full disk on one rank raises on all of them)."""
    env = parts.env
    out = tmp / SHARDED
    _dcp_save(parts.model, parts.optimizer, out)
    env.barrier()  # every rank's files are written (and .metadata, by rank 0) before they are listed
    return {f"{SHARDED}/{p.name}": file_entry(p) for p in sorted(out.iterdir())
            if p.name.startswith(f"__{env.rank}_") or (env.is_main and not p.name.startswith("__"))}


def _write_diloco(tmp: Path, parts: RankParts, outer: DiLoCo) -> Entries:
    """DiLoCo: this rank's part of group 0's checkpoint as its inner strategy writes it (the
    sharded files under FSDP2; model.pt and optimizer.pt, under DDP, are ``finish``'s), beside
    it the outer loop's files and every other group's own (see the module docstring)."""
    model, optimizer = parts.model, parts.optimizer
    g, sharded = outer.g, outer.sharded
    tag = f"-{g.inner_rank}" if sharded else ""  # FSDP2 inside: every rank's state is its own
    files: Entries = {}
    (tmp / DILOCO).mkdir(exist_ok=True)
    if sharded:  # the group's weights and optimizer: DCP over the group's ranks
        target = SHARDED if g.index == 0 else f"{DILOCO}/group-{g.index}"
        _dcp_save(model, optimizer, tmp / target, group=parts.env.group)
        for p in sorted((tmp / target).iterdir()):  # DCP names files by the rank within the group
            if p.name.startswith(f"__{g.inner_rank}_") or (g.inner_rank == 0 and not p.name.startswith("__")):
                files[f"{target}/{p.name}"] = file_entry(p)
    if sharded or g.inner_rank == 0:  # DDP inside: the group's first rank speaks for it
        part = outer.group_state()
        if g.index > 0 and not sharded:  # group 0's are model.pt and optimizer.pt
            part.update(model=model.state_dict(), optimizer=optimizer.state_dict())
        name = f"{DILOCO}/group-{g.index}{tag}.pt"
        files[name] = write_checksummed(tmp / name, lambda f: torch.save(part, f))
        if g.index == 0:  # the outer state is the same in every group
            name = f"{DILOCO}/outer{tag}.pt"
            files[name] = write_checksummed(tmp / name, lambda f: torch.save(outer.state_dict(), f))
    return files


def _load_diloco(path: Path, parts: RankParts, outer: DiLoCo) -> str:
    """This group's weights, optimizer and fragments in flight, and the outer loop's state, from
    a DiLoCo checkpoint (group 0's weights are loaded already); from another strategy's, the
    anchor at its weights. Returns a note for the log ("" when there is nothing to say)."""
    model, optimizer, map_location = parts.model, parts.optimizer, parts.device
    g, tag = outer.g, f"-{outer.g.inner_rank}" if outer.sharded else ""
    outer_file, group_file = path / DILOCO / f"outer{tag}.pt", path / DILOCO / f"group-{g.index}{tag}.pt"
    if not (path / DILOCO).is_dir():
        outer.reset_anchor()
        return f"{path.name} was not saved by DiLoCo: the anchor starts at its weights"
    if not outer_file.is_file() or not group_file.is_file():
        raise ConfigError([f"{path}: a DiLoCo checkpoint without {outer_file.name} or {group_file.name}: it was "
                           f"saved by another number of groups or ranks per group than this launch's {g.count} of "
                           f"{g.size}, or with another parallel.inner_strategy; resume with the launch that saved it"])
    saved = load_tensors(outer_file, map_location)
    part = load_tensors(group_file, map_location)
    if g.index > 0 and not outer.sharded:
        model.load_state_dict(part["model"])
        optimizer.load_state_dict(part["optimizer"])
    outer.load_state_dict(saved, part, str(path))
    return ""


def load_distributed(path: Path, parts: RankParts) -> dict[str, Any]:
    """Load ``path`` (any format) into this rank's model and optimizer (and the outer loop of a
    DiLoCo run), tensors onto ``parts.device``; return state.json with this rank's RNG states
    under ``"rng"``, its loader position under ``"loader"`` and, in a DiLoCo run, what a
    conversion did under ``"diloco_note"``."""
    env, strategy, model, optimizer = parts.env, parts.strategy, parts.model, parts.optimizer
    outer = parts.outer
    sharded = (path / SHARDED).is_dir()
    if sharded and strategy == "zero1":
        raise ConfigError([f"{path} is a sharded (fsdp2) checkpoint: resume it with parallel.strategy=fsdp2, hsdp, ddp "
                           "or single; zero1's optimizer shards are laid out differently"])
    env.on_main(lambda: verify_checkpoint(path))  # once, not N times; an unmarked directory is refused
    # a DiLoCo checkpoint under another strategy: refused between syncs, before any weights load
    leaving = _leave_diloco(path, strategy) if outer is None and (path / DILOCO).is_dir() else ""
    if outer is not None and outer.sharded and sharded:  # DiLoCo, FSDP2 inside: each group reads its own
        own = path / DILOCO / f"group-{outer.g.index}"
        saved = read_state(path)
        load_sharded(own if outer.g.index > 0 and own.is_dir() else path / SHARDED, model, optimizer, env.group)
    elif not sharded and (shards_parameters(strategy) or (outer is not None and outer.sharded)):
        saved = _load_full_into_fsdp(path, model, optimizer)
    else:
        saved = load_checkpoint(path, model, optimizer, map_location=parts.device, verify=False)
    rng = saved.get("rng")
    if isinstance(rng, dict) and len(rng.get("ranks") or []) == env.world_size:
        saved["rng"] = rng["ranks"][env.rank]
    loaders = saved.get("loader_ranks")
    if isinstance(loaders, list) and len(loaders) == env.world_size:
        saved["loader"] = loaders[env.rank]
    if outer is not None:
        saved["diloco_note"] = _load_diloco(path, parts, outer)
    elif leaving:
        saved["diloco_note"] = leaving
    return saved


def _leave_diloco(path: Path, strategy: str) -> str:
    """A DiLoCo checkpoint resumed under ``strategy``: its outer state and group 0's part (one
    rank's, under FSDP2 inside: every rank's agree on the schedule) to :func:`leave_diloco`."""
    tag = "" if (path / DILOCO / "outer.pt").is_file() else "-0"
    state, group = (load_tensors(path / DILOCO / name, "cpu") for name in (f"outer{tag}.pt", f"group-0{tag}.pt"))
    return leave_diloco(state, group, int(read_state(path)["step"]), str(path), strategy)


def _load_full_into_fsdp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A full checkpoint (model.pt, index-keyed optimizer.pt) into an FSDP2-sharded model:
    every rank reads the whole files and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (  # lazy: see _dcp_save
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, load_tensors(path / "model.pt"), options=full)
    saved_optim = load_tensors(path / "optimizer.pt")
    set_optimizer_state_dict(model, optimizer, _by_name(saved_optim, model, optimizer), options=full)
    return read_state(path)


def _by_name(saved: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index (``Optimizer.state_dict``) re-keyed by
    parameter name, the form ``set_optimizer_state_dict`` takes. Index ``i`` of the saved
    groups is the ``i``-th parameter of this optimizer's groups (both built by
    ``build_optimizer`` from the same model, in ``named_parameters`` order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError(["the checkpoint's optimizer has "
                           f"{len(saved['param_groups'])} parameter groups, this one {len(optimizer.param_groups)}"])
    for old, new in zip(saved["param_groups"], optimizer.param_groups):
        fqns = [names[id(p)] for p in new["params"]]
        for index, fqn in zip(old["params"], fqns):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**{k: v for k, v in old.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}
