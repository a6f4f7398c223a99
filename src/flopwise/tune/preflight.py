"""``flopwise preflight``: fit the run to the machine before spending the budget.

1. **End to end**: a few real training steps in a scratch run directory -- data readable,
   model built, loss finite and falling, a checkpoint saved and loaded back identically.
2. **Compile**: graphs and graph breaks with reasons (``train --explain``'s report).
3. **Micro-batch search** at the configured global batch, over powers of two: from the
   configured micro-batch outward, larger ones first, each timed after warm-up (tokens/s, MFU,
   peak memory), a direction stopping where tokens/s falls or, going up, a size does not fit
   (the sizes past it are "skipped" rows); an out-of-memory is caught and noted; sizes the
   memory model says cannot fit under the headroom are not run (on a CPU, ``--memory-gb``
   simulates a device). Activation checkpointing is tried where it makes a larger micro-batch
   fit, smallest first, while it pays. That is the one search (``choice.search``) the ladder's
   micro-batch rung takes too, with its tie rule. Each trial times at least
   ``request.MIN_WINDOWS`` windows (one optimizer step each) and keeps their median and
   spread; a line is printed as each trial finishes. The trials within the noise of the
   fastest are then re-measured in turn (:func:`remeasure`: A B A B ..., up to
   ``request.REMEASURE_ROUNDS`` rounds and the ``--budget-minutes`` budget) until the fastest
   leads by more than the noise, and
   :func:`choose` picks: the fastest, or of those still within its noise, one without
   activation checkpointing first, then on a GPU the larger micro-batch, on a CPU the faster median.
   With ``--ladder`` the optimization ladder (``tune/ladder.py``) takes this step's place. Both
   time a configuration one way, ``trial.TrialRunner``.
4. **Data starvation**: the share of step time spent waiting for data, with a warning.
5. **Prediction**: the full run's wall time, cost and final-checkpoint time from the
   measured throughput, next to the planner's from the nominal MFU.

A phase whose steps are long here (the end-to-end check, the trials) is announced with an
estimate of a step's time, and each long step is followed micro-batch by micro-batch
(``tune/progress.py``): a large model on a CPU otherwise left minutes without a line.

Writes ``preflight.json`` and ``preflight.yaml`` (the configuration with the chosen
settings, its paths resolved: ``flopwise train --config preflight.yaml`` runs it as is, from
any directory). What was asked travels
as one ``request.TuneRequest``, what it resolved to on this machine as one ``request.Bench``.

A SIGINT or SIGTERM in any phase stops it (:class:`Interrupted`): its scratch run, a trial's
directory and processes are removed on the way out, nothing is written, and the command exits
128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import secrets
import shlex
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch
import yaml

from flopwise.checkpoints import latest_checkpoint, load_checkpoint
from flopwise.config import ActivationCheckpointing, ConfigError, RunConfig, batch_split_problems, recorded_paths
from flopwise.data.datadir import DataDir, DataDirError, resolve_data_dir
from flopwise.errors import FlopwiseError
from flopwise.fsio import loads_json, read_text, write_file, write_json
from flopwise.measure.ceiling import measure_ceiling, step_gemms
from flopwise.measure.meter import median
from flopwise.measure.sinks import human
from flopwise.measure.timing import micro_batch_progress
from flopwise.model import build_model
from flopwise.parallel.distributed import resolve_device
from flopwise.plan.budget import epochs_warning, memory_settings_for_run
from flopwise.plan.flops import flops_per_token
from flopwise.plan.memory import MemorySettings, estimate
from flopwise.train.checkpoint import save_checkpoint
from flopwise.train.defaults import device_peak, resolve_speed
from flopwise.train.precision import cpu_native_bf16, resolve
from flopwise.train.trainer import train
from flopwise.tune.choice import Trial, choose, label, median_spread, rate, short, tied
from flopwise.tune.choice import search as search_sizes
from flopwise.tune.explain import explain_run
from flopwise.tune.ladder import climb, planned_gb, with_settings
from flopwise.tune.progress import StepProgress
from flopwise.tune.request import Bench, Log, TuneHooks, TuneRequest
from flopwise.tune.trial import TrialRunner, failure_status, ready_processes, start_trial_processes
from flopwise.tune.virtual import launch_command

STARVATION_WARN = 0.05  # waiting for data above 5% of step time deserves a look
Clock = Callable[[], float]
MeasureTrial = Callable[[Trial], dict[str, Any]]  # one trial's configuration timed: trial.measure's dict
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class PreflightError(FlopwiseError, RuntimeError):
    """Preflight cannot measure this configuration on this device (no micro-batch fits, the
    end-to-end check stopped early): the message says what and why."""


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM during a preflight (:func:`stopping_on_signals`), raised where it
    lands so that every phase's clean-up runs on the way out. A KeyboardInterrupt, not an
    Exception: the trials' ``except Exception`` (a failed trial is a result) lets it pass."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within it, the first SIGINT or SIGTERM raises :class:`Interrupted`; a second one, while
    that unwinds, exits at once (``train``'s convention, train/stopping.py). The end-to-end
    check's trainer stops on a signal after its step, as a run does: :func:`end_to_end` turns
    that stop into the same exception."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return
    seen: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if seen:
            os.write(2, f"\nflopwise preflight: {signal.Signals(signum).name} again: exiting now\n".encode())
            os._exit(128 + signum)
        seen.append(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():  # None: one set outside Python, which cannot be put back
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def remeasure(trials: list[Trial], measure_one: MeasureTrial, request: TuneRequest | None = None,
              budget_s: float = math.inf, bench: Bench | None = None, clock: Clock = time.perf_counter) -> int:
    """Measure the trials :func:`tied` with the fastest again, into their own samples, until
    the fastest leads by more than the noise; the rounds run. A round measures each of them
    once more with ``measure_one`` (the trial's own measurement, as the search took it: its
    warm-up and windows), in the same order every round -- A B A B -- so drift, heat and the
    load of other processes fall on all of them alike. It stops after ``request.remeasure_rounds``
    rounds, or before a round that would take longer (as long as their last measurements took)
    than what is left of ``budget_s`` by ``clock``; ``bench`` judges the measurements
    (MFU, fit; without one, a CPU without a memory limit or a peak). A trial that fails on a
    re-measure (an out-of-memory) is a failed trial: a size that fits only sometimes is not one to run."""
    request, bench = request or TuneRequest(), bench or Bench()
    rounds, log = request.remeasure_rounds, request.log
    t0, done = clock(), 0
    while done < rounds:
        group = tied(trials)
        if len(group) < 2:
            break
        need = sum(t.seconds / (1 + t.rounds) for t in group)
        left = budget_s - (clock() - t0)
        if need > left:
            log(f"preflight: re-measuring stops after {done} round(s): another would take ~{need:.0f} s, "
                f"{max(0.0, left):.0f} s of --budget-minutes is left")
            break
        if not done:
            log(f"preflight: {len(group)} trials within the noise of the fastest: re-measuring them in turn "
                f"(up to {rounds} round(s), until the fastest leads by more than the noise)")
        for t in group:
            s0 = clock()
            _run_trial(t, functools.partial(measure_one, t), bench)
            t.seconds += clock() - s0
            t.rounds += 1
        done += 1
        log(f"preflight: re-measure {done}/{rounds}: " + " · ".join(
            f"{short(t)} {human(rate(t))} tok/s ± {100 * (t.spread or 0):.1f}% ({t.windows} steps)"
            if t.status == "ok" else f"{short(t)} {t.status}: {t.note}" for t in group))
    return done


def candidates(cfg: RunConfig) -> list[int]:
    """Micro-batches that divide the global batch: powers of two up to it."""
    g = cfg.train.global_batch_size
    out, b = [], 1
    while b <= g:
        if g % b == 0:
            out.append(b)
        b *= 2
    return out


def preflight(cfg: RunConfig, request: TuneRequest, hooks: TuneHooks | None = None) -> dict[str, Any]:
    """Preflight ``cfg`` on this machine as ``request`` asks (the module docstring lists the
    steps). With ``request.ladder`` the micro-batch search is replaced by the optimization
    ladder (``tune/ladder.py``), which with ``request.world > 1`` also scales out to that many
    ranks here; ``request.isolation`` is how the one-rank trials (of the search or of the
    ladder) are kept apart: ``reset`` (compiler and allocator, in this process), ``process`` (a
    fresh process each: ``tune/trial.py``) or ``auto`` (process on CUDA, where an out-of-memory
    or a crashed kernel must not take the next trial's memory or the preflight with it; reset
    on a CPU, where a process costs more than a tiny trial). The search re-measures the trials
    tied with the fastest (:func:`remeasure`) for up to ``request.remeasure_rounds`` rounds,
    within ``request.budget_minutes`` of its start. ``hooks`` (a test's: how a trial is measured
    in this process and in fresh ones, and the clock) are the real ones unless given."""
    device = resolve_device(cfg.train.device)
    problems = _launch_problems(cfg, device, request)
    if problems:  # before any work
        raise ConfigError(problems)
    with stopping_on_signals(), _output_dir(request.out(cfg.preset)):
        return _preflight(cfg, device, request, hooks or TuneHooks())


def _preflight(cfg: RunConfig, device: torch.device, request: TuneRequest, hooks: TuneHooks) -> dict[str, Any]:
    """:func:`preflight`'s steps, its launch options checked."""
    report: dict[str, Any] = {"preset": cfg.preset, "device": str(device)}
    cfg, bench = _resolve(cfg, device, request, report)
    log = request.log
    _refuse_what_cannot_fit(cfg, bench, request)  # before the end-to-end check and any trial
    progress = StepProgress(cfg, bench, log, hooks.clock)
    with micro_batch_progress(progress):  # lines within long steps: the end-to-end check's, a trial's here
        report["end_to_end"] = end_to_end(cfg, device, log, progress)  # 1. four real steps, a checkpoint round trip
        if cfg.train.compile != "off":  # 2. graphs and breaks; recompiles seen after warm-up in the steps above
            report["compile"] = explain_run(_copy(cfg), log=log)
            for warning in report["end_to_end"]["recompiles"]:
                log(f"preflight: {warning}")
        report["isolation"] = "process" if bench.fresh else "reset"
        cfg, trials, best, reason = _search_or_climb(cfg, report, bench, request, progress, hooks)  # 3. search/ladder
    report["trials"] = [x.__dict__ for x in trials]
    report["chosen"] = {"micro_batch_size": best.micro_batch, "activation_checkpointing": best.checkpointing}
    report["choice_reason"] = reason
    for line in trials_table(trials, best):
        log(line)
    log(f"preflight: chose {label(best)}: {reason}")
    _conclude(cfg, report, best, bench, request)  # the ceiling, 4. data starvation, 5. the prediction
    return report


