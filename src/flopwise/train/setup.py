"""Everything a run needs before its first step, built once into one :class:`Run`.

Cheapest checks first, so bad input fails before anything is allocated: the batch split at
this world size, the loss path and the parallel strategy (refusals), the run directory
(new, or resumed from its latest complete checkpoint: ``checkpoint.start_run``), the data directory,
the task files, whether the planned step fits this rank's free memory (``plan/fit.py``)
and every split's length; only then the model, its wrappers (activation
checkpointing -> compile -> DDP/FSDP2: ``wrap.py``), the loss and the optimizer. A resumed
run then gets its weights, optimizer, data position, guard counts and RNG back
(:func:`restore`), and rank 0 writes the run's files (:func:`write_run_files`).

A run directory whose checkpoint already holds the steps asked for, or has used its
``train.max_hours`` (:func:`spent_run`), is left untouched: then :func:`setup` returns that
run's result (``record.finished_run``) instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import torch

from flopwise.checkpoints import intact_note, read_state
from flopwise.config import ConfigError, RunConfig, batch_split_problems, identity_mismatch, recorded_paths
from flopwise.data.datadir import DataDir, open_data_dir
from flopwise.data.loader import LoaderOptions, fixed_windows, make_loader
from flopwise.evaluate.loss import target_bytes
from flopwise.fsio import MAX_JSON_BYTES, FileFormatError, json_text, loads_json, read_bytes, write_file
from flopwise.manifest import seal_run_files
from flopwise.measure.meter import ThroughputMeter
from flopwise.measure.timing import StepTimer
from flopwise.measure.tracking import NullTracker, Tracker, check_wandb_login
from flopwise.model import Transformer, build_model, configure_attention
from flopwise.model.io import load_hf_weights
from flopwise.model.loss import make_loss_fn
from flopwise.parallel.diloco import DiLoCo, make_groups
from flopwise.parallel.distributed import DistEnv
from flopwise.parallel.strategy import Strategy, replica_group, resolve_strategy, shards_parameters, zero1_optimizer
from flopwise.plan.budget import plan_for_run
from flopwise.plan.fit import check_memory_fit, local_rank_count
from flopwise.plan.flops import (
    flops_per_token,
    flops_per_token_6n,
    hardware_flops_per_token,
    param_counts,
    recomputed_fraction,
)
from flopwise.train.checkpoint import RunStart, set_rng_state, start_run, truncate_metrics
from flopwise.train.defaults import device_peak, resolve_speed
from flopwise.train.dist_checkpoint import RankParts, load_distributed
from flopwise.train.optim import CombinedOptimizer, build_optimizer
from flopwise.train.precision import MasterWeights, Precision, apply_fp8, autocast_factory
from flopwise.train.precision import resolve as resolve_precision
from flopwise.train.record import TrainResult, finished_run, read_run_record, run_record
from flopwise.train.schedule import (
    Continuation,
    RampPlan,
    TimeContinuation,
    duration,
    extension_note,
    ramp_plan,
    resumed_schedule,
)
from flopwise.train.stopping import Deadline, NonFiniteGuard, TimeFit, budget_spent, saved_budget
from flopwise.train.wrap import RecompileWatch, wrap_for_training

Log = Callable[[str], None]


@dataclass
class Progress:
    """What changes as the run goes: where it is, and what it has measured so far."""

    step: int = 0
    tokens: int = 0
    first_step: int = 0  # the step this process started from (0, or the resumed checkpoint's)
    val_start: float = float("nan")
    val_end: float = float("nan")  # the latest validation after step 0; NaN until there is one
    val_end_step: int = 0  # the step it was measured at
    last_loss: float = float("nan")
    last_saved: Path | None = None  # the newest complete checkpoint
    loss_sum: float = 0.0  # over the steps since the last log line
    steps_in_window: int = 0


@dataclass
class Flops:
    """FLOPs per token under the project's conventions (docs/planning.md#conventions) and the peak."""

    per_token: int  # 6·N_matmul + attention: MFU's numerator
    per_token_6n: int  # 6·N: the other common convention, logged beside it
    hardware: int  # + the recomputed forwards of checkpointed blocks: HFU's numerator
    peak: float | None  # dense FLOP/s of one device at this precision
    peak_note: str
    counts: dict[str, int]  # parameters: total, non_embedding, active (MoE), ...


