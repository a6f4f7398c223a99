"""The dry run's tracing process: the run's own CUDA step on fake tensors, and what it shows.

Started by ``tune/dryrun.py`` as ``python -m flopwise.tune.worker REQUEST RESULT`` with the
fake-CUDA shim preloaded (``tune/shim.py``); a crash here cannot take the caller down. It
reads the request (the resolved config, the GPU, the ranks), traces, and writes the result
as JSON, an ``error`` with where it happened included when the step fails.

One trace (:func:`trace`) builds the step exactly as a CUDA run of the config would
(``setup.build_step``: precision, attention, loss path, activation checkpointing, compile,
DDP / ZeRO-1 / FSDP2 at N ranks with a fake process group, fused AdamW) and runs the
trainer's ``train_step``:

1. with compile on: three steps as compiled (the partitioner's graphs, no dispatch mode on
   the stack), counting graphs, graph breaks and recompiles, and the compiled step's memory;
2. two eager steps under the recorders: host synchronisations with their source lines,
   collectives with their bytes, FLOPs (``FlopCounterMode``) and memory by kind.

Memory is the GPU's (the batches the loader keeps on the device among it); the pinned host
memory the loader copies batches from is reported apart (:func:`loader_buffers`).

The traced step accumulates at most :data:`TRACED_MICRO_BATCHES` micro-batches (what the
run does with more repeats them); FLOPs are scaled to the run's accumulation.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from flopwise.config import ConfigError, RunConfig, batch_split_problems, load_run_config
from flopwise.fsio import read_json, write_json
from flopwise.parallel.diloco import DiLoCo, Groups, fragments, make_groups
from flopwise.parallel.distributed import DistEnv
from flopwise.parallel.strategy import diloco_strategy, resolve_strategy
from flopwise.plan.budget import memory_settings_for_run
from flopwise.plan.fit import local_rank_count
from flopwise.plan.flops import attention_flops_per_token, param_counts, recompute_flops_per_token, recomputed_fraction
from flopwise.plan.memory import estimate
from flopwise.train import train_step as train_step_module
from flopwise.train.defaults import resolve_speed
from flopwise.train.precision import resolve as resolve_precision
from flopwise.train.setup import build_step
from flopwise.train.train_step import StepOnly
from flopwise.tune import fake
from flopwise.tune.kernels import KernelLog

TRACED_MICRO_BATCHES = 2  # the first micro-batch's gradients exist during the second one's backward
COMPILED_STEPS = 3  # the first compiles; the second and third show recompiles
GIB = 1024**3
ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_flash_attention", "_efficient_attention", "bmm")


def main(argv: list[str]) -> int:
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = read_json(request_path)
    if "configs" in request:  # a batch (the traced test matrix): one process, the same GPU and ranks
        result = {"results": [_answer(dict(request, config_path=path, fit=False)) for path in request["configs"]]}
    else:
        result = _answer(request)
    write_json(result_path, result, "the dry run's result")  # whole or not at all: the caller reads it when it is there
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a normal exit can abort in the fake-CUDA shim's teardown


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_request`'s result, or the error that ended it (what, and where in flopwise)."""
    try:
        return run_request(request)
    except ConfigError as e:
        return {"error": str(e), "problems": e.problems, "where": "config"}
    except Exception as e:  # noqa: BLE001 - the step failing is the answer: what and where
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"error": f"{type(e).__name__}: {first}", "where": _where(e),
                "traceback": traceback.format_exc()[-6000:]}