@contextlib.contextmanager
def _output_dir(out: Path) -> Iterator[None]:
    """``out`` made for preflight.json and preflight.yaml (first: a directory that cannot be
    made fails before any work); one made here is removed again, if still empty, when the
    preflight does not finish."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only an empty one
        raise


def _refuse_what_cannot_fit(cfg: RunConfig, bench: Bench, request: TuneRequest) -> None:
    """A PreflightError when by the memory model not even micro-batch 1 with full activation
    checkpointing (the least memory a trial can take; the model's needs grow with the
    micro-batch) fits ``bench``: no trial, of the search or the ladder, could."""
    least = planned_gb(with_settings(cfg, {"train.micro_batch_size": 1, "train.activation_checkpointing": "full"}),
                       bench.device)
    if bench.fits(least):
        return
    memory = f"--memory-gb {request.memory_gb:g}" if request.memory_gb else f"the device's {bench.memory_gb:.3g} GiB"
    raise PreflightError(
        f"no micro-batch fits: micro-batch 1 with full activation checkpointing needs {least:.3g} GiB by the memory "
        f"model, more than --headroom {bench.headroom:g} of {memory}; a device with more memory, a smaller model or "
        "a shorter train.seq_len")


def _resolve(cfg: RunConfig, device: torch.device, request: TuneRequest,
             report: dict[str, Any]) -> tuple[RunConfig, Bench]:
    """The configuration the trials time (its ``auto`` speed settings resolved: the trials time
    what the run will do; each noted in ``report`` and logged) and the bench they run on."""
    memory_gb = request.memory_gb
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
        memory_gb = memory_gb or torch.cuda.get_device_properties(device).total_memory / 2**30
    precision = resolve(cfg.train.precision, device).name
    cfg, speed_notes = resolve_speed(cfg, device, precision, 1)
    for name, note in speed_notes.items():
        request.log(f"preflight: {name} {note}")
    report["speed"] = speed_notes
    peak, peak_note = device_peak(device, precision, cfg.train.peak_tflops)
    fresh = request.isolation == "process" or (request.isolation == "auto" and device.type == "cuda")
    return cfg, Bench(device, memory_gb, request.headroom, fresh, flops_per_token(cfg.model, cfg.train.seq_len),
                      peak, peak_note)


def _search_or_climb(cfg: RunConfig, report: dict[str, Any], bench: Bench, request: TuneRequest,
                     progress: StepProgress, hooks: TuneHooks) -> tuple[RunConfig, list[Trial], Trial, str]:
    """Preflight's step 3 -- every rung of the ladder, one change at a time, the micro-batch among
    them, or the micro-batch search -- with one :class:`~flopwise.tune.trial.TrialRunner` for
    both: the configuration that follows, the trials, the one chosen and why."""
    device = bench.device
    if bench.fresh or request.world > 1:  # trials in processes of their own: their forkserver starts first
        start_trial_processes()
    if bench.fresh and device.type == "cuda":
        torch.cuda.empty_cache()  # the trials' processes share the GPU with this one: hold nothing cached
    runner = TrialRunner(device, request.warmup, request.windows, bench.fresh, measure_fn=hooks.measure_fn,
                         spawn_fn=hooks.spawn_fn)
    # On a GPU the next trial's process imports while one runs (on a CPU that would take the cores being timed)
    ready = ready_processes() if bench.fresh and device.type == "cuda" else contextlib.nullcontext()
    with ready:
        if request.ladder:
            cfg, best = climb_ladder(cfg, report, runner, bench, request, progress, hooks.clock)
            back = report["ladder"].get("fell_back")
            return cfg, [best], best, (f"{back['to']}: the climbed configuration measured {back['behind']:+.1%} "
                                       "against it when confirmed" if back else "the ladder's last kept rung")
        trials = micro_batch_search(cfg, report, runner, bench, request, progress, hooks.clock)
    best, reason = choose(trials, device.type)
    return cfg, trials, best, reason


def micro_batch_search(cfg: RunConfig, report: dict[str, Any], runner: TrialRunner, bench: Bench,
                       request: TuneRequest, progress: StepProgress | None = None,
                       clock: Clock = time.perf_counter) -> list[Trial]:
    """Preflight's step 3 without ``--ladder``: the candidates (:func:`search`), each trial on a
    probe of the batch where memory bounds the micro-batch (``report["probe_sequences"]``), then
    the trials tied with the fastest re-measured (:func:`remeasure`) in what is left of
    ``request.budget_minutes``."""
    probe = probe_sequences(cfg, candidates(cfg), bench)
    report["probe_sequences"] = probe or None
    runner = dataclasses.replace(runner, probe_sequences=probe)
    _say_trial_steps(cfg, probe, request, progress)

    def measure_one(t: Trial) -> dict[str, Any]:
        if progress is not None:
            progress.begin(f"trial of {short(t)}", request.warmup + request.windows)
        return runner(with_settings(cfg, {"train.micro_batch_size": t.micro_batch,
                                          "train.activation_checkpointing": t.checkpointing}))

    t0 = clock()
    trials = search(cfg, measure_one, bench, request, clock)
    remeasure(trials, measure_one, request, request.budget_minutes * 60 - (clock() - t0), bench, clock)
    return trials


def climb_ladder(cfg: RunConfig, report: dict[str, Any], runner: TrialRunner, bench: Bench,
                 request: TuneRequest, progress: StepProgress | None = None,
                 clock: Clock = time.perf_counter) -> tuple[RunConfig, Trial]:
    """Preflight's step 3 with ``--ladder``: the climb (``report["ladder"]``), its trials by
    ``runner`` on a probe of the batch (``report["ladder_probe_sequences"]``); the climbed
    configuration and its final rung as a trial."""
    sizes = [b for b in candidates(cfg) if not batch_split_problems(with_settings(
        cfg, {"train.micro_batch_size": b}).train, request.world)]  # micro-batches the N-rank launch can split into
    probe = probe_sequences(cfg, sizes, bench)
    report["ladder_probe_sequences"] = probe or None
    _say_trial_steps(cfg, probe, request, progress)
    probed = dataclasses.replace(runner, probe_sequences=probe)

    def measure_one(c: RunConfig, world: int = 1, timeout_s: float | None = None) -> dict[str, Any]:
        if progress is not None:
            progress.begin(f"ladder trial at micro-batch {c.train.micro_batch_size}", request.warmup + request.windows)
        return probed(c, world=world, timeout_s=timeout_s)

    report["ladder"] = lad = climb(cfg, measure_one, sizes, bench, request, clock)
    if lad["world"] < request.world:  # the N-rank launch was not measured: nothing is said of it
        ranks = next((r for r in lad["rungs"] if r["rung"] == "ranks"), {"status": "not tried", "why": ""})
        request.log(f"preflight: the {request.world}-rank launch was not measured (ranks {ranks['status']}: "
                    f"{ranks['why']}): no {request.world}-rank prediction; the prediction and preflight.yaml are "
                    "one rank's")
    cfg = with_settings(cfg, lad["chosen"])
    return cfg, _ladder_trial(cfg, report["ladder"]["final"], request.windows, bench.device)


def _say_trial_steps(cfg: RunConfig, probe: int, request: TuneRequest, progress: StepProgress | None) -> None:
    """Before the trials: how long one of their steps (``probe`` sequences, or the whole global
    batch) will take here, when that is long (``tune/progress.py``)."""
    tokens = (probe or cfg.train.global_batch_size) * cfg.train.seq_len
    said = progress.estimate(tokens) if progress is not None else ""
    if said:
        request.log(f"preflight: each trial: {request.warmup} warm-up + {request.windows} timed steps of "
                    f"{tokens:,} tokens: {said}")


def probe_sequences(cfg: RunConfig, sizes: list[int], bench: Bench) -> int:
    """Sequences per rank a trial's step accumulates (0: the whole global batch): a few of the
    largest micro-batch the memory model says fits as configured -- the prefetched head
    (``data.prefetch``, up to the 2 the ladder tries), a steady one and the last, each timed
    (``trial.extrapolated_step_s``) -- so every size up to it divides the probe: those trials
    see the same data, as the first-step loss check needs.
    A larger size, which fits only with checkpointing, runs one micro-batch of its own, a
    larger batch drawn the same way (at the initial weights its first loss moved 3e-4 to 5e-4
    from a batch half its size on the tiny preset at 128 tokens a sequence; the ladder's
    tolerance is 1e-3). Without a memory size (a CPU) every size may fit and the probe is the
    whole batch."""
    if not bench.memory_gb:
        return 0
    fit = [b for b in sizes if bench.fits(planned_gb(with_settings(cfg, {"train.micro_batch_size": b}), bench.device))]
    probe = (2 + max(2, cfg.data.prefetch)) * max(fit or sizes[:1] or [cfg.train.micro_batch_size])
    return probe if probe < cfg.train.global_batch_size else 0


def _launch_problems(cfg: RunConfig, device: torch.device, request: TuneRequest) -> list[str]:
    """What is wrong with preflight's own launch options, before any work."""
    out, world, ladder = [], request.world, request.ladder
    if ladder and not request.budget_minutes > 0:
        out.append(f"--budget-minutes {request.budget_minutes:g}: the ladder needs a time budget above 0")
    if request.ladder_fp8 and not ladder:  # the micro-batch search keeps the precision as configured
        out.append("--ladder-fp8 lets the ladder keep fp8: add --ladder (the micro-batch search tries no precision)")
    if not 0 < request.headroom <= 1:  # NaN fails both comparisons
        out.append(f"--headroom {request.headroom:g}: the share of the device's memory a trial may use must be "
                   "in (0, 1]")
    if request.isolation not in ("auto", "reset", "process"):
        out.append(f"--isolation {request.isolation!r}: choose auto, reset or process")
    if world < 1:
        out.append(f"--nproc-per-node {world}: must be at least 1")
    elif world > 1:
        if not ladder:
            out.append(f"--nproc-per-node {world} needs --ladder: only the ladder climbs at N ranks")
        if device.type == "cuda" and world > torch.cuda.device_count():
            out.append(f"--nproc-per-node {world}: this machine has {torch.cuda.device_count()} visible GPU(s)")
        if cfg.train.global_batch_size % world:
            out.append(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
                       f"--nproc-per-node {world}: every rank takes an equal share of the global batch")
    return out


