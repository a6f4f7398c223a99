"""Preflight trials in fresh processes (tune/trial.py): one process for an isolated trial,
2 gloo processes for an N-rank one -- real spawned processes, a tiny model on CPU."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flopwise.config import build_config
from flopwise.data.datadir import open_data_dir
from flopwise.tune import trial as trial_mod
from flopwise.tune.trial import TrialError, TrialSpec, measure, measure_in_processes, ready_processes

CPU = torch.device("cpu")


@pytest.fixture
def cfg(tiny_overrides):
    c = build_config(overrides=tiny_overrides + ["train.compile=off", "train.threads=1", "data.loader=epoch",
                                                 "train.global_batch_size=32"])
    open_data_dir(c.data, log=lambda s: None)  # the embedded corpus prepared once, before the ranks open it
    return c


def test_a_trial_in_a_fresh_process_measures_what_the_same_trial_here_does(cfg):
    here = measure(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU)
    there = measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU)
    assert there["world"] == 1 and there["strategy"] == "single" and len(there["tok_per_s_windows"]) == 3
    assert there["first_loss"] == pytest.approx(here["first_loss"], rel=1e-6), (there["first_loss"], here["first_loss"])
    json.dumps(there)  # it came back as JSON, and is one


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp2"])
def test_a_two_rank_trial_trains_on_the_same_global_batch_as_one_rank(cfg, strategy):
    """The epoch loader gives the 2 ranks disjoint halves of the one-rank run's global batch,
    so the ranks' mean first-step loss is the one-rank loss: the N-rank rung measures the same
    training, under each strategy, as its numerics check assumes."""
    cfg.parallel.strategy = strategy
    one = measure(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU)
    two = measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU, world=2)
    assert two["world"] == 2 and two["strategy"] == strategy
    rel = abs(two["first_loss"] - one["first_loss"]) / abs(one["first_loss"])
    assert rel < 1e-5, f"2 ranks {two['first_loss']!r} vs 1 rank {one['first_loss']!r}: {rel:.2e} relative"
    assert two["tok_per_s"] > 0


@pytest.mark.slow
def test_auto_resolves_in_the_ranks_as_the_trainer_would(cfg):
    cfg.parallel.strategy = "auto"
    two = measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU, world=2)
    assert two["strategy"] == "ddp"  # CPU ranks: no memory limit to plan against


def test_a_failing_trial_says_why_in_one_line(cfg, tmp_path):
    cfg.data.path = str(tmp_path / "no-such-data")
    with pytest.raises(TrialError) as err:
        measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU, world=2)
    message = str(err.value)  # the ranks' exception, not the spawn machinery's report around it
    assert "\n" not in message and "Traceback" not in message and "no-such-data" in message, message


def test_a_trial_past_its_time_is_stopped_and_leaves_no_process(cfg):
    import multiprocessing

    with pytest.raises(TrialError, match=r"stopped after 3 s: the time budget ran out"):
        measure_in_processes(cfg, TrialSpec(8, "none", warmup=100_000, steps=3), CPU, world=2, timeout_s=3)
    assert multiprocessing.active_children() == []


def test_a_one_rank_trial_that_fails_or_runs_past_its_time_says_so_and_leaves_no_process(cfg, tmp_path):
    import multiprocessing

    bad = build_config(overrides=[f"data.path={tmp_path / 'no-such-data'}", "train.compile=off"])
    with pytest.raises(TrialError) as err:
        measure_in_processes(bad, TrialSpec(8, "none", warmup=1, steps=3), CPU)
    assert "\n" not in str(err.value) and "no-such-data" in str(err.value), str(err.value)
    with pytest.raises(TrialError, match=r"stopped after 3 s: the time budget ran out"):
        measure_in_processes(cfg, TrialSpec(8, "none", warmup=100_000, steps=3), CPU, timeout_s=3)
    assert multiprocessing.active_children() == []


def test_the_next_trials_process_is_made_ready_while_one_runs_and_closed_at_the_end(cfg):
    """Inside ready_processes each one-rank trial starts the next one's process, which imports
    while the trial runs and then runs nothing until its own trial: the same measurement, and
    nothing left running after."""
    import multiprocessing

    here = measure(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU)
    with ready_processes():
        first = measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU)
        waiting = [p.proc.pid for p in trial_mod._ready]
        assert len(waiting) == 1 and multiprocessing.active_children()  # the next one, already started
        second = measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CPU)
        assert waiting[0] not in [p.proc.pid for p in trial_mod._ready]  # the second trial ran in it
    for there in (first, second):
        assert there["first_loss"] == pytest.approx(here["first_loss"], rel=1e-6)
    assert trial_mod._ready == [] and multiprocessing.active_children() == []


PREFLIGHT = """
import sys, torch
from flopwise.config import build_config
from flopwise.tune.trial import TrialSpec, measure_in_processes
cfg = build_config(overrides=sys.argv[2:])
measure_in_processes(cfg, TrialSpec(8, "none", warmup=100_000, steps=3), torch.device("cpu"), world=int(sys.argv[1]))
"""


def _marked(mark: str) -> dict[int, tuple[int, str]]:
    """``{pid: (ppid, cmdline)}`` of the live processes whose environment holds ``mark``."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or mark.encode() not in (entry / "environ").read_bytes():
                continue
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] not in "ZX":
                found[int(entry.name)] = (int(stat[1]), (entry / "cmdline").read_bytes().decode(errors="replace"))
        except OSError:
            continue
    return found


def _wait_until(condition, what: str, limit_s: float = 120.0) -> None:
    """A guard against a hang, not a timing check: ``condition`` is polled until it holds."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the trial's processes in /proc")
@pytest.mark.parametrize("world", [1, 2])
def test_a_killed_preflight_takes_its_trial_processes_and_forkserver_with_it(cfg, tiny_overrides, world, short_tmp):
    """kill -9 of the preflight mid-trial: the trial's processes (forked by the forkserver, so
    not the preflight's children: prctl's death signal cannot reach them) end, and then the
    forkserver, whose pipe they held open; the trial's temporary directory, which the killed
    preflight could not remove, goes with them."""
    mark = f"flopwise-trial-test-{os.getpid()}-{world}"
    overrides = tiny_overrides + ["train.compile=off", "train.threads=1", "data.loader=epoch", "train.global_batch_size=32"]
    preflight = subprocess.Popen([sys.executable, "-c", PREFLIGHT, str(world), *overrides],
                                 env={**os.environ, "FLOPWISE_TEST_MARK": mark, "TMPDIR": str(short_tmp)})
    try:
        def trials() -> list[int]:
            procs = _marked(mark)
            servers = [pid for pid, (ppid, cmd) in procs.items() if ppid == preflight.pid and "forkserver" in cmd]
            return [pid for pid, (ppid, _) in procs.items() if ppid in servers]

        _wait_until(lambda: len(trials()) == world or preflight.poll() is not None, "the trial never started")
        assert preflight.poll() is None, f"the preflight ended first: exit {preflight.returncode}"
        started = trials()
        preflight.kill()
        preflight.wait()
        _wait_until(lambda: not _marked(mark), "left running after the preflight was killed (the trial's were "
                    f"{started}): " + "; ".join(f"{pid} {cmd[:70]!r}" for pid, (_, cmd) in _marked(mark).items()))
        # and the trial's directory, which the killed preflight could not remove, went with them
        assert sorted(p.name for p in short_tmp.glob("flopwise-trial-*")) == []
    finally:
        if preflight.poll() is None:
            preflight.kill()
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