def _where(e: BaseException) -> str:
    """The innermost frame of flopwise's own code (outside this package) that the error passed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/flopwise/" in f.filename
              and "/flopwise/tune/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('/src/', 1)[-1]}:{f.lineno} ({f.name})"


def run_request(request: dict[str, Any]) -> dict[str, Any]:
    """Trace the request's config at its micro-batch, then find the largest that fits by trace."""
    if torch.version.cuda is None and not fake.shim_loaded():
        raise RuntimeError("the fake-CUDA shim is not loaded (start this through flopwise preflight --dry-run)")
    gpu = fake.FakeGpu(request["gpu"]["name"], tuple(request["gpu"]["capability"]),
                       int(request["gpu"]["memory_bytes"]), count=max(8, int(request["nproc_per_node"])))
    fake.install(gpu)
    world = int(request["world"])
    # the node's ranks, as torchrun would tell each of them: DiLoCo's default groups (a node each) and
    # the multi-node checks read it; without it 2 nodes of 8 were traced as one group of 16
    os.environ["LOCAL_WORLD_SIZE"] = str(int(request.get("nproc_per_node", world)))
    if world > 1 and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: only at N ranks

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    env = DistEnv(rank=0, local_rank=0, world_size=world, backend="nccl" if world > 1 else None,
                  launched=f"traced: rank 0 of {world}")
    asked = load_run_config(request["config_path"])
    asked.train.device = "cuda"
    device = torch.device("cuda", 0)
    split = batch_split_problems(asked.train, world)
    if split:
        raise ConfigError(split)
    prec = resolve_precision(asked.train.precision, device)
    cfg, speed = resolve_speed(asked, device, prec.name, world)
    strategy = resolve_strategy(cfg, env, device, prec.name, cfg.train.loss)
    out: dict[str, Any] = {
        "torch": torch.__version__, "gpu": gpu.name, "world": world, "precision": prec.name,
        "fp8": cfg.train.fp8_recipe if cfg.train.fp8 else None,  # torchao's float8 linears, and their scaling
        "compile": cfg.train.compile, "loss": cfg.train.loss, "strategy": strategy.name, "strategy_why": strategy.why,
        "speed": speed, "accum": cfg.grad_accum_steps(world), "micro_batch": cfg.train.micro_batch_size,
        "seq_len": cfg.train.seq_len,
    }
    out["trace"] = trace(cfg, env, device, strategy.name, cfg.train.micro_batch_size, full=True)
    out["plan"] = planned(cfg, prec.name, strategy.name, world, cfg.train.micro_batch_size)
    if not request.get("fit", True):
        return out
    cap = int(request["headroom"] * gpu.memory_bytes)

    def peak(b: int) -> float:  # bytes: the traced peak of the step at micro-batch b
        return trace(cfg, env, device, strategy.name, b, full=False)["memory"]["peak_gib"] * GIB

    out["fit"] = largest_fit(out["trace"], cap, int(request.get("max_micro_batch", MAX_MICRO_BATCH)), peak)
    return out


def planned(cfg: RunConfig, precision: str, strategy: str, world: int, micro_batch: int) -> dict[str, Any]:
    """The planner's memory for this step (flopwise plan's figure), in GiB."""
    # a group of 0 (hsdp's and diloco's default) is the ranks of a node: LOCAL_WORLD_SIZE, which the worker set
    settings = memory_settings_for_run(cfg, precision, cfg.train.loss, strategy, world, local_rank_count(world))
    est = estimate(cfg.model, micro_batch, cfg.train.seq_len, settings)
    return {k: round(v, 3) for k, v in est.gb().items()}


TOKEN_BYTES = 8  # the loader delivers token and document ids as int64, whatever the shards store


def loader_buffers(cfg: RunConfig, micro_batch: int) -> dict[str, int]:
    """What the run's loader (``data/loader.py``) holds for its batches on CUDA, in bytes, by its
    own rules. A batch is its tokens, ``(B, T+1)`` int64, and with ``model.doc_mask`` its
    document ids, ``(B, T)`` int64. With ``data.pin_memory`` each batch is copied into pinned
    host memory and sent with ``non_blocking``: its pinned sources are held while the batch is
    assembled ahead (``data.prefetch`` of them) and, once handed out, until its copy has run (at
    most ``max(1, prefetch)``; without prefetch the host allocator keeps the one block until the
    copy ends). Pinned memory is host memory, not the GPU's: reported apart, never in the peak.
    torch's pinned allocator (CachingHostAllocator) rounds each block up to a power of two, so
    it reserves ``host_pinned_reserved`` for them. On the device, the prefetched batches' copies
    wait through the step beside the current one (the trace holds them: kind ``batches``)."""
    B, T, n = micro_batch, cfg.train.seq_len, cfg.data.prefetch
    blocks = [B * (T + 1) * TOKEN_BYTES] + ([B * T * TOKEN_BYTES] if cfg.model.doc_mask else [])
    pinned = n + max(1, n) if cfg.data.pin_memory else 0
    return {"batch": sum(blocks), "host_pinned_batches": pinned, "host_pinned": pinned * sum(blocks),
            "host_pinned_reserved": pinned * sum(1 << (b - 1).bit_length() for b in blocks),
            "device_prefetched_batches": n, "device_prefetched": n * sum(blocks)}