def _ladder_trial(cfg: RunConfig, final: dict[str, Any], windows: int, device: torch.device) -> Trial:
    """The ladder's final configuration as the trial the prediction and the ceiling start from."""
    t = cfg.train
    settings = memory_settings_for_run(cfg, resolve(t.precision, device).name, t.loss)
    settings = MemorySettings(**{**settings.__dict__, "activation_checkpointing": t.activation_checkpointing})
    return Trial(t.micro_batch_size, t.activation_checkpointing, "ok", tok_per_s=final["tok_per_s"],
                 spread=final["spread"], windows=windows, mfu=final["mfu"], peak_gb=final["peak_gb"],
                 predicted_gb=estimate(cfg.model, t.micro_batch_size, t.seq_len, settings).gb()["total"],
                 data_share=final["data_share"])


def end_to_end(cfg: RunConfig, device: torch.device, log: Log, progress: StepProgress | None = None) -> dict[str, Any]:
    """Four real training steps in a scratch directory, a checkpoint and its round trip; with
    ``progress``, a step that will be long is announced first and followed as it runs."""
    if progress is not None:
        progress.begin("end-to-end check", 4, cfg.tokens_per_step)
        said = progress.estimate(cfg.tokens_per_step)
        if said:
            log(f"preflight: end-to-end check: 4 steps of {cfg.tokens_per_step:,} tokens ({cfg.grad_accum_steps(1)} "
                f"micro-batches of {cfg.train.micro_batch_size} x {cfg.train.seq_len}): {said}")
    scratch = _scratch_name()
    try:
        scratch.mkdir(mode=0o700)  # inside the try: a signal once the directory exists removes it
        check = _copy(cfg)
        check.train.run_dir, check.train.max_steps, check.train.max_tokens = str(scratch / "run"), 4, 0
        check.train.checkpoint_every, check.train.log_every, check.eval.every = 2, 1, 0
        check.eval.sample_tokens, check.eval.tasks, check.tracking.tensorboard = 0, "", "false"
        # four steps whatever the run's time budget: its deadline (a large model's first save is
        # estimated from its bytes) would stop the check before a step, as a stop of its own
        check.train.max_hours, check.optim.fit_to_time = 0.0, False
        result = train(check, log=lambda s: None)
        _stopped_early(result.stopped)
        metrics = result.run_dir / "metrics.jsonl"
        rows = [loads_json(x, f"{metrics} line {i}") for i, x in enumerate(read_text(metrics).splitlines(), 1)]
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        e2e = _check_checkpoint(result.run_dir, check, device)
        e2e.update(loss_first=losses[0], loss_last=losses[-1], finite=all(map(_finite, losses)),
                   falling=losses[-1] < losses[0],
                   recompiles=[r["message"] for r in rows if r.get("event") == "recompile"])
        log(f"preflight: end to end OK · loss {losses[0]:.4f} -> {losses[-1]:.4f} over 4 steps"
            f" ({'falling' if e2e['falling'] else 'NOT falling'}) · checkpoint round trip "
            f"{'identical' if e2e['checkpoint_identical'] else 'DIFFERENT'} · save {e2e['save_s']:.2f}s")
        return e2e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _scratch_name() -> Path:
    """A name for the end-to-end check's scratch directory, not yet made. Made by the caller inside
    its ``try``: ``tempfile.mkdtemp`` made it before returning, and a SIGTERM that came in between
    (its handler raises) left the directory behind with nothing holding its name."""
    while True:
        path = Path(tempfile.gettempdir()) / f"flopwise-preflight-{secrets.token_hex(6)}"
        if not path.exists():
            return path


