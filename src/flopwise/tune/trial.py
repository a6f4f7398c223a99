"""One preflight trial: the trainer's own step at one configuration, timed -- here, in a fresh
process, or on N ranks started for it.

:func:`measure` builds a fresh model, optimizer and compiler (and on CUDA empties the cache
and resets the peak) before it times, but a process keeps more than that between trials: CUDA
graph pools of ``reduce-overhead``, the allocator's reserved segments and their fragmentation,
cuBLAS and cuDNN workspaces, threads, autotuning choices held in memory.
:func:`measure_in_processes` runs the same ``measure`` in processes started for it alone
(forked by a forkserver, see below), so what one rung left behind cannot speed up or slow
down the next, and a rung that crashes its process (a CUDA error, an abort inside a kernel
library) is a failed row instead of the end of the ladder.

With ``world > 1`` it starts ``world`` ranks on this machine (``cuda:0`` .. ``cuda:N-1`` with
NCCL, or CPU processes with gloo), joined into a process group as ``torchrun`` would; each
rank runs ``measure`` under the strategy of the configuration, and rank 0's result -- the
global batch's tokens/s, the ranks' mean first-step loss -- comes back as JSON through a
file in a private temporary directory (nothing is unpickled from it).

A process started with ``spawn`` first imports torch and its compiler (an optimizer step
imports dynamo): about 5 s of CPU on this project's 2-core CPU, for every rank of every trial.
So the trials' processes are forked by a **forkserver** (multiprocessing's, which PyTorch
supports with CUDA) that has imported :data:`FORKSERVER_PRELOAD` once, in a process of its own
that runs nothing else: no tensor op (a process forked after libgomp's thread pool started
hangs in its first parallel region), no CUDA (initialised only in the trial). A trial's process
therefore still starts with nothing run, and imports only flopwise. Two consequences: its
environment is the one preflight had when its first trial started the forkserver (nothing
sets variables between trials), and its parent is the forkserver, so it ends with the
preflight through :func:`~flopwise.data.prepare.die_with` rather than prctl's death signal --
and, since a ``kill -9``ed preflight cannot remove the trial's temporary directory, removes it
as it goes.
Inside :func:`ready_processes`, which preflight opens around its trials, the next one-rank
trial's process is started while the current one runs and waits, imported, for its trial:
still a process that has run nothing, so the isolation is the same, and its start is off the
clock.

:class:`TrialRunner` is how preflight times a configuration, the micro-batch search and the
ladder alike: a :class:`TrialSpec` (micro-batch, checkpointing, steps, probe) from the
configuration, measured here or in fresh processes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver as mp_forkserver
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, cast

import torch
import torch.multiprocessing as mp

from flopwise.config import ActivationCheckpointing, ConfigError, RunConfig
from flopwise.data.datadir import open_data_dir
from flopwise.data.prepare import die_with
from flopwise.errors import FlopwiseError, is_out_of_memory
from flopwise.fsio import read_json, read_text, write_file, write_json
from flopwise.measure.meter import median
from flopwise.measure.timing import StepTimer
from flopwise.parallel.distributed import DistEnv, init_distributed
from flopwise.parallel.strategy import resolve_strategy
from flopwise.train.precision import resolve
from flopwise.train.setup import build_step, train_loader
from flopwise.train.train_step import PendingStep, StepOnly, train_step

TRIAL_TIMEOUT_MIN = 10.0  # a collective of a trial that waits longer fails the trial instead of hanging it


class TrialError(FlopwiseError, RuntimeError):
    """A trial that failed in its process: the message is the exception's last line there."""


def failure_status(e: BaseException) -> str:
    """A failed trial's status: "oom" (an allocation that failed, on CUDA or the CPU -- told by its
    message where the trial ran in its own process: ``errors.is_out_of_memory``) or "error"."""
    return "oom" if is_out_of_memory(e) else "error"