@dataclass
class Run:
    """One run's objects, built by :func:`setup`; the loop and its hooks read them from here."""

    cfg: RunConfig
    log: Log
    env: DistEnv
    device: torch.device
    clock: Callable[[], float]
    t_start: float
    start: RunStart
    data: DataDir
    prec: Precision
    autocast: Callable[[], contextlib.AbstractContextManager]
    strategy: Strategy
    loss_impl: str
    model: torch.nn.Module  # the plain model (evaluation, generation)
    train_model: torch.nn.Module  # wrapped for training (checkpointing, compile, DDP/FSDP2)
    state_model: torch.nn.Module  # what the optimizer steps and checkpoints hold (fp32)
    master: MasterWeights | None
    optimizer: torch.optim.Optimizer
    # What the optimizer steps -- not model.parameters(): under FSDP2 a module whose weights
    # are gathered (the root after an evaluation) lists its unsharded copies there.
    opt_params: list[torch.nn.Parameter]
    clip: float  # the gradient norm clipped to (inf: none)
    loss_fn: Callable
    train_loader: Any
    val_windows: torch.Tensor
    val_bytes: int
    task_names: list[str]
    task_paths: dict[str, str]
    guard: NonFiniteGuard
    deadline: Deadline
    fit: TimeFit | None
    total_steps: int
    accum: int  # micro-batches per step on each rank (a batch ramp changes it per step)
    micro_tokens: int  # one micro-batch on every rank
    ramp: RampPlan | None
    cont: Continuation | TimeContinuation | None  # the rate of a run whose length or budget changed on resume
    flops: Flops
    config_yaml: str
    record: dict[str, Any]
    plan: dict[str, Any]
    uniform: float  # ln V of the data's vocabulary: the loss of a uniform prediction
    meter: ThroughputMeter  # tokens/s and MFU of the steps, windowed (paused over evaluation and saving)
    timer: StepTimer  # the step's parts: data, forward/backward, optimizer, logging
    recompiles: RecompileWatch  # compiles after the warm-up steps, told as recompiles
    outer: DiLoCo | None = None  # parallel.strategy=diloco: the outer loop across worker groups
    notes: dict[str, list[str]] = field(default_factory=dict)  # what was chosen and why, for the summary
    preflight: bytes | None = None  # train.preflight's preflight.json, checked: the run keeps a copy
    virtual: bytes | None = None  # the virtual.json beside it (preflight --dry-run --rank), checked
    sink: Any = field(default_factory=NullTracker)
    progress: Progress = field(default_factory=Progress)

    @property
    def run_dir(self) -> Path:
        return self.start.run_dir

    @property
    def parts(self) -> RankParts:
        """What this rank saves a checkpoint from and loads one into."""
        return RankParts(self.env, self.strategy.name, self.state_model, self.optimizer, self.device, self.outer)

    @property
    def world(self) -> int:
        return self.env.world_size

    def step_size(self, step: int) -> tuple[int, int]:
        """(micro-batches per rank, tokens over all ranks) of ``step``."""
        accum = self.ramp.accums[step] if self.ramp is not None else self.accum
        return accum, accum * self.micro_tokens



def open_data(cfg: RunConfig, log: Log, resuming: bool = False) -> DataDir:
    """The prepared data directory: ``data.path``, or the embedded corpus prepared once. A
    resumed run whose data is not at its recorded path is told how to re-point it."""
    path = cfg.data.path
    if resuming and path and not Path(path).expanduser().is_dir():
        raise ConfigError([f"data.path {path}: the run's data directory is not here; give data.path=DIR where "
                           "it is now (the resume checks that it is the same data, by the fingerprint its "
                           "checkpoint recorded)"])
    dd = open_data_dir(cfg.data, log=log)
    if dd.vocab_size > cfg.model.vocab_size:
        raise ConfigError([
            f"data at {dd.path} has vocabulary {dd.vocab_size} but model.vocab_size is "
            f"{cfg.model.vocab_size}: token ids would overflow the embedding"
        ])
    dd.num_tokens("val")  # a missing validation split is an error here, naming the splits there are
    return dd


PREFLIGHT_PARTS = ("chosen", "prediction")  # objects every preflight.json `flopwise preflight` writes holds
VIRTUAL = "virtual.json"  # `preflight --dry-run --rank --out DIR` writes it; a preflight into the same DIR sits beside
VIRTUAL_PARTS = ("choice", "candidates")  # keys of its "virtual" object (choice is null when nothing fits)