def _stopped_early(stopped: str | None) -> None:
    """The end-to-end check's trainer stopped before its fourth step: a signal (the trainer
    handles it in its loop, saves and returns, train/stopping.py: "SIGTERM received") is an
    :class:`Interrupted`, as anywhere else in preflight; any other stop, a PreflightError."""
    if not stopped:
        return
    name = stopped.split(" ", 1)[0]
    if name in {s.name for s in STOP_SIGNALS}:
        raise Interrupted(signal.Signals[name])
    raise PreflightError(f"the end-to-end check stopped before its fourth step: {stopped}")


def search(cfg: RunConfig, measure_one: MeasureTrial, bench: Bench, request: TuneRequest,
           clock: Clock = time.perf_counter) -> list[Trial]:
    """The micro-batch search's trials, by the one search the ladder's micro-batch rung takes
    too (:func:`~flopwise.tune.choice.search`): from the configured micro-batch outward through
    the candidates without activation checkpointing, a direction stopping where tokens/s falls
    or a size does not fit, then with full checkpointing for the larger sizes that did not fit
    while it pays; a size the planner says cannot fit on ``bench`` is not run. ``measure_one``
    times a trial's configuration (:func:`remeasure` takes the same). The trials come back in
    the table's order: without checkpointing, then with, each by micro-batch."""
    sizes, log, first = candidates(cfg), request.log, cfg.train.micro_batch_size
    log(f"preflight: micro-batch search: from micro-batch {first} outward through {len(sizes)} sizes, a direction "
        "stopping where tokens/s falls or a size does not fit, then with activation checkpointing where a larger "
        f"one does not fit; each {request.warmup} warm-up + {request.windows} timed steps")
    trials: list[Trial] = []
    plain = len(set(sizes) | {first})  # every size is decided once without checkpointing, measured or not

    def planned(b: int, ckpt: str) -> float:
        return planned_gb(with_settings(cfg, {"train.micro_batch_size": b, "train.activation_checkpointing": ckpt}),
                          bench.device)

    def measure(b: int, ckpt: str) -> Trial:
        trial = Trial(b, ckpt, "ok", predicted_gb=planned(b, ckpt))
        if not bench.fits(cast(float, trial.predicted_gb)):
            trial.status = "no-fit"
            trial.note = f"planner: {trial.predicted_gb:.2f} GiB > {bench.headroom:.0%} of {bench.memory_gb:g} GiB"
        else:
            t0 = clock()
            _run_trial(trial, functools.partial(measure_one, trial), bench)
            trial.seconds = clock() - t0
        return trial

    def decided(trial: Trial, best_now: bool, why: str) -> None:
        if trial.predicted_gb is None:  # a size the search did not run: the table still gives its plan
            trial.predicted_gb = planned(trial.micro_batch, trial.checkpointing)
        trials.append(trial)
        count = sum(t.checkpointing == trial.checkpointing for t in trials)
        log(f"preflight: trial {count}{f'/{plain}' if trial.checkpointing == 'none' else ''} "
            f"{'without' if trial.checkpointing == 'none' else 'with'} checkpointing: " + _trial_line(trial))

    start = measure(first, "none")
    decided(start, start.status == "ok", "")
    search_sizes(start, sizes, measure, decided, bench.device.type)
    if not any(x.status == "ok" for x in trials):
        raise PreflightError("no micro-batch fits: " + "; ".join(
            f"{label(x)}: {x.status}" + (f" ({x.note[:120]})" if x.note else "") for x in trials))
    return sorted(trials, key=lambda t: (t.checkpointing != "none", t.micro_batch))