def _random_batches(cfg: RunConfig, device: torch.device, micro_batch: int, memory: fake.LiveMemory) -> Any:
    """The batches the traced step takes: random token ids made on the device (a run's come from
    its loader), in the loader's shapes, counted as ``batches``; with ``data.prefetch`` the
    device copies of the batches the loader holds ahead (:func:`loader_buffers`), made once,
    before the step's kernels are logged, and alive through every step."""
    V, T, m, B = cfg.model.vocab_size, cfg.train.seq_len, cfg.model, micro_batch
    ahead = [torch.empty((B, T + 1), dtype=torch.int64, device=device) for _ in range(cfg.data.prefetch)]
    if m.doc_mask:
        ahead += [torch.empty((B, T), dtype=torch.int64, device=device) for _ in range(cfg.data.prefetch)]
    memory.mark(ahead, "batches")

    class Batches:
        held = ahead

        def next_batch(self) -> tuple[torch.Tensor, ...]:
            x = torch.randint(0, V, (B, T), device=device)
            y = torch.randint(0, V, (B, T), device=device)
            if m.doc_mask:  # document ids: non-decreasing along the sequence, as the loader makes them
                docs = torch.randint(0, 2, (B, T), device=device).cumsum(1)
                memory.mark([x, y, docs], "batches")
                return x, y, docs
            memory.mark([x, y], "batches")
            return x, y

        def state_dict(self) -> dict[str, Any]:
            return {}

    return Batches()


def _in_forward(loss_fn: Any, memory: fake.LiveMemory, log: list[KernelLog]) -> Any:
    """``loss_fn`` with the memory recorder told that what it makes is the forward's, and the
    kernel log (when ``log`` holds one) that a micro-batch's forward runs."""
    def wrapped(*args: Any) -> Any:
        memory.phase = "activations"
        for k in log:
            k.start_forward()
        try:
            return loss_fn(*args)
        finally:
            memory.phase = "temporaries"
            for k in log:
                k.end_forward()
    return wrapped


def _states(parts: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters and buffers, optimizer state tensors) of a built step."""
    modules = [parts.model] + ([parts.master.master] if parts.master else [])
    params = [t for mod in modules for t in (*mod.parameters(), *mod.buffers())]
    state = parts.optimizer.state
    opt = [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    inner = getattr(parts.optimizer, "optim", None)  # ZeRO-1: the local optimizer holds this rank's state
    if inner is not None:
        opt += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params, opt


class _Graphs:
    """Dynamo's graphs, graph breaks (with reasons) and recompiles (with reasons) since made."""

    def __init__(self) -> None:
        from torch._dynamo.utils import counters  # lazy: only a compiled trace needs dynamo's counters

        self.counters = counters
        self.counters.clear()
        self.messages: list[str] = []
        handler = self.handler = logging.Handler()
        handler.emit = lambda record: self.messages.append(record.getMessage())  # type: ignore[method-assign]
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(handler)

    def snapshot(self) -> dict[str, int]:
        return {"graphs": int(self.counters["stats"]["unique_graphs"]),
                "graph_breaks": int(sum(self.counters["graph_break"].values()))}

    def close(self) -> dict[str, Any]:
        logging.getLogger("torch._dynamo").removeHandler(self.handler)
        torch._logging.set_logs(recompiles=False)
        return {"break_reasons": {k[:300]: v for k, v in self.counters["graph_break"].items()},
                "recompile_reasons": [m.strip().replace("\n", " ")[:400] for m in self.messages if "ecompil" in m][:5]}