@dataclass(frozen=True)
class TrialSpec:
    """What one trial times: the configuration at ``micro_batch`` with ``checkpointing`` (its
    other settings as they are), ``warmup`` untimed optimizer steps, then ``steps`` timed ones,
    each accumulating ``probe_sequences`` sequences over all ranks (0: the whole global batch;
    :func:`measure` says how the run's step is extrapolated from a probe)."""

    micro_batch: int
    checkpointing: str
    warmup: int
    steps: int
    probe_sequences: int = 0


@dataclass(frozen=True)
class _Job:
    """A trial's orders to each of its processes (started for this preflight, sent over a pipe
    or as ``start_processes``' argument): the ranks and their rendezvous port, what to time and
    where, the result file rank 0 writes, and the preflight they end with."""

    world: int
    port: int
    cfg: RunConfig
    spec: TrialSpec
    device: str
    out: str
    parent_pid: int


def measure_in_processes(cfg: RunConfig, spec: TrialSpec, device: torch.device, world: int = 1,
                         timeout_s: float | None = None) -> dict[str, Any]:
    """:func:`measure`'s result, measured in ``world`` fresh processes on this machine.

    ``timeout_s``: the trial's processes are killed when it has not finished by then (a
    ``max-autotune`` compile that would eat the rest of the ladder's budget), a TrialError."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError([f"a {world}-rank trial needs {world} GPUs; this machine has {torch.cuda.device_count()}"])
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    # a one-rank trial's process is there before its directory is: from then on, whatever kills
    # this preflight, a process that knows the directory removes it (see _standby)
    worker = _worker() if world == 1 else None
    with tempfile.TemporaryDirectory(prefix="flopwise-trial-") as tmp:
        out = Path(tmp) / "result.json"
        job = _Job(world, free_port(), cfg, spec, str(device), str(out), os.getpid())
        if worker is not None:
            return _in_one_process(worker, job, deadline, timeout_s)
        ctx = mp.start_processes(_rank, args=(job,), nprocs=world, join=False, start_method=_forkserver())
        try:
            while not ctx.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise TrialError(f"stopped after {timeout_s:.0f} s: the time budget ran out during this trial")
        except mp.ProcessRaisedException as e:
            raise TrialError(_last_line(str(e))) from None
        except mp.ProcessExitedException as e:
            raise TrialError(f"a trial process died: {e}") from None
        finally:
            _kill(ctx)
        return read_json(out)


FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed"]  # imports only: see the module's doc


def _forkserver() -> Literal["forkserver"]:
    """The start method of trial processes, the forkserver's imports set (read when it starts)
    and the forkserver started away from the current directory."""
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    start_trial_processes()
    return "forkserver"


def start_trial_processes() -> None:
    """Start the trials' forkserver (and multiprocessing's resource tracker) in ``/``, once;
    preflight calls it before any trial, so that what keeps it from starting (a TMPDIR too long
    for its socket, with no shorter directory to use) is one error about the machine, not every
    trial failing alike and a preflight that blames memory. Both are
    ``python -c`` processes, whose sys.path begins with their current directory, and the
    forkserver imports FORKSERVER_PRELOAD before anything else: started where preflight runs, a
    ``torch/`` or ``multiprocessing/`` folder there would be what they import. The processes
    it forks take preflight's directory and sys.path back (multiprocessing sends both with
    each). ``/`` rather than an empty directory of flopwise's: one removed while the forkserver
    still imports torch fails that import (MKL cannot load libtorch_cpu)."""
    try:
        here = os.getcwd()
    except FileNotFoundError:  # preflight's own directory is gone: nothing there to import
        here = None
    os.chdir("/")
    short = _short_socket_dir()
    before, tempfile.tempdir = tempfile.tempdir, short or tempfile.tempdir
    try:
        mp_forkserver.ensure_running()  # returns at once when it runs already
    except OSError as e:  # its socket is made under TMPDIR, and a Unix socket's path has at most 107 bytes
        if "path too long" not in str(e):
            raise
        raise ForkserverError(f"the trials' forkserver cannot make its socket under the temporary directory "
                              f"{tempfile.gettempdir()} ({e}): set TMPDIR to a shorter directory, e.g. "
                              "TMPDIR=/tmp") from None
    finally:
        tempfile.tempdir = before  # multiprocessing keeps the directory it made (its pymp-*) for the rest
        if here is not None:
            os.chdir(here)


# multiprocessing's socket: TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and sun_path holds 107 bytes
_SOCKET_TAIL = len("/pymp-xxxxxxxx/listener-xxxxxxxx")
_SUN_PATH = 107


def _short_socket_dir() -> str | None:
    """A shorter directory for multiprocessing's socket when TMPDIR is too long for one (None when
    it is not): ``/tmp`` where it is a writable directory. The forkserver's socket directory is
    all that moves there; trials' own temporary directories stay under TMPDIR."""
    if len(tempfile.gettempdir().encode()) + _SOCKET_TAIL <= _SUN_PATH:
        return None
    return "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK) else None