def _conclude(cfg: RunConfig, report: dict[str, Any], best: Trial, bench: Bench, request: TuneRequest) -> None:
    """After the choice: the measured ceiling, 4. data starvation, 5. the prediction; then the
    tuned configuration that ``flopwise train --config`` runs as is, and the report, written."""
    log = request.log
    world = (report.get("ladder") or {}).get("world", 1)  # ranks the chosen rate was measured on
    report["ceiling"] = ceiling(cfg, best, bench, log, world)
    native = cpu_native_bf16() if bench.device.type == "cpu" else None
    if native and resolve(cfg.train.precision, bench.device).name == "float32":
        report["native_bf16"] = native
        log(f"preflight: note: this CPU multiplies bf16 natively ({native}), which the float32 ceiling above does "
            "not use: --ladder measures train.precision=bf16 (kept only if its first loss agrees)")
    report["data_share"] = best.data_share
    if best.data_share is not None and best.data_share > STARVATION_WARN:
        remedies = (["data.loader=epoch (no random sampling)"] if cfg.data.loader == "random" else []) + [
            "a faster disk", "data.prefetch=1 (the next batch assembled ahead)"]
        log(f"preflight: WARNING: {100 * best.data_share:.1f}% of step time waits for data: try "
            f"{', '.join(remedies[:-1])} or {remedies[-1]}")
    tuned = _copy(cfg)
    tuned.train.micro_batch_size = best.micro_batch
    tuned.train.activation_checkpointing = cast(ActivationCheckpointing, best.checkpointing)  # a trial's own
    predict(report, cfg, tuned, best, bench, request)
    _write(request.out(cfg.preset), report, cfg, tuned, log)