@contextlib.contextmanager
def _collected_between_steps():
    """Python's cyclic garbage collector off while tracing, so a storage held by a reference
    cycle is freed at the same moment in every trace -- when the trace collects before each step --
    rather than whenever the collector happens to run: the same config traces to the same peak
    whatever was traced before it in the process (a real run frees such cycles as unpredictably;
    the trace counts them until the step's end, an upper bound)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _no_copy_event():
    """The event behind a step's copy of its values to the host (``train_step.copy_done``), left
    out: the fake CUDA has no events, and it holds no memory and reads nothing."""
    original = train_step_module.copy_done
    train_step_module.copy_done = lambda device: None
    try:
        yield
    finally:
        train_step_module.copy_done = original


def trace(cfg: RunConfig, env: DistEnv, device: torch.device, strategy: str, micro_batch: int,
          full: bool) -> dict[str, Any]:
    """One configuration traced (see the module docstring); ``full=False``: the memory of the step
    as the run takes it (compiled when compile is on), nothing else."""
    run_accum = cfg.grad_accum_steps(env.world_size)  # the run's micro-batches per step, before the trace's
    cfg = copy.deepcopy(cfg)
    t = cfg.train
    prec = resolve_precision(t.precision, device)  # a fresh loss scaler: each trace has its own fake mode
    accum = min(cfg.grad_accum_steps(env.world_size), TRACED_MICRO_BATCHES)
    t.micro_batch_size = micro_batch
    t.global_batch_size = micro_batch * accum * env.world_size
    step_tokens = t.global_batch_size * t.seq_len
    torch._dynamo.reset()
    out: dict[str, Any] = {"micro_batch": micro_batch, "traced_accum": accum,
                           "loader": loader_buffers(cfg, micro_batch)}  # host pinned: apart from the GPU's peak
    compiled = t.compile != "off"
    mode = fake.fake_mode()
    gc.collect()
    wraps, env, groups = _layout(cfg, env, strategy)
    with mode, fake.LiveMemory(mode) as memory, _collected_between_steps(), _no_copy_event():
        parts = build_step(cfg, wraps, env, device, prec)
        run = StepOnly.of(cfg, parts, env, device, prec, wraps, _random_batches(cfg, device, micro_batch, memory))
        kernel_log: list[KernelLog] = []  # the reported eager step's, when full
        run.loss_fn = _in_forward(parts.loss_fn, memory, kernel_log)
        if strategy == "diloco":  # the run cuts what its optimizer steps into the fragments: refused as it refuses
            fragments([p.numel() for p in run.opt_params], cfg.parallel.fragments)
        params, _ = _states(parts)
        memory.mark(params, "parameters")
        grads = _GradMarker(run.opt_params, memory)
        outer = (DiLoCo(run.opt_params, dataclasses.replace(cfg.parallel, inner_steps=1, fragments=1, overlap_steps=0),
                        groups, device) if strategy == "diloco" else None)

        step = 0
        if compiled:
            graphs = _Graphs()
            fake.SAVED.clear()
            per_step = []
            steps = COMPILED_STEPS if full else 2  # a fit's trace: the compile and the step measured
            for _ in range(steps):
                gc.collect()
                if step == steps - 1:
                    memory.mark(_states(parts)[1], "optimizer")
                    memory.reset_peak()
                _step(run, outer, step, accum, step_tokens)
                step += 1
                per_step.append(graphs.snapshot())
            out["compiled"] = {"per_step": per_step, **graphs.close(), "saved": list(fake.SAVED),
                               "memory": _memory(memory, "compiled", fake.COMPILED_BACKEND_NAME)}
            out["memory"] = out["compiled"]["memory"]  # the step as the run takes it
            if not full:
                grads.close()
                del parts, run
                return out
        watch = fake.StepWatch()
        log = KernelLog() if full else None
        if log is not None:
            _mark_compiled_regions(log, cfg, parts, run)
        # Step 1 makes the optimizer state and, under FlopCounterMode, counts FLOPs (its module
        # tracking holds tensors of checkpointed blocks alive: it is kept off the step whose memory
        # is reported, and let go before it); step 2 is the one reported (memory, syncs,
        # collectives, kernels).
        for i in range(2):
            gc.collect()
            if i == 1:
                memory.mark(_states(parts)[1], "optimizer")
                memory.reset_peak()
                watch.syncs.clear()
                watch.collectives.clear()
                watch.collective_bytes.clear()
                fake.SDPA_CHOICES.clear()
            with contextlib.ExitStack() as modes:
                counter = None
                if i == 0 and full:
                    counter = modes.enter_context(FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS))
                modes.enter_context(watch)
                if i == 1 and log is not None:
                    kernel_log.append(modes.enter_context(log))
                _step(run, outer, step, accum, step_tokens, kernel_log)
            if counter is not None:
                out["flops"] = _flops(counter, cfg, accum, run_accum, micro_batch)
                del counter
            watch.step_done()
            step += 1
        out["eager_memory"] = _memory(memory, "eager", "")
        out.setdefault("memory", out["eager_memory"])
        if full:
            out["syncs"] = [{"op": op, "source": where} for op, where in watch.syncs]
            out["collectives"] = {op: {"calls": n, "bytes": watch.collective_bytes[op]}
                                  for op, n in sorted(watch.collectives.items())}
            out["sdpa_kernels"], out["sdpa_order"] = dict(fake.SDPA_CHOICES), "".join(fake.SDPA_ORDER)
            out["notes"] = parts.notes
            out["kernels"] = {"records": kernel_log[0].records, "tail_host": kernel_log[0].tail(),
                              "traced_accum": accum, "run_accum": run_accum, "micro_batch": micro_batch,
                              "seq_len": t.seq_len, "world": env.world_size,
                              "outer_every": cfg.parallel.inner_steps if strategy == "diloco" else 0}
            out["dtypes"] = {"parameters": sorted({str(p.dtype) for p in parts.model.parameters()}),
                             "optimizer_state": sorted({str(v.dtype) for v in _states(parts)[1]})}
        grads.close()
        del parts, run, outer
    return out


def _layout(cfg: RunConfig, env: DistEnv, strategy: str) -> tuple[str, DistEnv, Groups]:
    """What wraps the traced step's model, this rank's place, and DiLoCo's groups. Under DiLoCo:
    the inner strategy inside the run's worker group (its gradients averaged there only, as
    ``train/setup.py`` sets it), and the outer sync across the groups, its state synced after
    every traced step (the anchor, the momentum, the pseudo-gradient's buffers)."""
    if strategy != "diloco":
        return strategy, env, Groups()
    wraps = diloco_strategy(cfg, env.world_size).step
    if env.world_size == 1:
        return wraps, env, Groups()
    groups = make_groups(env, cfg.parallel)
    return wraps, dataclasses.replace(env, group=groups.inner), groups


def _mark_compiled_regions(log: KernelLog, cfg: RunConfig, parts: Any, run: StepOnly) -> None:
    """Tell ``log`` which of the step's calls the run compiles (their kernels are priced as one
    graph's; the rest as eager ops): each block under ``compile=blocks``; under ``compile=model``
    the whole loss function -- the model, its head and the loss -- or, with the fused loss kernel
    (which runs after the compiled graph, ``model/loss.py``), the model's forward alone. Called
    after the compiled steps, so the compiled graphs are the run's own."""
    t = cfg.train
    model = parts.model
    if t.compile == "blocks":
        for block in model.layers:
            block.forward = log.compiled_region(block.forward)
    elif t.compile == "model" and t.loss == "fused":
        model.forward = log.compiled_region(model.forward)
    elif t.compile == "model":
        run.loss_fn = log.compiled_region(run.loss_fn)


def _step(run: StepOnly, outer: DiLoCo | None, step: int, accum: int, step_tokens: int,
          log: Iterable[KernelLog] = ()) -> None:
    """One traced step, and DiLoCo's outer sync after it (its kernels marked ``outer``: the run
    syncs once every ``parallel.inner_steps`` steps)."""
    train_step_module.train_step(run, step, accum, step_tokens, 1e-4)
    if outer is not None:
        for k in log:
            k.phase = "outer"
        outer.after_step(step + 1)


class _GradMarker:
    """Counts each parameter's gradient as a gradient once it is accumulated (hooks on the
    parameters the optimizer steps)."""

    def __init__(self, params: Iterable[torch.Tensor], memory: fake.LiveMemory):
        self.handles = []
        for p in params:
            if hasattr(p, "register_post_accumulate_grad_hook"):
                self.handles.append(p.register_post_accumulate_grad_hook(lambda q: self._mark(q, memory)))

    def _mark(self, p: torch.Tensor, memory: fake.LiveMemory) -> None:
        if p.grad is not None:
            memory.mark([p.grad], "gradients")

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """torch._grouped_mm (MoE experts), which FlopCounterMode does not count: each row of the
    output is one K-long dot product per column, whichever group it is in (2·rows·K·N)."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # (S, K) x (G, K, N) -> (S, N)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (K, S) x (S, N) -> (G, K, N): the weights' gradient
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:  # (G, M, K) x (K, S) -> (M, S)
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]  # batched (G, M, K) x (G, K, N)


GROUPED_MM_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops} if hasattr(torch.ops.aten, "_grouped_mm") else {}


def _memory(memory: fake.LiveMemory, how: str, backend: str) -> dict[str, Any]:
    return {"how": how, "backend": backend, "peak_gib": memory.peak / GIB,
            "by_kind_gib": {k: v / GIB for k, v in memory.peak_by_kind.items()}}


def _flops(counter: FlopCounterMode | None, cfg: RunConfig, accum: int, run_accum: int,
           micro_batch: int) -> dict[str, Any]:
    """The traced step's FLOPs on this rank against the analytic count (docs/planning.md#conventions),
    scaled from the traced micro-batches to the run's accumulation."""
    if counter is None:
        return {}
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts()["Global"].items()}
    tokens = accum * micro_batch * cfg.train.seq_len  # this rank's traced tokens
    m, T, t = cfg.model, cfg.train.seq_len, cfg.train
    frac = recomputed_fraction(m.n_layers, t.activation_checkpointing, t.activation_checkpointing_every)
    n_matmul = param_counts(m)["matmul"]
    attention = {k: v for k, v in by_op.items() if k.split(".")[-1] in ATTENTION_OPS or "attention" in k}
    matmul = sum(v for k, v in by_op.items() if k not in attention)
    recompute_matmul = round(frac * (recompute_flops_per_token(m, T) - 4 * m.n_layers * m.n_heads
                                     * m.resolved_head_dim * T)) * tokens
    return {
        "traced_tokens": tokens, "by_op": by_op, "total": sum(by_op.values()),
        "matmul": matmul, "matmul_expected": 6 * n_matmul * tokens + recompute_matmul,
        "attention": sum(attention.values()),
        "attention_model": attention_flops_per_token(m, T) * tokens,
        "recompute_fraction": frac,
        "per_step_scale": run_accum / accum,
    }


