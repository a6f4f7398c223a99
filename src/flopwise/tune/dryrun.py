"""``flopwise preflight --dry-run``: the CUDA step of a run, traced on fake tensors, on any machine.

Before a GPU is rented: does the step this config builds on N × GPU run, does it fit, and will
it keep the GPU busy? The trace (``tune/worker.py``, in a process of its own with the
fake-CUDA shim preloaded: ``tune/shim.py``) answers with the step's per-rank peak memory by
kind beside the planner's and the GPU's, the largest micro-batch that fits by trace, the host
synchronisations per step with their source lines, the FLOPs against the analytic count, the
graphs, breaks and recompiles under compile, and the collectives per step. Every figure is
**traced**: computed from shapes, dtypes and the ops the step dispatches, never measured;
:data:`UNSEEN` is what a trace cannot see.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from flopwise.config import ConfigError, RunConfig, batch_split_problems
from flopwise.errors import FlopwiseError
from flopwise.fsio import read_json, write_json
from flopwise.measure.sinks import human
from flopwise.plan import hardware
from flopwise.plan.budget import PlanError
from flopwise.tune.predict import predicted
from flopwise.tune.predict import render as render_prediction
from flopwise.tune.shim import DryRunUnavailable, ensure_shim, torch_install

Log = Callable[[str], None]
DEFAULT_GPU = "h100"
TIMEOUT_S = 1800.0  # a 2B model at 8 ranks takes about a minute on 2 cores; a loaded machine far more
UNSEEN = ("allocator caching and fragmentation (reserved above allocated)", "inductor's fused buffers and Triton code",
          "CUDA graphs", "NCCL's own memory", "the flash-attn package's and cuDNN's kernels",
          "numerics (NaN, overflow, fp16 loss scaling)", "ranks other than rank 0", "the data loader's copies")


# why compile=model breaks under a data-parallel wrapper (torch's design, not flopwise's)
WRAPPERS = {
    "ddp": "torch runs DDP's forward uncompiled (the wrapped model compiles as a graph of its own)",
    "zero1": "torch runs DDP's forward uncompiled (the wrapped model compiles as a graph of its own)",
    "fsdp2": "FSDP2's hooks are compiler-disabled (a break on each side of the root's)",
}
WRAPPERS["hsdp"] = WRAPPERS["fsdp2"]  # FSDP2 over a 2-D mesh: the same hooks


class DryRunFailed(FlopwiseError, RuntimeError):
    """The traced step failed: what and where, in one line."""


def gpu_spec(name: str | None) -> hardware.DeviceSpec:
    """``name``'s entry, :data:`DEFAULT_GPU`'s when no name was given (an empty one is unknown)."""
    spec = hardware.find(DEFAULT_GPU if name is None else name)
    if spec is None:
        raise PlanError(hardware.unknown_gpu_message(name or ""))
    return spec


def torch_name(spec: hardware.DeviceSpec) -> str:
    """The name torch.cuda would report for ``spec`` (so the run's own lookups find it again)."""
    for alias in spec.aliases:
        if alias.upper().startswith(("NVIDIA", "TESLA")):
            return alias
    return f"NVIDIA {spec.name}"


def dry_run(cfg: RunConfig, gpu: str | None = None, nproc_per_node: int = 1, nnodes: int = 1,
            memory_gb: float = 0.0, headroom: float = 0.9, log: Log = print,
            network: str | None = None) -> dict[str, Any]:
    """Trace ``cfg``'s CUDA step on ``nproc_per_node`` × ``nnodes`` ranks of ``gpu``; the result
    (what the worker wrote, plus the request), its step time predicted with ``network`` between
    the nodes (None: :data:`hardware.DEFAULT_NETWORK`; the trace itself does not depend on it).
    Raises ConfigError or PlanError (bad input, before any work), DryRunUnavailable (this machine
    cannot trace) or DryRunFailed (the step fails)."""
    spec = gpu_spec(gpu)
    request, shim = _request(cfg, spec, nproc_per_node, nnodes, memory_gb, headroom, log, network)
    result = _trace(cfg, request, shim, spec, log, TIMEOUT_S)  # read now: a test sets the module's
    result["prediction"] = predicted(result, cfg, network=network)  # on the GPU's usual link in a node
    return result


def _trace(cfg: RunConfig, request: dict[str, Any], shim: Path, spec: hardware.DeviceSpec, log: Log,
           timeout_s: float) -> dict[str, Any]:
    """The worker's result for ``cfg``'s step as ``request`` asks it (:func:`dry_run`), less the
    prediction; raises as dry_run does."""
    world = request["world"]
    with _sigterm_unwinds(), _trace_dir() as tmp:
        config_path, request_path, result_path = (tmp / n for n in ("config.yaml", "request.json", "result.json"))
        config_path.write_text(cfg.to_yaml())
        request["config_path"] = str(config_path)
        write_json(request_path, request)
        log(f"  tracing the step on {world} × {spec.name} (fake tensors; about a minute for a 2B model) ...")
        try:
            done = subprocess.run([sys.executable, "-c", WORKER_START, str(PACKAGE_ROOT), str(request_path),
                                   str(result_path), str(os.getpid())],
                                  env=_worker_env(shim), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise DryRunFailed(f"the trace did not finish in {timeout_s:.0f} s") from None
        if not result_path.is_file():
            raise DryRunUnavailable(_crash_line(done))
        result = read_json(result_path)
    _as_asked(result, request, spec)
    if "error" in result:
        where = f" at {result['where']}" if result.get("where") and result["where"] != "config" else ""
        if result.get("where") == "config":  # the problems themselves, as the run would list them
            raise ConfigError(result.get("problems") or [result["error"]])
        raise DryRunFailed(f"the step fails on {world} × {spec.name}: {result['error']}{where}")
    return result


def dry_run_batch(cfgs: list[RunConfig], gpu: str | None = None, nproc_per_node: int = 1, nnodes: int = 1,
                  memory_gb: float = 0.0, headroom: float = 0.9,
                  done: Callable[[int, dict[str, Any]], None] | None = None,
                  network: str | None = None) -> list[dict[str, Any]]:
    """Each of ``cfgs`` traced as :func:`dry_run` traces one, without the largest-fit search, in ONE
    tracing process (torch and the shim imported once: the worker's batch mode), each predicted
    (over ``network`` between nodes, as dry_run).
    It prints nothing (a fake-CUDA shim it has to build first, it builds silently): its callers
    say what they trace. A step that fails is not raised: its result holds ``error`` (and
    ``where``). ``done(i, result)`` is called as each trace finishes, in order. Raises as
    :func:`dry_run` does for bad input (the first config's) or a tracing process that dies;
    DryRunFailed when a trace does not finish within :data:`TIMEOUT_S` of the one before it (the
    process is killed)."""
    timeout_s = TIMEOUT_S  # read now: a test sets the module's
    spec = gpu_spec(gpu)
    if not cfgs:
        return []
    request, shim = _request(cfgs[0], spec, nproc_per_node, nnodes, memory_gb, headroom, lambda s: None, network)
    for cfg in cfgs[1:]:
        split = batch_split_problems(cfg.train, request["world"])
        if split:
            raise ConfigError(split)
    results: list[dict[str, Any]] = []
    with _sigterm_unwinds(), _trace_dir() as tmp:
        request["configs"] = []
        for i, cfg in enumerate(cfgs):
            (tmp / f"config-{i}.yaml").write_text(cfg.to_yaml())
            request["configs"].append(str(tmp / f"config-{i}.yaml"))
        write_json(tmp / "request.json", request)
        with open(tmp / "stderr.txt", "w+") as err, subprocess.Popen(
                [sys.executable, "-c", BATCH_START, str(PACKAGE_ROOT), str(tmp / "request.json"),
                 str(tmp / "result.json"), str(os.getpid())], env=_worker_env(shim),
                stdout=subprocess.DEVNULL, stderr=err) as proc:  # a file: nobody reads while it runs
            try:
                deadline = time.monotonic() + timeout_s
                while len(results) < len(cfgs):
                    answer = tmp / f"answer-{len(results)}.json"
                    if answer.is_file():  # written whole (renamed into place) by batch_worker_main
                        deadline = time.monotonic() + timeout_s
                        result = read_json(answer)
                        _as_asked(result, request, spec)
                        if "error" not in result:
                            result["prediction"] = predicted(result, cfgs[len(results)], network=network)
                        results.append(result)
                        if done is not None:
                            done(len(results) - 1, result)
                    elif proc.poll() is not None and not answer.is_file():
                        err.seek(0)
                        raise DryRunUnavailable(_crash_line(subprocess.CompletedProcess(
                            proc.args, proc.returncode, "", err.read())))
                    elif time.monotonic() > deadline:
                        raise DryRunFailed(f"trace {len(results) + 1} of {len(cfgs)} did not finish in "
                                           f"{timeout_s:g} s")
                    else:
                        time.sleep(0.2)
            finally:
                if proc.poll() is None:
                    proc.kill()
    return results


def network_problem(network: str | None) -> str | None:
    """Why ``--network`` is refused (one line naming the choices), or None: a name the link
    table knows, or none given (the default)."""
    if network is not None and hardware.find_link(network) is None:
        return hardware.unknown_link_message("--network", network)
    return None


def _request(cfg: RunConfig, spec: hardware.DeviceSpec, nproc_per_node: int, nnodes: int, memory_gb: float,
             headroom: float, log: Log, network: str | None = None) -> tuple[dict[str, Any], Path]:
    """The worker's request for ``cfg``'s step on ``spec`` (without its config's path), and the shim
    it runs under; the flags (``network`` too, which only the prediction uses) and the batch split
    checked first, and this machine's torch."""
    problems = [p for p in (network_problem(network),) if p]
    if nproc_per_node < 1 or nnodes < 1:
        problems.append(f"--nproc-per-node {nproc_per_node} and --nnodes {nnodes} must both be >= 1")
    if not 0 < headroom <= 1:
        problems.append(f"--headroom {headroom} must be in (0, 1]")
    if memory_gb < 0:
        problems.append(f"--memory-gb {memory_gb} must be >= 0")
    if problems:  # the flags': one line
        raise PlanError("; ".join(problems))
    world = nproc_per_node * nnodes
    split = batch_split_problems(cfg.train, world)
    if split:
        raise ConfigError(split)
    install = torch_install()
    if install.cuda_build:
        raise DryRunUnavailable(f"torch {install.version} is a CUDA build; the dry run traces with a CPU-only build "
                                "of torch (./install.sh installs one where no torch is present). On a machine with "
                                "the GPU, flopwise preflight measures the step itself")
    shim = ensure_shim(install, log=log)
    memory_bytes = int((memory_gb or spec.memory_gb) * 1024**3)
    request = {"gpu": {"name": torch_name(spec), "capability": list(hardware.CAPABILITY[spec.name]),
                       "memory_bytes": memory_bytes},
               "world": world, "nproc_per_node": nproc_per_node, "nnodes": nnodes, "headroom": headroom}
    return request, shim


def _worker_env(shim: Path) -> dict[str, str]:
    """The tracing process's environment: the shim preloaded, not a launched rank."""
    env = dict(os.environ, LD_PRELOAD=":".join(filter(None, [str(shim), os.environ.get("LD_PRELOAD", "")])),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONSAFEPATH="1",  # Python 3.11+: no current directory on sys.path (WORKER_START for 3.10)
               PYTHONHASHSEED="0")  # ZeRO-1's traced peak moves by ~1% with the order of sets: reproducible
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)  # not a launched rank
    return env


def _as_asked(result: dict[str, Any], request: dict[str, Any], spec: hardware.DeviceSpec) -> None:
    """The request (less its config's path) and the GPU's table name, kept in the worker's ``result``."""
    result["request"] = {k: v for k, v in request.items() if k not in ("config_path", "configs")}
    result["request"]["gpu"] = dict(request["gpu"], spec=spec.name)


def for_json(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` as ``--json`` prints it: the kernel list (thousands of records, the prediction's
    input) replaced by its length."""
    trace = dict(result.get("trace", {}))
    if "kernels" in trace:
        trace["kernels"] = {k: (len(v) if k == "records" else v) for k, v in trace["kernels"].items()}
    return {**result, "trace": trace}


# The tracing process is started as ``python -c WORKER_START ROOT REQUEST RESULT PID``, never as
# ``python -m``: that puts the current directory first on sys.path, so a ``flopwise/`` (or
# ``torch/``) folder where the user stands would run in it. These lines take the current
# directory off sys.path before anything is imported (``-P`` and PYTHONSAFEPATH, which the
# environment sets too, are Python 3.11+), keep ROOT -- where this process imported flopwise from,
# so the worker runs the same code -- and hand over to :func:`worker_main`.
WORKER_START = (
    "import os, sys\n"
    "here = os.path.realpath(os.getcwd())\n"
    "root = sys.argv.pop(1)\n"
    "sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != here]\n"
    "if os.path.realpath(root) not in map(os.path.realpath, sys.path):\n"
    "    sys.path.append(root)\n"
    "from flopwise.tune.dryrun import worker_main\n"
    "worker_main(sys.argv[1:])\n")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding flopwise/


def worker_main(argv: list[str]) -> None:
    """The tracing process, after WORKER_START: it ends with the dry run (``PID``), however
    that ends -- ``kill -9`` included -- and then removes the dry run's temporary directory,
    which the dry run, killed, could not; then it traces (``tune/worker.py``)."""
    request, result, parent = argv[0], argv[1], int(argv[2])
    tmp = Path(request).parent

    def remove_tmp() -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    from flopwise.data.prepare import die_with  # lazy: numpy and tokenizers, only in the tracing process

    die_with(parent, before_exit=remove_tmp)
    if os.getppid() != parent:  # the dry run ended before the watch began (its pid may be another's now)
        remove_tmp()
        os._exit(1)
    from flopwise.tune import worker  # lazy: torch, only in the tracing process

    worker.main([request, result])


# A batch's tracing process starts as WORKER_START's does, then hands each config's answer over as
# it comes (batch_worker_main), so that the dry run can say which traces have finished.
BATCH_START = WORKER_START.replace("import worker_main\nworker_main(", "import batch_worker_main\nbatch_worker_main(")
assert BATCH_START != WORKER_START


def batch_worker_main(argv: list[str]) -> None:
    """:func:`worker_main` for a batch (``configs`` in the request): each config's answer is also
    written to ``answer-I.json`` beside the request as soon as it is known (the worker writes its
    result only at the end)."""
    from flopwise.tune import worker  # lazy: torch, only in the tracing process

    answer, where, count = worker._answer, Path(argv[0]).parent, itertools.count()

    def answered(request: dict[str, Any]) -> dict[str, Any]:
        out = answer(request)
        i = next(count)
        write_json(where / f"answer-{i}.json", out)  # whole or not at all: the dry run reads it as it comes
        return out

    worker._answer = answered
    worker_main(argv)


TMP_PREFIX = "flopwise-dryrun-"
OWNER = "owner.lock"  # in a dry run's temporary directory: locked (flock) for as long as that dry run lives


@contextlib.contextmanager
def _trace_dir() -> Iterator[Path]:
    """A temporary directory for one trace, removed at the end. First, those of ended dry runs
    are removed: where a dry run and its tracing process were both killed (``kill -9`` of the
    two), nothing else does. A dry run holds a lock on its directory's OWNER file while it
    lives, so a directory whose lock can be taken is an ended dry run's."""
    _remove_ended_trace_dirs()
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
    try:
        with open(tmp / f"{OWNER}.new", "w") as owner:
            fcntl.flock(owner, fcntl.LOCK_EX)
            os.replace(tmp / f"{OWNER}.new", tmp / OWNER)  # locked before it has its name: never taken for ended
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_ended_trace_dirs() -> None:
    for old in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        try:
            with open(old / OWNER) as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked (its dry run lives), someone else's, or no lock yet (one being made)
            continue
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM, while the trace runs, unwinds the dry run -- the tracing process killed, the
    temporary directory removed -- and exits with status 143, where Python's default would end
    this process on the spot and leave both behind. A handler someone else set stays."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM cannot cut the clean-up short (SIGKILL can)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            print("flopwise: terminated (SIGTERM): the trace stopped, its temporary directory removed",
                  file=sys.stderr, flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _crash_line(done: subprocess.CompletedProcess) -> str:
    """One line for a tracing process that ended without a result."""
    if done.returncode < 0:
        try:
            how = signal.Signals(-done.returncode).name
        except ValueError:
            how = f"signal {-done.returncode}"
        what = f"the tracing process was killed by {how}"
    else:
        what = f"the tracing process exited with status {done.returncode}"
    lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
    return f"{what} ({lines[-1][:300] if lines else 'no output'}); the dry run is tested with torch 2.13 (CPU build)"


# --------------------------------------------------------------------------- the report

def _gib(x: float) -> str:
    return f"{x:.2f} GiB"


def _share(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.1f}%" if b else "n/a"


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]


def _fit_lines(result: dict[str, Any], how: str) -> list[str]:
    """The fit: first, when the configured micro-batch does not fit, that it does not, in words
    (its traced peak against the allowance, and the size that fits and splits this run's batch);
    then the largest micro-batch that fits by trace."""
    r, fit = result["request"], result["fit"]
    mem_gib, asked = r["gpu"]["memory_bytes"] / 1024**3, result["micro_batch"]
    allowed = f"the {fit['cap_gib']:.1f} GiB allowed ({100 * r['headroom']:.0f}% of {mem_gib:.0f} GiB)"
    lines = []
    peak = fit["tried_gib"].get(str(asked))
    if peak is not None and not fit.get("asked_fits", peak <= fit["cap_gib"]):
        per_rank = result["micro_batch"] * result["accum"]  # sequences per rank per optimizer step
        split = max((m for m in range(1, (fit.get("micro_batch") or 0) + 1) if per_rank % m == 0), default=0)
        use = (f": train.micro_batch_size={split} fits and splits the {per_rank} sequences a rank takes a step "
               f"into {per_rank // split} micro-batches" if split else "")
        lines.append(f"  fits       micro-batch {asked} does not fit: its traced peak ({how}) {_gib(peak)} is over "
                     f"{allowed}{use}")
    if fit.get("micro_batch"):
        best = fit["tried_gib"].get(str(fit["micro_batch"]), fit["tried_gib"].get(fit["micro_batch"]))
        within = f"({_gib(best)} within {fit['cap_gib']:.1f} GiB = {100 * r['headroom']:.0f}% of {mem_gib:.0f})"
        if fit.get("capped"):  # the search stops at its cap: the largest that fits is not known
            lines.append(f"  fits       up to the search's cap of {fit['micro_batch']} by trace ({how}) {within}; "
                         "larger not tried")
        else:
            lines.append(f"  fits       largest micro-batch by trace ({how}): {fit['micro_batch']} {within}")
    else:
        lines.append(f"  fits       no micro-batch fits within {allowed} by trace")
    return lines


def render(result: dict[str, Any]) -> list[str]:
    """The dry run's report, a line each: what ran, memory, fit, syncs, FLOPs, compile, collectives."""
    r, t = result["request"], result["trace"]
    world, mem_gib = r["world"], r["gpu"]["memory_bytes"] / 1024**3
    lines = [f"flopwise preflight --dry-run · {world} × {r['gpu']['spec']} ({r['nproc_per_node']} per node × "
             f"{r['nnodes']} node(s)) · traced on fake tensors with torch {result['torch']}: nothing ran on a GPU"]
    kernels = ", ".join(f"{k} ×{v}" for k, v in sorted(t.get("sdpa_kernels", {}).items())) or "no SDPA"
    if t.get("sdpa_kernels") and t.get("sdpa_order"):
        kernels += f" ({t['sdpa_order']})"
    fp8 = f" + fp8 {result['fp8']}" if result.get("fp8") else ""
    lines.append(f"  step       runs · {result['strategy']} · {result['precision']}{fp8} · compile {result['compile']} "
                 f"· loss "
                 f"{result['loss']} · SDPA kernels {kernels} · micro-batch {result['micro_batch']} × accumulation "
                 f"{result['accum']} (traced: {t['traced_accum']}) · seq {result['seq_len']}")
    eager, plan = t["eager_memory"], result["plan"]
    kinds = " · ".join(f"{k} {v:.2f}" for k, v in eager["by_kind_gib"].items())
    lines.append(f"  memory     rank 0's traced peak (eager): {_gib(eager['peak_gib'])} of {mem_gib:.0f} GiB · {kinds}")
    compiled = t.get("compiled")
    if compiled:
        cm = compiled["memory"]
        lines.append(f"             compiled ({cm['backend']}: the partitioner's saved activations, unfused "
                     f"temporaries): {_gib(cm['peak_gib'])} ({_share(cm['peak_gib'], eager['peak_gib'])} vs eager)")
    as_run = t.get("memory", eager)
    lines.append(f"             planner (flopwise plan, the step as it runs): {_gib(plan['total'])} "
                 f"({_share(plan['total'], as_run['peak_gib'])} vs the {'compiled' if compiled else 'eager'} trace)")
    lines += _fit_lines(result, "compiled" if compiled else "eager")
    syncs = t["syncs"]
    lines.append(f"  host syncs {len(syncs)} per step:" if syncs else
                 "  host syncs none in the step (its loss and gradient norm are read on log steps, other steps' "
                 "one step late)")
    lines += [f"             {s['op'].split('.')[1] if '.' in s['op'] else s['op']} at {s['source']}" for s in syncs]
    f = t["flops"]
    scale = f["per_step_scale"]
    exact = "exact" if f["matmul"] == f["matmul_expected"] else _share(f["matmul"], f["matmul_expected"])
    lines.append(f"  FLOPs      rank 0 per step: matmuls {human(f['matmul'] * scale)} = analytic 6·N_matmul"
                 f"{' + recompute' if f['recompute_fraction'] else ''} ({exact}) · attention "
                 f"{human(f['attention'] * scale)} traced vs {human(f['attention_model'] * scale)} model "
                 "(the flash backward recomputes the scores: hardware, not model FLOPs)")
    if compiled:
        last = compiled["per_step"][-1]
        recompiles = len(compiled["recompile_reasons"])
        lines.append(f"  compile    {last['graphs']} graph(s), {last['graph_breaks']} graph break(s), {recompiles} "
                     f"recompile(s) over {len(compiled['per_step'])} steps")
        lines += [f"             break: {_one_line(k)} (×{v})" for k, v in compiled["break_reasons"].items()]
        lines += [f"             recompile: {m}" for m in compiled["recompile_reasons"]]
        if last["graph_breaks"] and result["compile"] == "model" and result["strategy"] in WRAPPERS:
            lines.append(f"             {WRAPPERS[result['strategy']]}: train.compile=blocks compiles each block "
                         "without a break")
    if t["collectives"]:
        parts = [f"{op.strip('_')} ×{c['calls']} ({human(c['bytes'], 'B')})" for op, c in t["collectives"].items()]
        lines.append(f"  collectives rank 0, traced step ({t['traced_accum']} micro-batches): {' · '.join(parts)}")
    if "prediction" in result:
        lines += render_prediction(result["prediction"])
    lines.append(f"  not seen   a trace cannot see {'; '.join(UNSEEN)}")
    return lines