class ForkserverError(FlopwiseError, RuntimeError):
    """The trials' processes cannot be started on this machine (not a trial's failure)."""


class _Process:
    """A forked process that imports what a trial needs (unpickling its target imports this
    module: the model, the loader), then waits on a pipe for one trial and runs it as rank 0 of 1."""

    def __init__(self) -> None:
        ctx = mp.get_context(_forkserver())
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_standby, args=(child, os.getpid()), name="flopwise-trial")
        self.proc.start()
        child.close()

    def close(self, waiting: bool = True) -> None:
        """End it: one still ``waiting`` for a trial reads the closed pipe and exits; one that was
        given a trial and is still running (past its time) is killed."""
        self.conn.close()
        if waiting:
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


_ready: list[_Process] = []  # the next trial's process, started while one runs (inside ready_processes)
_keep_ready = False


@contextlib.contextmanager
def ready_processes() -> Iterator[None]:
    """Within it, each one-rank trial in a fresh process starts the next trial's process while
    it runs; the one left waiting at the end is closed. For GPU trials: on a CPU the imports
    would take cores from the trial being timed."""
    global _keep_ready
    _keep_ready = True
    try:
        yield
    finally:
        _keep_ready = False
        while _ready:
            _ready.pop().close()


def _worker() -> _Process:
    """The process for a one-rank trial: the one made ready for it, if any; within
    :func:`ready_processes`, the next one starts now and imports while this trial runs."""
    worker = _ready.pop() if _ready else _Process()
    if _keep_ready:
        _ready.append(_Process())
    return worker


def _in_one_process(worker: _Process, job: _Job, deadline: float | None, timeout_s: float | None) -> dict[str, Any]:
    """One trial in ``worker``, its result or a TrialError; the worker is ended either way."""
    try:
        try:
            worker.conn.send(job)  # to the process started for us, over a pipe: nothing read from a file
        except OSError:  # it died while it waited (a broken pipe)
            worker.close()
            worker = _Process()
            worker.conn.send(job)
        while worker.proc.is_alive():
            worker.proc.join(timeout=0.5)
            if deadline is not None and time.monotonic() > deadline and worker.proc.is_alive():
                raise TrialError(f"stopped after {timeout_s:.0f} s: the time budget ran out during this trial")
    finally:
        worker.close(waiting=False)
    out = Path(job.out)
    error = out.with_name("error.txt")
    if out.exists():
        return read_json(out)
    if error.exists():
        raise TrialError(read_text(error).strip())
    raise TrialError(f"a trial process died: exit code {worker.proc.exitcode}")


def _standby(conn: Any, parent_pid: int) -> None:
    """A one-rank trial's process: wait for the trial (or for the pipe to close: not needed after
    all), run it; an exception's last line goes to ``error.txt`` beside the result file."""
    given: list[_Job] = []  # the trial, once sent: its directory is removed if the preflight dies

    def forget() -> None:
        if not given:  # the preflight died before this process took its trial: it may be in the pipe
            try:
                if conn.poll():
                    given.append(conn.recv())
            except (EOFError, OSError):
                pass
        for sent in given:
            _remove_trial_dir(sent)

    die_with(parent_pid, before_exit=forget)
    try:
        job = conn.recv()
    except (EOFError, OSError):
        return
    finally:
        conn.close()
    given.append(job)
    try:
        _rank(0, job, watched=True)
    except BaseException:  # noqa: BLE001 - the trial's failure is its result, told to the parent
        write_file(Path(job.out).with_name("error.txt"), _last_line(traceback.format_exc()), "trial error")
        raise SystemExit(1) from None


