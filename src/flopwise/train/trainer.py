"""``flopwise train``: one device (CPU or one CUDA GPU), or one rank of a data-parallel run.

The run is built once (``setup.py``: config checks, run directory, data, model, wrappers,
optimizer, a resumed run's state), summarised (``describe.py``), then stepped: before each
step the stop conditions (a signal, ``train.max_hours``: ``stopping.py``), then one
optimizer step (``train_step.py``), then the hooks that log, validate, evaluate tasks and
save when they are due (``hooks.py``). The loop validates every ``eval.every`` steps on a
fixed held-out subset, checkpoints every ``train.checkpoint_every`` steps and at the end
(keeping ``train.keep_checkpoints``), stops early and cleanly on a signal, on
``train.max_hours`` or on a non-finite step, then writes a text sample (also every
``eval.sample_every`` steps; a stop logs its last step, validates and samples where it has
the time). Under ``torchrun`` a collective that fails because another rank died or left ends
this rank with one line that says so (``DistEnv.peer_failure``), not the backend's traceback.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from flopwise.checkpoints import intact_note
from flopwise.config import TIME_USED, RunConfig
from flopwise.deps import missing_for_run, require
from flopwise.fsio import WriteError
from flopwise.measure.timing import profiler
from flopwise.parallel.distributed import DistEnv, init_distributed
from flopwise.train import hooks
from flopwise.train.describe import describe
from flopwise.train.record import TrainResult
from flopwise.train.schedule import lr_for_step
from flopwise.train.setup import Run, setup
from flopwise.train.stopping import SignalStop, ignore_sigterm, stop_reason, stop_votes
from flopwise.train.train_step import PendingStep, StepFixed, StepOutcome, settle, train_step

Log = Callable[[str], None]


def train(cfg: RunConfig, log: Log = print, fresh: bool = False,
          clock: Callable[[], float] = time.perf_counter) -> TrainResult:
    """Train ``cfg`` in ``train.run_dir``: a new run, or the resumption of the run there.

    Under ``torchrun`` every rank calls this; they train in lockstep and rank 0 alone logs
    and writes the run's files (``parallel/distributed.py``, ``parallel/strategy.py``). ``clock``
    (seconds) is what ``train.max_hours`` and a time-fitted schedule are measured by."""
    require(missing_for_run(cfg))  # optional packages the config asks for: refused before any work
    t_start = clock()
    env, device = init_distributed(cfg.parallel.strategy, cfg.train.device, cfg.parallel.backend,
                                   cfg.parallel.timeout_min)
    with env.closing():
        # the Run (its model, and under ddp the DDP wrapper's reducer) ends with _train_in's frame,
        # before the group is torn down: see DistEnv.close
        return _train_in(env, device, cfg, log, fresh, t_start, clock)


def _train_in(env: DistEnv, device: torch.device, cfg: RunConfig, log: Log, fresh: bool, t_start: float,
              clock: Callable[[], float]) -> TrainResult:
    with _peer_failures(env, cfg):  # another rank died: this one stops with one line, not gloo's traceback
        with contextlib.ExitStack() as locks:  # rank 0 holds the run directory's lock until the run ends
            run = setup(cfg, log if env.is_main else _quiet, fresh, env, device, t_start, locks, clock)
            result = run if isinstance(run, TrainResult) else _train(run)
        env.barrier()  # ranks leave together: tearing the group down under a rank still using it aborts
    return result


def _quiet(_: str) -> None:
    """The log of ranks other than 0."""


@contextlib.contextmanager
def _peer_failures(env: DistEnv, cfg: RunConfig) -> Iterator[None]:
    """A collective that fails because another rank died, hung or left becomes the one line this
    rank stops with (``PeerFailure``: ``DistEnv.peer_failure``); any other error passes as
    it is. From then on the process ignores the SIGTERM torchrun sends every surviving rank, so
    that line gets printed before the process ends. The loop converts inside its signal handling
    (where that SIGTERM is only a stop request), :func:`train` what fails in set-up or at the end."""
    try:
        yield
    except RuntimeError as err:
        failure = env.peer_failure(err, cfg.parallel.timeout_min)
        if failure is None:
            raise
        ignore_sigterm()
        raise failure from err


def _train(run: Run) -> TrainResult:
    for line in describe(run):
        run.log(line)
    hooks.validate_at_start(run)
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    t_loop = run.clock()
    run.meter.pause()
    try:
        try:
            stopped, sample = _loop(run)
        finally:
            run.train_loader.close()  # its prefetch thread (data.prefetch) does not outlive the loop
        return hooks.finish(run, stopped, run.clock() - t_loop, sample)
    except WriteError as e:  # a full disk under metrics.jsonl, TensorBoard, samples.txt, run.json
        with contextlib.suppress(Exception):
            run.sink.close()
        kept = intact_note(run.progress.last_saved) or "no checkpoint was saved yet"
        raise WriteError(f"{e}; {kept}", e.errno, e.filename) from e  # the write site cannot know it


def _loop(run: Run) -> tuple[str, str]:
    """Step until the last step or a stop; returns why it stopped early ("" when it did not)
    and the stop's sample. A stop logs, saves, validates and samples (``hooks.on_stop``) while
    the signal handler still holds: a second signal during its validation exits at once, with
    the checkpoint already saved.

    A step is issued, then the previous step's values are read -- one step late, so the host
    never waits on the step it just queued -- and the guard settles it; a step that logs,
    validates or saves is read at once (``hooks.due``: ``read_now``). A bad step read late was skipped on
    the device already; a rollback it calls for undoes the step issued after it too."""
    p, o, t = run.progress, run.cfg.optim, run.cfg.train
    stopped, sample = "", ""
    late: tuple[PendingStep, hooks.Due] | None = None  # a step to read once the next one is issued, and its due
    last: StepOutcome | None = None  # the latest good step read: the stop's training row
    agreed: list[float] | None = None  # the ranks' stop votes, as last read
    fixed = StepFixed.of(run.optimizer, run.prec.scaler, run.strategy.step, run.cfg)  # the same for every step

    def reload(path: Any) -> dict:
        return hooks.reload(run, path)

    with SignalStop() as signals, profiler(t.profile, run.run_dir / "profile", t.profile_wait, t.profile_warmup,
                                           t.profile_active) as prof, _peer_failures(run.env, run.cfg):
        while p.step < run.total_steps or not run.total_steps:  # 0: the time alone ends it (TimeFit.done)
            stopped = stop_reason(run.env, signals, run.deadline, run.fit, agreed)
            if stopped:
                break
            t_step = run.clock()
            accum, step_tokens = run.step_size(p.step)
            time_used = run.fit.progress() if run.fit is not None else None
            lr = lr_for_step(p.step, run.total_steps, p.tokens + step_tokens, o, t.max_tokens, run.ramp,
                             time_used, run.cont)
            if run.fit is not None and time_used is not None and run.fit.done(time_used):
                stopped = TIME_USED  # a schedule fitted to the time stops itself
                break
            if late is not None:  # a rollback it calls for restores the loader to where it stood after it
                late[0].keep_loader_state()
            now = train_step(run, p.step, accum, step_tokens, lr, stop_votes(run.env, signals, run.deadline, run.fit),
                             fixed)
            if late is not None:
                (pending, late_due), late = late, None
                out = pending.read()
                agreed = out.votes
                if settle(run, out, reload):
                    hooks.record_good(run, out, late_due)
                    last = out
                elif run.guard.policy == "rollback":
                    continue  # the step just issued ran on weights the rollback replaced: undone with them
            if run.outer is not None:  # DiLoCo: the fragments due sync across worker groups (in the step's time)
                run.outer.after_step(p.step + 1, last=p.step + 1 == run.total_steps)
            hooks.count_step(run, step_tokens, run.clock() - t_step)
            prof.step()
            due = hooks.due(run, p.step)
            if not due.read_now:
                late = (now, due)
                continue
            out = now.read()
            agreed = out.votes
            if settle(run, out, reload):
                hooks.record_good(run, out, due)
                last = out
                hooks.after_step(run, out, due)
            elif run.guard.policy == "skip":
                hooks.after_step(run, out, due, good=False)  # its save and validation, when they were due
        if late is not None:  # the last step issued before a stop: read before the stop's save
            out = late[0].read()
            if settle(run, out, reload):
                hooks.record_good(run, out, late[1])
                last = out
        if stopped == TIME_USED and run.outer is not None:  # the schedule's end: DiLoCo's groups merge, as at
            run.outer.after_step(p.step, last=True)          # a last step (fragments sent at this step stay)
        if stopped:
            sample = hooks.on_stop(run, stopped, last)
    return stopped, sample