def checked_before_run_dir(cfg: RunConfig, log: Log) -> tuple[bytes | None, bytes | None]:
    """Rank 0's checks that need neither model nor data, before the run directory is made:
    W&B's API key (rank 0 logs to W&B), and the preflight result the config came from with the
    virtual preflight's beside it (returned: the run keeps a copy of each; a virtual preflight's
    of another step is not kept, and the log says why)."""
    check_wandb_login(cfg.tracking)
    preflight = preflight_result(cfg.train.preflight, cfg.train.run_dir)
    if preflight is None:
        return None, None
    virtual, stale = virtual_result(cfg.train.preflight, cfg)
    if stale:
        log(f"note: {stale}")
    return preflight, virtual


def preflight_result(path: str, run_dir: str) -> bytes | None:
    """The bytes of ``train.preflight``, read once (bounded) and checked to be a preflight
    result -- a JSON object holding the :data:`PREFLIGHT_PARTS` objects -- before the run
    directory is made: the run keeps a copy for the report, which would refuse the run over
    any other file. None when none is given, or when a resumed run keeps the copy it has and
    the file is not here (the run moved to another machine)."""
    if not path:
        return None
    where = f"train.preflight {path!r}"
    file = Path(path).expanduser()
    if not file.exists() and run_dir and (Path(run_dir).expanduser() / "preflight.json").is_file():
        return None
    try:
        data, doc = _read_result(file, where, "a preflight result", "is a directory: give the preflight.json in it")
    except FileNotFoundError:
        raise ConfigError([f"{where}: no such file (give the preflight.json `flopwise preflight` wrote, "
                           "or leave train.preflight empty)"]) from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(key), dict) for key in PREFLIGHT_PARTS):
        raise ConfigError([f"{where}: not a preflight result (the preflight.json `flopwise preflight` writes is "
                           f"a JSON object holding {' and '.join(map(repr, PREFLIGHT_PARTS))} objects)"])
    return data


def _read_result(file: Path, where: str, what: str, directory: str) -> tuple[bytes, Any]:
    """A JSON result file's bytes (read once, bounded) and what they parse to; a directory, a file
    that is not JSON or one that cannot be read is a ConfigError saying ``where`` (a missing file
    raises FileNotFoundError: its callers say differently what to give instead)."""
    try:
        data = read_bytes(file, MAX_JSON_BYTES)
        return data, loads_json(data, str(file))
    except IsADirectoryError:
        raise ConfigError([f"{where} {directory}"]) from None
    except FileFormatError as e:
        raise ConfigError([f"{where}: not {what}: {e.reason}"]) from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConfigError([f"{where}: cannot be read: {e.strerror or e}"]) from None


def virtual_result(path: str, cfg: RunConfig) -> tuple[bytes | None, str]:
    """The bytes of the ``virtual.json`` beside ``train.preflight``'s file, read once (bounded)
    and checked to be a virtual preflight result -- ``{"virtual": {"choice", "candidates"}}`` --
    before the run directory is made: the report shows its predictions beside what the preflight
    and the run measured. None when there is none (most preflights had no dry run before them),
    and None with a line saying why when it predicted another model, sequence length or global
    batch than ``cfg``'s (its ``of``; a file without one, hand-made or older, is kept as it is)."""
    file = Path(path).expanduser().parent / VIRTUAL
    if not file.exists():
        return None, ""
    where = f"{file} (beside train.preflight)"
    shape = 'the virtual.json `flopwise preflight --dry-run --rank` writes is {"virtual": {"choice", "candidates"}}'
    data, doc = _read_result(file, where, f"a virtual preflight result ({shape})",
                             "is a directory, not a virtual preflight result: move it away")
    virtual = doc.get("virtual") if isinstance(doc, dict) else None
    if (not isinstance(virtual, dict) or not all(key in virtual for key in VIRTUAL_PARTS)
            or not isinstance(virtual["candidates"], list) or not isinstance(virtual["choice"], (dict, type(None)))):
        raise ConfigError([f"{where}: not a virtual preflight result ({shape}); move it away or give a "
                           "preflight.json in a folder without it"])
    differs = identity_mismatch(virtual["of"], cfg) if "of" in virtual else ""
    if differs:
        return None, (f"{where} predicted another step ({differs}): not kept with the run, and the report "
                      "compares nothing with it")
    return data, ""