def _kill(ctx: "mp.ProcessContext") -> None:
    """End every process of a trial still running (after a timeout, or a rank's failure)."""
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _rank(local_rank: int, job: _Job, watched: bool = False) -> None:
    """One process of a trial (``mp.start_processes`` passes ``local_rank`` first). One rank
    measures on the parent's device (``cuda:1`` stays ``cuda:1``); N ranks on ``cuda:LOCAL_RANK``.
    It ends with the preflight that started it, however that ends (``kill -9`` included), and
    then removes the trial's directory, which a killed preflight cannot (``watched``: the caller
    set that up already)."""
    if not watched:
        die_with(job.parent_pid, before_exit=lambda: _remove_trial_dir(job))
    cfg, world = job.cfg, job.world
    env, device = DistEnv(), torch.device(job.device)
    if device.type == "cuda" and world == 1:
        torch.cuda.set_device(device)
    elif device.type == "cpu" and world > 1 and not cfg.train.threads:  # as torchrun does: ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), RANK=str(local_rank),
                          LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        strategy = cfg.parallel.strategy if cfg.parallel.strategy != "single" else "auto"
        env, device = init_distributed(strategy, device.type, cfg.parallel.backend,
                                       min(cfg.parallel.timeout_min, TRIAL_TIMEOUT_MIN))
    with env.closing():  # the trial's model (a DDP wrapper) ends with measure's frame, before the group
        result = measure(cfg, job.spec, device, env)
        if env.is_main:
            write_json(Path(job.out), result, "trial result")
        env.barrier()  # ranks leave together: a group torn down under a rank still using it aborts (SIGABRT)


def _remove_trial_dir(job: _Job) -> None:
    """The trial's temporary directory (the result file's), once its preflight is gone: every
    rank may try, the first removes it."""
    shutil.rmtree(Path(job.out).parent, ignore_errors=True)