def ceiling(cfg: RunConfig, best: Trial, bench: Bench, log: Log, world: int = 1) -> dict[str, Any]:
    """The measured GEMM ceiling of one device at the chosen micro-batch (``measure/ceiling.py``),
    and one device's model FLOP/s at the chosen rate (of ``world`` ranks) as a share of it: what
    is left to win outside the matmuls. A share above 1 cannot be: a step of more than matmuls
    ran faster than its matmuls alone, so the ceiling's timing or the trial's was disturbed
    (other work on the machine, a cold start). The ceiling -- seconds, where the trial's rate
    took the search -- is then measured once more (``remeasured``; the first in
    ``first_tflops`` and ``first_share_of_ceiling``). A share still above 1 is flagged
    (``disturbed``; the share seen is ``share_of_ceiling_measured``), not given as
    ``share_of_ceiling``, and the ceiling is not offered to plan with."""
    out = _ceiling_once(cfg, best, bench, world)
    out["remeasured"] = out["disturbed"]
    if out["disturbed"]:
        log(_ceiling_line(out, best, world) + " -- measuring it again")
        first = out
        out = {**_ceiling_once(cfg, best, bench, world), "remeasured": True, "first_tflops": first["tflops"],
               "first_share_of_ceiling": first["share_of_ceiling_measured"]}
    log(_ceiling_line(out, best, world))
    return out


def _ceiling_once(cfg: RunConfig, best: Trial, bench: Bench, world: int) -> dict[str, Any]:
    """One measurement of :func:`ceiling`'s figures, judged (``disturbed``), not logged."""
    device, fpt, peak = bench.device, bench.fpt, bench.peak
    prec = resolve(cfg.train.precision, device)
    c = measure_ceiling(step_gemms(cfg.model, best.micro_batch * cfg.train.seq_len), device,
                        prec.autocast_dtype or prec.param_dtype)
    achieved = best.tok_per_s * fpt / world if best.tok_per_s else None
    share = achieved / c.flops_per_s if achieved else None
    disturbed = share is not None and share > 1
    return {
        "tflops": c.flops_per_s / 1e12, "dtype": c.dtype, "micro_batch": best.micro_batch, "fpt": fpt,
        "gemm_seconds_per_micro_batch": c.seconds_per_step, "shapes": c.shapes,
        "datasheet_tflops": peak / 1e12 if peak else None,
        "ceiling_share_of_datasheet": c.flops_per_s / peak if peak else None,
        "mfu": best.mfu, "share_of_ceiling": None if disturbed else share, "share_of_ceiling_measured": share,
        "disturbed": disturbed}