def task_files(task_dir: str, names: list[str]) -> dict[str, str]:
    """``eval.task_dir``'s file (or folder) for each task: TASK.jsonl, .json, .parquet or TASK/."""
    if not task_dir:
        return {}
    root = Path(task_dir).expanduser()
    found = {}
    for name in names:
        for candidate in (root / f"{name}.jsonl", root / f"{name}.json", root / f"{name}.parquet", root / name):
            if candidate.exists():
                found[name] = str(candidate)
                break
        else:
            raise ConfigError([f"eval.task_dir {task_dir!r} has no {name}.jsonl, .json, .parquet or {name}/"])
    return found


def load_hf_init(model: Transformer, hf_path: str) -> str:
    """Weights of a Hugging Face model directory (``model.hf_config``) for continued
    pretraining; the architecture came from its ``config.json`` when the config was built."""
    path = Path(hf_path).expanduser()
    directory = path.parent if path.is_file() else path
    if not any((directory / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return f"architecture from {path}; no safetensors beside it: random initialisation"
    load_hf_weights(model, directory)
    return f"weights from {directory} (Hugging Face safetensors)"


def run_flops(cfg: RunConfig, device: torch.device, precision: str) -> Flops:
    m, t = cfg.model, cfg.train
    fpt = flops_per_token(m, t.seq_len)
    hfpt = hardware_flops_per_token(m, t.seq_len, recomputed_fraction(m.n_layers, t.activation_checkpointing,
                                                                      t.activation_checkpointing_every))
    peak, note = device_peak(device, precision, t.peak_tflops)
    return Flops(fpt, flops_per_token_6n(m), hfpt, peak, note, param_counts(m))


def train_loader(cfg: RunConfig, data: DataDir, device: torch.device, rank: int = 0, world_size: int = 1,
                 step_samples: int | None = None):
    """The training split's loader as configured (``data.loader``, ``data.prefetch``,
    ``data.pin_memory``, documents' boundaries for ``model.doc_mask``): the trainer's, a
    preflight trial's and ``--explain``'s."""
    t = cfg.train
    opts = LoaderOptions(t.seq_len, t.micro_batch_size, seed=t.seed, device=device, rank=rank, world_size=world_size,
                         doc_boundaries=cfg.model.doc_mask, prefetch=cfg.data.prefetch,
                         pin_memory=cfg.data.pin_memory, step_samples=step_samples)
    return make_loader(cfg.data.loader, data, "train", opts)


@dataclass
class StepParts:
    """What a training step is made of."""

    model: torch.nn.Module  # the parameters (sharded in place under FSDP2)
    master: MasterWeights | None  # bf16-pure: the fp32 copy the optimizer steps
    train_model: torch.nn.Module  # the model as wrapped for training (compile, DDP, FSDP2, checkpointing)
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    notes: dict[str, list[str]]  # for the start-up summary: "init", "speed", "attention", "parallel"


def grad_clip(cfg: RunConfig) -> float:
    """The gradient norm a step clips to (``optim.grad_clip``; 0: none, an infinite bound)."""
    return cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")


def build_step(cfg: RunConfig, strategy: str, env: DistEnv, device: torch.device, prec: Precision,
               init_weights: bool = False) -> StepParts:
    """The model, its precision, attention kernel, wrappers, loss and optimizer, built in the
    order they depend on each other. The trainer builds its run with this, and a preflight
    trial (``trial.measure``) measures what it builds, so the two cannot drift apart.
    ``init_weights``: load ``model.hf_config``'s weights (a new run; a trial times random ones)."""
    m, t = cfg.model, cfg.train
    model = build_model(m, device=device, seed=t.seed)
    notes: dict[str, list[str]] = {"init": [], "speed": []}
    if m.hf_config and init_weights:
        notes["init"].append(load_hf_init(model, m.hf_config))
    if t.fp8:
        notes["speed"].append(apply_fp8(model, device, t.fp8_recipe, fsdp=shards_parameters(strategy)))
        if t.compile == "off":  # eager float8: the casts and scalings are separate kernels around each GEMM
            notes["speed"].append("WARNING: fp8 without torch.compile is usually slower than bf16; "
                                  "train.compile=model (the CUDA default) fuses its casts")
    master = MasterWeights(model) if prec.name == "bf16-pure" else None
    notes["attention"] = configure_attention(model, device, prec.autocast_dtype or model.tok_emb.weight.dtype)
    # FSDP2 shards `model` in place: the optimizer is built after, on the shards
    train_model, wrap_notes, notes["parallel"] = wrap_for_training(model, cfg, strategy, env, device,
                                                                   prec.autocast_dtype)
    notes["speed"] += wrap_notes
    loss_fn = make_loss_fn(train_model, t.loss, t.loss_chunk_tokens,
                           compile_mode=t.compile_mode if t.compile == "model" else None)
    optimizer: torch.optim.Optimizer | CombinedOptimizer = build_optimizer(master.master if master else model,
                                                                          cfg.optim, device,
                                                                          group=replica_group(strategy, env))
    if strategy == "zero1":
        optimizer = zero1_optimizer(optimizer)
    # a CombinedOptimizer stands in for an Optimizer (duck-typed: what the loop and checkpoints use)
    return StepParts(model, master, train_model, loss_fn, cast(torch.optim.Optimizer, optimizer), notes)


def setup(cfg: RunConfig, log: Log, fresh: bool, env: DistEnv, device: torch.device, t_start: float,
          locks: contextlib.ExitStack, clock: Callable[[], float]) -> Run | TrainResult:
    """Build the run; or, when its checkpoint already holds every step asked for, the
    finished run's result (nothing is built or written then)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    prec = resolve_precision(cfg.train.precision, device)
    world = env.world_size
    split = batch_split_problems(cfg.train, world)  # the config checked one rank; this is the launch's count
    if split:
        raise ConfigError(split)
    asked = cfg  # what config.yaml keeps: an `auto` is decided again where the run resumes
    cfg, speed_notes = resolve_speed(asked, device, prec.name, world)  # compile and loss made concrete
    m, t, e = cfg.model, cfg.train, cfg.eval
    loss_impl = t.loss
    strategy = resolve_strategy(cfg, env, device, prec.name, loss_impl)  # refusals before any work
    preflight, virtual = env.on_main(lambda: checked_before_run_dir(cfg, log))  # before the run directory is made
    start = env.on_main(lambda: start_run(asked, fresh, locks))
    asked.train.run_dir = t.run_dir = str(start.run_dir)  # rank 0 named it (a timestamp): every rank uses it
    # config.yaml records every path resolved, so the run reads the same from any directory
    recorded, typed_paths = recorded_paths(asked)
    # the embedded corpus is prepared once, by rank 0
    data = env.main_first(lambda: open_data(cfg, log, resuming=start.resumed_run))

    total_steps, accum = cfg.total_steps(), cfg.grad_accum_steps(world)
    micro_tokens = t.micro_batch_size * t.seq_len * world
    ramp = None
    if t.batch_ramp_tokens:  # steps grow from batch_ramp_start micro-batches to the full batch
        ramp = ramp_plan(t.max_tokens, micro_tokens, accum, t.batch_ramp_tokens, t.batch_ramp_start)
        total_steps = ramp.steps if not t.max_steps else min(ramp.steps, t.max_steps)
    done = int(start.checkpoint.name[5:]) if start.checkpoint is not None else 0
    if start.checkpoint is not None and done >= total_steps > 0:  # nothing to train: touch nothing
        return finished_run(start.run_dir, start.checkpoint, total_steps, math.log(data.vocab_size),
                            clock() - t_start, log)
    if start.checkpoint is not None and t.max_hours > 0:  # train.max_hours is the run's, not this start's
        spent = spent_run(cfg, start.checkpoint, total_steps, math.log(data.vocab_size), clock() - t_start, log)
        if spent is not None:
            return spent

    task_names = [x.strip() for x in e.tasks.split(",") if x.strip()]
    task_paths = task_files(e.task_dir, task_names)  # a missing task file is named before any work
    # The planner's peak per rank against this rank's free memory: a step that cannot fit is
    # refused here, with the change that fits, not by the allocator after the model was built.
    plan = plan_for_run(cfg, torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                        prec.name, loss=loss_impl, gpus=world, strategy=strategy.name,
                        gpus_per_node=local_rank_count(world))
    env.on_every_rank(lambda: check_memory_fit(cfg, plan, device, prec.name, loss_impl, strategy.name, world))
    # The data checks (each split long enough for a window) come before any allocation.
    loader = train_loader(cfg, data, device, env.rank, world,
                          step_samples=None if ramp else t.global_batch_size)  # epochs end on a step
    # No speed setting moves the held-out set (ranks share it, the micro-batch batches it); a resume keeps its own.
    val_windows = fixed_windows(data, "val", t.seq_len, e.windows)

    groups = make_groups(env, cfg.parallel) if strategy.name == "diloco" else None
    if groups is not None:
        env.group = groups.inner  # gradients are averaged inside the worker group only
    torch.manual_seed(t.seed)
    parts = build_step(cfg, strategy.step, env, device, prec, init_weights=start.checkpoint is None)
    model, master, train_model, loss_fn, optimizer = (parts.model, parts.master, parts.train_model, parts.loss_fn,
                                                      parts.optimizer)
    notes = parts.notes
    if "compile" in speed_notes:
        notes["speed"].insert(0, f"compile {speed_notes['compile']}")
    chunks = f", {t.loss_chunk_tokens} tokens per chunk" if loss_impl == "chunked" else ""
    notes["speed"].append(f"loss {speed_notes.get('loss', loss_impl)}{chunks}")
    state_model = master.master if master else model
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + AdamW m, v
    deadline = Deadline(t.max_hours, t_start, state_bytes, clock=clock)
    flops = run_flops(cfg, device, prec.name)
    run = Run(
        cfg=cfg, log=log, env=env, device=device, clock=clock, t_start=t_start, start=start, data=data,
        prec=prec, autocast=autocast_factory(device, prec.autocast_dtype), strategy=strategy,
        loss_impl=loss_impl, model=model, train_model=train_model, state_model=state_model, master=master,
        optimizer=optimizer, opt_params=[q for group in optimizer.param_groups for q in group["params"]],
        clip=grad_clip(cfg), loss_fn=loss_fn, train_loader=loader,
        val_windows=val_windows,
        val_bytes=0, task_names=task_names, task_paths=task_paths,
        guard=NonFiniteGuard(t, uniform_loss=math.log(m.vocab_size)),  # the logits' uniform loss
        deadline=deadline, fit=TimeFit(deadline, clock) if cfg.fits_to_time else None,
        total_steps=total_steps, accum=accum, micro_tokens=micro_tokens, ramp=ramp, cont=None,
        flops=flops, config_yaml=recorded.to_yaml(), record={}, plan=plan,
        uniform=math.log(data.vocab_size), notes=notes,
        meter=ThroughputMeter(flops.per_token, flops.peak * world if flops.peak else None,
                              warmup_steps=t.warmup_log_steps),
        timer=StepTimer(device), recompiles=RecompileWatch(t.compile != "off"))
    if groups is not None:
        run.outer = DiLoCo(run.opt_params, cfg.parallel, groups, device,
                           on_sync=master.master_to_model if master else None, clock=clock)
    run.progress.last_saved = start.checkpoint
    run.preflight, run.virtual = preflight, virtual  # the copies the run keeps, for the report
    if start.checkpoint is not None:
        restore(run, start.checkpoint)
    run.val_bytes = target_bytes(run.val_windows, data.tokenizer)  # for bits per byte, across tokenizers
    run.record = run_record(cfg, device, prec.name)
    run.record["paths"] = typed_paths  # what the user typed, where config.yaml holds them resolved
    run.record["parallel"] = {"strategy": strategy.name, "world_size": world, "backend": env.backend,
                              "launched": env.launched, "why": strategy.why}
    env.on_main(lambda: write_run_files(run))
    run.sink = open_tracker(run)
    return run


def spent_run(cfg: RunConfig, checkpoint: Path, total_steps: int, uniform: float, wall_s: float,
              log: Log) -> TrainResult | None:
    """A run whose latest checkpoint used up ``train.max_hours`` (the time its processes spent,
    as recorded): say so -- how to extend it and what the rate then does -- and change nothing,
    as for a run that holds its steps (``record.finished_run``). None when time is left."""
    saved = read_state(checkpoint)
    budget = saved_budget(saved, checkpoint)
    t = cfg.train
    if not budget_spent(t.max_hours, budget):
        return None
    done = int(checkpoint.name[5:])
    log(f"finished: {t.run_dir} already used its time budget, train.max_hours={t.max_hours:g}: "
        f"{duration(budget['spent_s'])} spent up to step {done:,} ({checkpoint}); nothing to train, nothing "
        f"changed. To train longer, raise train.max_hours ({extension_note(cfg, saved, done, total_steps)}); "
        "--fresh starts over")
    result = finished_run(Path(t.run_dir), checkpoint, done, uniform, wall_s, log=lambda _: None)
    return dataclasses.replace(result, stopped=f"train.max_hours={t.max_hours:g} already used")


def restore(run: Run, checkpoint: Path) -> None:
    """Continue from ``checkpoint``: weights, optimizer, loss scale, data position, held-out
    set, guard counts, RNG, and the learning rate's continuation if the run's length changed."""
    cfg, p = run.cfg, run.progress
    saved = load_distributed(checkpoint, run.parts)
    if saved.get("diloco_note"):
        run.notes.setdefault("parallel", []).append(saved["diloco_note"])
    if run.master:
        run.master.master_to_model()
    if run.prec.scaler is not None and "grad_scaler" in saved:
        run.prec.scaler.load_state_dict(saved["grad_scaler"])
    fingerprint = run.data.meta.get("fingerprint")
    if saved.get("data_fingerprint") != fingerprint:
        raise ConfigError([f"train.run_dir {str(run.run_dir)!r}: the data changed since the checkpoint "
                           f"(fingerprint {str(saved.get('data_fingerprint'))[:12]} -> {str(fingerprint)[:12]}); "
                           "pass --fresh to start over"])
    try:
        run.train_loader.load_state_dict(saved["loader"])
    except ValueError as err:  # e.g. the random loader's per-rank streams at another world size
        raise ConfigError([f"train.run_dir {str(run.run_dir)!r}: cannot continue the data position of "
                           f"{checkpoint.name} with {run.world} rank(s): {err}"]) from None
    p.step, p.tokens, p.val_start = saved["step"], saved["tokens"], saved.get("val_loss_start", float("nan"))
    p.first_step = p.step
    if saved.get("val_windows", len(run.val_windows)) != len(run.val_windows):  # resumed at another geometry:
        run.notes["validation"] = [f"{saved['val_windows']:,} windows, the set this run validated on from its start "
                                   f"(eval.windows {len(run.val_windows):,} is for a fresh run)"]
        run.val_windows = fixed_windows(run.data, "val", cfg.train.seq_len, saved["val_windows"])  # same held-out set
    run.guard.load_state_dict(saved.get("guard", {}))
    if "rng" in saved:
        set_rng_state(saved["rng"], run.device)
    budget = saved_budget(saved, checkpoint)
    run.deadline.load_state_dict(budget)  # train.max_hours goes on with what was left of it
    run.cont, note = resumed_schedule(checkpoint, saved, p.step, run.total_steps, cfg, run.ramp is not None, budget)
    if note:
        run.notes["schedule"] = [note]


def write_run_files(run: Run) -> None:
    """Rank 0: config.yaml, plan.json, run.json (with this start), the tokenizer, the preflight."""
    run_dir, step = run.run_dir, run.progress.step
    ckpt = run.start.checkpoint  # what a full disk here leaves a resume: the user's next step
    kept = intact_note(ckpt)
    if run.start.resumed_run:
        truncate_metrics(run_dir / "metrics.jsonl", step, kept)
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = read_run_record(run_dir) if run.start.resumed_run else {}
    run.record["starts"] = previous.get("starts", []) + [{"at_step": step, "started": run.record["started"],
                                                          "world_size": run.world}]
    # a kill mid-write leaves the old copy, never half; the run's manifest tells a resume or a report it is this copy
    seal_run_files(run_dir, {"config.yaml": run.config_yaml, "plan.json": json_text(run.plan),
                             "run.json": json_text(run.record)}, kept)
    # the run is self-contained; replaced whole (a full disk never leaves the resumed run half a tokenizer)
    write_file(run_dir / "tokenizer.json", (run.data.path / "tokenizer.json").read_bytes(), kept=kept)
    if run.preflight is not None:  # plan vs preflight vs actual, in the report
        write_file(run_dir / "preflight.json", run.preflight, kept=kept)
    if run.virtual is not None:  # the virtual preflight's predictions beside them
        write_file(run_dir / VIRTUAL, run.virtual, kept=kept)


def open_tracker(run: Run):
    """Rank 0's metrics sinks (JSONL, TensorBoard, W&B); a failure stops every rank with it."""
    sink: Tracker | NullTracker = NullTracker()
    error = None
    if run.env.is_main:
        try:
            sink = Tracker(run.run_dir, run.cfg.tracking, run.cfg.to_dict(), run.run_dir.name)
        except Exception as err:  # noqa: BLE001 - e.g. W&B asked for and missing: every rank stops with it
            error = err
    error = run.env.broadcast(error)
    if error is not None:
        raise error
    return sink