def measure(cfg: RunConfig, spec: TrialSpec, device: torch.device, env: DistEnv | None = None) -> dict[str, Any]:
    """Tokens/s, peak memory and data share of ``spec.steps`` optimizer steps after
    ``spec.warmup``, with the trainer's own step at ``spec``'s micro-batch and checkpointing:
    ``train_step`` itself (loss function, wrappers, precision, the guard's values and the skip
    on the device, the optimizer), each step's values read one step late as the loop reads
    them -- a trial times what the run does. ``cfg`` is the trial's own: it is set to ``spec``.

    Each step is timed on its own (a window): ``tok_per_s`` is the median of the windows'
    rates (of the global batch), ``tok_per_s_windows`` lists them all.

    ``spec.probe_sequences`` (fewer than ``train.global_batch_size``): each step accumulates only
    that many sequences over all ranks (rounded up to whole micro-batches), and the run's step
    is extrapolated from its timed parts -- the prefetched first micro-batches, the steady ones,
    the last one (whose backward reduces gradients under data parallelism) and the optimizer
    (:func:`extrapolated_step_s`). A run of 256 sequences of 2,048 tokens takes seconds a step;
    the probe makes a trial cost a compile and a few short steps of the same per-micro-batch
    and per-step work.

    Under ``env`` (a process group: ``tune/trial.py`` starts one for an N-rank trial) every
    rank calls this: its share of the batch, the strategy the trainer would resolve
    (``parallel.strategy``, wrapped as the trainer wraps it), the gradients reduced on each
    step's last micro-batch; ``first_loss`` is the first step's loss over all ranks, as the
    trainer logs it.

    Each trial starts with a fresh compiler: dynamo would otherwise take the second size for
    a shape change of the same code and compile a dynamic-batch graph for it (and reuse that
    for every later size), not the static graph the run itself compiles."""
    torch._dynamo.reset()
    env = env or DistEnv()
    t = cfg.train
    threads = torch.get_num_threads()  # a trial's train.threads must not outlive it
    if t.threads:
        torch.set_num_threads(t.threads)
    t.micro_batch_size = spec.micro_batch
    t.activation_checkpointing = cast(ActivationCheckpointing, spec.checkpointing)  # one of the rungs' names
    world = env.world_size
    run_accum, run_tokens = cfg.grad_accum_steps(world), cfg.tokens_per_step  # the run's step
    _probe_batch(cfg, spec.probe_sequences, world)
    accum = cfg.grad_accum_steps(world)
    prec = resolve(t.precision, device)
    # DiLoCo: its inner step, what each step of the run takes (the outer sync every H steps is not timed)
    strategy = resolve_strategy(cfg, env, device, prec.name, t.loss).step if env.distributed else "single"
    data = open_data_dir(cfg.data, log=lambda s: None)
    loader = train_loader(cfg, data, device, env.rank, world)
    parts = build_step(cfg, strategy, env, device, prec)  # as the trainer builds its step
    timer = _MarkingTimer(device)
    step = StepOnly.of(cfg, parts, env, device, prec, strategy, loader, timer)
    cuda = device.type == "cuda"
    first: list[PendingStep] = []  # the first step's values: its loss is before any update, on the first batch
    late: list[PendingStep] = []

    def one_step(i: int, stepper: StepOnly) -> None:
        timer.marks.clear()
        timer.marks.append(timer.stamp())
        now = train_step(stepper, i, accum, cfg.tokens_per_step, cfg.optim.lr)
        timer.marks.append(timer.stamp())  # after the optimizer
        if late:
            late.pop().read()  # the previous step's values, one step late, as the loop reads them
        late.append(now)
        if not first:
            first.append(now)

    try:
        for i in range(spec.warmup):
            one_step(i, step)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        timer.reset()
        windows, wall = [], 0.0
        for i in range(spec.warmup, spec.warmup + spec.steps):
            t0 = time.perf_counter()
            one_step(i, step)
            if cuda:
                torch.cuda.synchronize(device)
            wall += time.perf_counter() - t0
            windows.append(time.perf_counter() - t0 if accum == run_accum  # the run's own step, timed whole
                           else timer.run_step_s(accum, run_accum, head=max(1, cfg.data.prefetch)))
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        first_loss = first[0].read().loss if first else None
        data_s = timer.host["data"]
    finally:
        loader.close()
        first.clear()
        late.clear()
        del parts, step  # their memory goes before empty_cache
        torch.set_num_threads(threads)
        if cuda:
            torch.cuda.empty_cache()
    rates = [run_tokens / w for w in windows]
    return {"tok_per_s": median(rates), "tok_per_s_windows": rates, "peak_gb": peak, "data_share": data_s / wall,
            "first_loss": first_loss, "strategy": strategy, "world": world,
            "probe_sequences": t.global_batch_size if accum != run_accum else None}