def _ceiling_line(out: dict[str, Any], best: Trial, world: int) -> str:
    """What :func:`ceiling` says of one measurement: the share reached and the ceiling to plan
    with, or, disturbed, the share seen and that it is no result."""
    flops, share, peak = out["tflops"] * 1e12, out["share_of_ceiling_measured"], out["datasheet_tflops"]
    vs_sheet = (f": {100 * out['ceiling_share_of_datasheet']:.0f}% of the datasheet's {peak:g}"
                if peak else " (no datasheet peak here)")
    per_device = " per device" if world > 1 else ""
    again = " again" if out.get("first_tflops") is not None else ""
    head = (f"preflight: measured ceiling{again} {human(flops)}FLOP/s ({out['dtype']}) on this model's GEMMs at "
            f"micro-batch {best.micro_batch}{vs_sheet}")
    if out["disturbed"]:
        tail = ("disturbed again: not a result -- run preflight again on a quiet machine" if again else
                "a disturbed measurement (other work on this machine, a cold start), not a result")
        return (f"{head}; {label(best)} measured {100 * share:.0f}% of it{per_device}, above the ceiling: {tail}")
    mfu = f" (MFU {100 * best.mfu:.1f}% of the datasheet)" if best.mfu is not None else ""
    reached = f"; {label(best)} reaches {100 * share:.0f}% of it{per_device}{mfu}" if share is not None else ""
    return f"{head}{reached}; `flopwise plan --peak-tflops {flops / 1e12:.3g}` plans with it"


def trials_table(trials: list[Trial], best: Trial) -> list[str]:
    """The search's trials as printed after it: a row each, with its timed steps (re-measures included)."""
    out = [f"{'micro-batch':>11} {'ckpt':>5} {'status':>7} {'tok/s':>10} {'±':>6} {'steps':>5} {'MFU':>6}"
           f" {'peak GiB':>9} {'plan GiB':>9} {'data':>6}"]
    for x in trials:
        out.append(f"{x.micro_batch:>11} {x.checkpointing:>5} {x.status:>7} "
                   f"{human(x.tok_per_s) if x.tok_per_s else '-':>10} "
                   f"{f'{100 * x.spread:.1f}%' if x.spread is not None else '-':>6} "
                   f"{x.windows if x.windows else '-':>5} "
                   f"{f'{100 * x.mfu:.1f}%' if x.mfu is not None else 'n/a':>6} "
                   f"{f'{x.peak_gb:.2f}' if x.peak_gb is not None else 'n/a':>9} {x.predicted_gb:>9.2f} "
                   f"{f'{100 * x.data_share:.1f}%' if x.data_share is not None else '-':>6}"
                   f"{'  <- chosen' if x is best else ''}{'  ' + x.note if x.note else ''}")
    return out


def predict(report: dict[str, Any], cfg: RunConfig, tuned: RunConfig, best: Trial, bench: Bench,
            request: TuneRequest) -> None:
    """The full run -- ``request``'s tokens or hours, else the configuration's -- at the chosen
    trial's rate: tokens, time, cost, against the planner's 40% MFU of ``bench``'s peak."""
    tokens, price_per_gpu_hour, fpt, peak = request.tokens, request.price_per_gpu_hour, bench.fpt, bench.peak
    world = (report.get("ladder") or {}).get("world", 1)  # the launch measured: its rate is the N ranks' together
    hours = request.hours or (cfg.train.max_hours if not tokens else 0.0)  # a run bounded by train.max_hours
    tok_per_s = rate(best)
    run_tokens = tuned.total_steps() * tuned.tokens_per_step
    budget_tokens = tokens or (int(hours * 3600 * tok_per_s) if hours else run_tokens)
    if cfg.train.max_hours and budget_tokens / tok_per_s > cfg.train.max_hours * 3600:
        budget_tokens = int(cfg.train.max_hours * 3600 * tok_per_s)  # it will stop on time, with fewer tokens
        report["stops_at_max_hours"] = True
    # A batch-size ramp changes how tokens are grouped into steps, not the tokens per second of a
    # micro-batch, so the same rate carries the whole run.
    wall_s = budget_tokens / tok_per_s
    report["prediction"] = p = {
        # measured values, or None (n/a); memory falls back to the planner's estimate, and says so
        "tokens": budget_tokens, "tok_per_s": tok_per_s, "tok_per_s_spread": best.spread, "mfu": best.mfu,
        "memory_gb": best.peak_gb if best.peak_gb is not None else best.predicted_gb,
        "memory_basis": "measured" if best.peak_gb is not None else "assumed",
        "wall_time_s": wall_s, "hours": wall_s / 3600, "world": world,
        "cost": wall_s / 3600 * price_per_gpu_hour * world if price_per_gpu_hour else None,  # every GPU's hours
        "final_checkpoint_s": report["end_to_end"]["save_s"],
        "planner": {"mfu": 0.40, "hours": budget_tokens * fpt / (0.40 * peak * world) / 3600 if peak else None,
                    "note": bench.peak_note},
    }
    if tokens:
        tuned.train.max_tokens, tuned.train.max_steps = tokens, 0
    planned = f"planner at 40% MFU: {p['planner']['hours']:.2f} h" if p["planner"]["hours"] else "planner: no peak"
    cost = f" · ${p['cost']:,.0f}" if p["cost"] else ""
    ranks = f" on {world} ranks" if world > 1 else ""
    request.log(f"preflight: {human(budget_tokens)} tokens at {human(tok_per_s)} tok/s{ranks} = {p['hours']:.2f} h"
                f"{cost} · {planned} · final checkpoint ~{p['final_checkpoint_s']:.2f}s")
    p["epochs_warning"] = _epochs_warning(tuned, budget_tokens)
    if p["epochs_warning"]:
        request.log(f"preflight: warning: {p['epochs_warning']}")