FIT_TRACES = 6  # traces the search may add after the first two
MAX_MICRO_BATCH = 1024  # the search's cap: a size that fits there is reported as the cap, never as the largest


def largest_fit(main: dict[str, Any], cap: int, limit: int, peak: Callable[[int], float]) -> dict[str, Any]:
    """The largest micro-batch up to ``limit`` whose traced peak (``peak(b)``, in bytes: of the
    step as the run takes it, compiled when ``train.compile`` is on; ``main`` is the trace at the
    configured size) is within ``cap`` bytes. Memory is
    states plus activations nearly linear in the micro-batch: a second trace gives a line, and
    each further one is placed where the line through the two traced sizes nearest ``cap`` crosses
    it (the secant method), kept strictly between the largest size known to fit and the smallest
    known not to, at most :data:`FIT_TRACES` of them. ``confirmed``: the next size up was traced and does not
    fit; ``capped``: ``limit`` fits, and larger sizes were not tried (``limit`` is then no largest)."""
    b0 = main["micro_batch"]
    tried = {b0: main["memory"]["peak_gib"] * GIB}
    b1 = 2 * b0 if b0 < 2 else b0 // 2
    tried[b1] = peak(b1)
    per = (tried[b0] - tried[b1]) / (b0 - b1)  # bytes per sequence, near the configured size
    for _ in range(FIT_TRACES):
        fits = [b for b, p in tried.items() if p <= cap]
        over = [b for b, p in tried.items() if p > cap]
        lo, hi = (max(fits) if fits else 0), (min(over) if over else limit + 1)
        if hi <= lo + 1:
            break
        a, b = sorted(tried, key=lambda n: abs(tried[n] - cap))[:2]  # the secant through the two nearest cap
        slope = (tried[b] - tried[a]) / (b - a)
        guess = a + int((cap - tried[a]) // slope) if slope > 0 else (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)  # unknown sizes lie strictly between the two
        tried[guess] = peak(guess)
    fits = [b for b, p in tried.items() if p <= cap]
    best = max(fits) if fits else None
    confirmed = best is not None and tried.get(best + 1, 0.0) > cap
    return {"micro_batch": best, "confirmed": confirmed, "capped": best is not None and best >= limit,
            "asked_fits": tried[b0] <= cap,  # the configured micro-batch's own verdict
            "limit": limit, "cap_gib": cap / GIB, "per_sequence_gib": per / GIB,
            "tried_gib": {str(b): round(p / GIB, 3) for b, p in sorted(tried.items())}}


if __name__ == "__main__":
    main(sys.argv[1:])