def _probe_batch(cfg: RunConfig, probe_sequences: int, world: int) -> None:
    """A probe's step: ``probe_sequences`` rounded up to whole micro-batches on every rank, when
    that is fewer than the global batch (a checkpointed size beyond the probe: its own, larger batch)."""
    unit = cfg.train.micro_batch_size * world
    probe = -(-probe_sequences // unit) * unit
    if probe and probe < cfg.train.global_batch_size:
        cfg.train.global_batch_size = probe


class _MarkingTimer(StepTimer):
    """The step's timer, stamping its parts for a probe's extrapolation: before each micro-batch
    after the first, after the last one's backward (the end of ``fwd_bwd``); the trial stamps
    the step's start and end. On CUDA a stamp is an event (when the GPU gets there, no sync)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.marks: list[Any] = []

    def stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

    def run_step_s(self, accum: int, run_accum: int, head: int) -> float:
        """The run's step of ``run_accum`` micro-batches, extrapolated from the stamps of the step
        just timed (``accum`` micro-batches, then the optimizer): :func:`extrapolated_step_s`."""
        micro = [self.seconds(self.marks[k], self.marks[k + 1]) for k in range(accum)]
        return extrapolated_step_s(micro, self.seconds(self.marks[-2], self.marks[-1]), run_accum, head=head)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        with super().part(name):
            yield
        if name == "fwd_bwd":
            self.marks.append(self.stamp())

    def timed_batches(self, next_batch: Callable[[], Any], n: int) -> Iterator[Any]:
        fetched = 0

        def stamped() -> Any:  # asked for when the previous micro-batch's backward is done
            nonlocal fetched
            if fetched:
                self.marks.append(self.stamp())
            fetched += 1
            return next_batch()

        yield from super().timed_batches(stamped, n)


def extrapolated_step_s(micro_s: list[float], optimizer_s: float, accum: int, head: int = 1) -> float:
    """Seconds of a step of ``accum`` micro-batches (per rank) from one measured with fewer,
    ``micro_s`` in order. A step has three kinds of micro-batch: the ``head`` first ones (their
    batches were assembled while the previous step's optimizer ran: one, or ``data.prefetch``
    of them), the steady ones after them (they only accumulate, their batches assembled
    alongside the compute), and the last (its backward reduces the gradients under data
    parallelism); then the optimizer, once. A probe of ``head + 2`` or more micro-batches
    measures all three kinds; a shorter one lets its middle (or, lacking one, its first)
    micro-batches stand for the steady ones, and a single one stand for all."""
    if accum < 1 or not micro_s:
        raise ValueError(f"need accum >= 1 and a measured micro-batch, got accum={accum}, {len(micro_s)} measured")
    k = len(micro_s)
    if accum == 1 or k == 1:
        return accum * micro_s[-1] + optimizer_s
    head = max(1, min(head, k - 2, accum - 1)) if k > 2 else 1
    steady = micro_s[head:-1] or micro_s[:1]
    return sum(micro_s[:head]) + (accum - head - 1) * sum(steady) / len(steady) + micro_s[-1] + optimizer_s


@dataclass(frozen=True)
class TrialRunner:
    """How a preflight times a configuration: the one path of the micro-batch search's trials
    and re-measures and of every option the ladder tries (the micro-batch rung's included).
    Called as ``runner(cfg, world=1, timeout_s=None)``, it times ``cfg`` at its own
    ``train.micro_batch_size`` and ``train.activation_checkpointing``, ``warmup`` + ``steps``
    steps, on a copy: here (``measure_fn``, not stoppable: the ladder checks its budget between
    options), or in fresh processes (``spawn_fn``: with ``fresh``, and always on ``world > 1``
    ranks; stopped at ``timeout_s``). Each step accumulates ``probe_sequences`` sequences per
    rank (0: all of the global batch) and the run's step is extrapolated (:func:`measure`)."""

    device: torch.device
    warmup: int
    steps: int
    fresh: bool = False
    probe_sequences: int = 0
    measure_fn: Callable[..., dict[str, Any]] = measure
    spawn_fn: Callable[..., dict[str, Any]] = measure_in_processes

    def __call__(self, cfg: RunConfig, world: int = 1, timeout_s: float | None = None) -> dict[str, Any]:
        t = cfg.train
        spec = TrialSpec(t.micro_batch_size, t.activation_checkpointing, self.warmup, self.steps,
                         self.probe_sequences * world)
        if self.fresh or world > 1:
            return self.spawn_fn(copy.deepcopy(cfg), spec, self.device, world=world, timeout_s=timeout_s)
        return self.measure_fn(copy.deepcopy(cfg), spec, self.device)


def free_port() -> int:
    """A TCP port free on this machine now (the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(traceback_text: str) -> str:
    """The exception line of a child's traceback ("RuntimeError: CUDA out of memory ...")."""
    lines = [x for x in traceback_text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else traceback_text