def _epochs_warning(cfg: RunConfig, tokens: int) -> str | None:
    """The plan's warning (plan/budget.py's ``epochs_warning``) when the predicted tokens are more
    than a few passes over the run's train split; None when they are not or it cannot be read."""
    try:
        path = resolve_data_dir(cfg.data)
        return epochs_warning(tokens, DataDir(path).num_tokens("train"), str(path))
    except DataDirError:
        return None


def _write(out: Path, report: dict[str, Any], cfg: RunConfig, tuned: RunConfig, log: Log) -> None:
    """preflight.json and preflight.yaml, each replaced whole (an earlier preflight's stay intact
    until then), and the command that runs the tuned configuration as it was measured.
    preflight.yaml is written for a later command, from wherever it is run: its paths are
    resolved as a run's config.yaml holds them (``config.recorded_paths``; what was typed is
    ``paths`` in preflight.json), and so is the path in the command printed."""
    out = out.resolve()
    tuned.train.run_dir = ""
    tuned.train.preflight = str(out / "preflight.json")
    tuned, report["paths"] = recorded_paths(tuned)
    write_json(out / "preflight.json", report, "preflight report")
    data = tuned.to_dict()
    write_file(out / "preflight.yaml", yaml.safe_dump({"preset": cfg.preset, **data}, sort_keys=False),
               "tuned configuration")
    world = (report.get("ladder") or {}).get("world", 1)
    launch = launch_command(world)
    log(f"preflight: wrote {out / 'preflight.json'} and {out / 'preflight.yaml'} "
        f"({launch} --config {shlex.quote(str(out / 'preflight.yaml'))})")


def _run_trial(trial: Trial, run: Callable[[], dict[str, Any]], bench: Bench) -> None:
    """Time one trial into ``trial``, or time it again (:func:`remeasure`): the windows are added
    to its samples, its median and spread are those of all of them, its peak memory the
    highest seen, judged against ``bench`` (MFU, fit); an out-of-memory (or any error) is a result, named."""
    again = bool(trial.rates)
    try:
        m = run()
    except Exception as e:
        trial.status = failure_status(e)
        trial.note = ("re-measure: " if again else "") + str(e).splitlines()[0][:200]
        return
    rates = m.get("tok_per_s_windows") or [m["tok_per_s"]]
    share = m["data_share"]
    if again:  # the data share over all the windows; the highest peak
        share = None if share is None or trial.data_share is None else (
            (trial.data_share * len(trial.rates) + share * len(rates)) / (len(trial.rates) + len(rates)))
        peaks = [x for x in (trial.peak_gb, m["peak_gb"]) if x is not None]
        trial.peak_gb = max(peaks) if peaks else None
    else:
        trial.peak_gb = m["peak_gb"]
    trial.rates = trial.rates + list(rates)
    trial.tok_per_s = median(trial.rates) if again else m["tok_per_s"]
    trial.spread, trial.windows, trial.data_share = median_spread(trial.rates), len(trial.rates), share
    trial.mfu = bench.mfu(trial.tok_per_s)
    if trial.peak_gb is not None and not bench.fits(trial.peak_gb):
        trial.status, trial.note = "no-fit", f"measured {trial.peak_gb:.2f} GiB > {bench.headroom:.0%} headroom"


def _trial_line(t: Trial) -> str:
    """One finished trial, as printed while the search runs."""
    head = f"micro-batch {t.micro_batch} · "
    if t.tok_per_s is None:
        return head + f"{t.status}: {t.note}"
    sp = f" ± {100 * t.spread:.1f}%" if t.spread is not None else ""
    mfu = f"{100 * t.mfu:.1f}%" if t.mfu is not None else "n/a"
    mem = f"{t.peak_gb:.2f} GiB" if t.peak_gb is not None else "n/a"
    tail = f" · {t.status}: {t.note}" if t.status != "ok" else ""
    return (head + f"{human(t.tok_per_s)} tok/s{sp} (median of {t.windows}) · MFU {mfu} · peak {mem} "
            f"(plan {t.predicted_gb:.2f} GiB){tail}")


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _copy(cfg: RunConfig) -> RunConfig:
    return copy.deepcopy(cfg)


def _check_checkpoint(run_dir: Path, cfg: RunConfig, device: torch.device) -> dict[str, Any]:
    """Load the scratch run's last checkpoint into a fresh model: every tensor must come back."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, f"the scratch run in {run_dir} saved no checkpoint"
    model = build_model(cfg.model, device=device, seed=cfg.train.seed + 1)
    load_checkpoint(ckpt, model, map_location=device)
    saved = torch.load(ckpt / "model.pt", map_location=device, weights_only=True)
    identical = all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    t0 = time.perf_counter()
    save_checkpoint(run_dir, 10**6, model, None, {}, "", rng=None)  # the weights alone...
    # ... a full checkpoint also holds AdamW's two moments: about three times the bytes.
    return {"checkpoint_identical": identical, "save_s": 3 * (time.perf_counter() - t0)}

