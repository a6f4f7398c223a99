"""Issue 44, items 8 and 12: preflight under real signals, and its bad input refused in one line.

A SIGTERM or SIGINT sent to a real ``flopwise preflight`` process -- as its end-to-end check
starts, while that check trains, while a ladder trial runs in a process of its own -- stops it
with 128 + the signal's number (143, 130) and leaves none of its scratch run or trial
directories behind (``TMPDIR`` is the test's own, so everything it made there is seen). Each
signal is sent once a marker of the phase exists on disk, never after a fixed sleep.
``--headroom`` out of (0, 1] and a device on which no micro-batch fits are refused before any
trial, in one line, exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flopwise.cli import main as cli_main
from flopwise.cli import user_error
from flopwise.config import build_config
from flopwise.errors import FlopwiseError
from flopwise.tune.preflight import end_to_end, preflight
from flopwise.tune.request import TuneHooks, TuneRequest

WAIT_S = 600.0  # a generous bound on waiting for a phase's marker or the process's end (a loaded machine)


class Preflight:
    """A real ``python -m flopwise preflight`` with its own TMPDIR, stdout and stderr in files."""

    def __init__(self, tmp_path: Path, args: list[str], tmp: Path):
        self.tmp = tmp
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        env = {**os.environ, "TMPDIR": str(self.tmp), "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "flopwise", "preflight", *args], stdout=out,
                                         stderr=err, env=env, cwd=tmp_path)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, ready, what: str) -> None:
        """Until ``ready()``; fails if the process ends first, or after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"preflight ended (exit {self.proc.returncode}) before {what}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} after {WAIT_S:.0f} s:\n{self.text()[-3000:]}")
            time.sleep(0.005)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def left_behind(self) -> list[str]:
        return sorted(p.name for p in self.tmp.glob("flopwise-*"))


def _scratch_runs(tmp: Path) -> list[Path]:
    return list(tmp.glob("flopwise-preflight-*"))


def _training(tmp: Path) -> bool:
    """The end-to-end check's loop has logged a step (its metrics are written a row at a time)."""
    for metrics in tmp.glob("flopwise-preflight-*/run/metrics.jsonl"):
        try:
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
        except (OSError, ValueError):
            continue
        if any(r.get("loss") is not None for r in rows):
            return True
    return False


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (the forkserver and the trial processes it forked), from /proc."""
    parents = {int(e.name): _parent(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found.update(kids)
        todo += kids
    return found


def _forked(pid: int) -> bool:
    """Whether a process below one of ``pid``'s children runs now (a trial the forkserver forked)."""
    return any(_parent(p) not in (pid, None) for p in _descendants(pid))


def _parent(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# A global batch of 256 sequences (32 micro-batches of 8): each of the end-to-end check's four
# steps takes long enough that a signal sent once its first step is logged lands inside the loop.
SLOW_STEPS = ["train.global_batch_size=256", "train.compile=off", "--warmup", "1", "--steps", "1",
              "--budget-minutes", "1"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_end_to_end_check_stops_preflight_and_removes_its_scratch_run(tiny_overrides, tmp_path,
                                                                                         short_tmp, signum):
    run = Preflight(tmp_path, [*tiny_overrides, *SLOW_STEPS, "--out", str(tmp_path / "pf")], short_tmp)
    run.wait_for(lambda: _training(run.tmp), "end-to-end step logged")
    run.proc.send_signal(signum)
    rc = run.finish()
    assert rc == 128 + signum, f"exit {rc}:\n{run.text()[-3000:]}"
    assert signal.Signals(signum).name in run.err.read_text(), run.text()[-3000:]
    assert "Traceback" not in run.text()
    assert run.left_behind() == [], run.text()[-3000:]
    assert "micro-batch search" not in run.text()  # stopped: no trial after the signal
    assert not (tmp_path / "pf" / "preflight.json").exists()


def test_a_sigterm_as_the_end_to_end_check_starts_leaves_no_scratch_run(tiny_overrides, tmp_path, short_tmp):
    """The scratch directory exists, the run in it is being set up (the trainer's own signal
    handling not yet in place): the default SIGTERM would end the process there, leaving it."""
    run = Preflight(tmp_path, [*tiny_overrides, *SLOW_STEPS, "--out", str(tmp_path / "pf")], short_tmp)
    run.wait_for(lambda: bool(_scratch_runs(run.tmp)), "scratch run directory")
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish()
    assert rc == 128 + signal.SIGTERM, f"exit {rc}:\n{run.text()[-3000:]}"
    assert run.left_behind() == [], run.text()[-3000:]


@pytest.mark.slow
def test_a_sigterm_during_a_ladder_trial_in_its_own_process_ends_it_and_its_directory(tiny_overrides, tmp_path,
                                                                                      short_tmp):
    run = Preflight(tmp_path, [*tiny_overrides, "train.compile=off", "--ladder", "--isolation", "process",
                               "--warmup", "1", "--steps", "1", "--out", str(tmp_path / "pf")], short_tmp)
    # The trial's directory is made before its forkserver starts, so wait for both: the
    # directory, and a process two levels below preflight (one the forkserver forked).
    run.wait_for(lambda: bool(list(run.tmp.glob("flopwise-trial-*"))) and _forked(run.proc.pid),
                 "trial directory and a trial process")
    trial_processes = _descendants(run.proc.pid)
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish()
    assert rc == 128 + signal.SIGTERM, f"exit {rc}:\n{run.text()[-3000:]}"
    assert run.left_behind() == [], run.text()[-3000:]
    deadline = time.monotonic() + WAIT_S  # they end with preflight (trial.die_with): a pidfd, not a poll
    while any(map(_alive, trial_processes)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [p for p in trial_processes if _alive(p)], "trial processes outlived preflight"


def test_a_temporary_directory_too_long_for_the_forkservers_socket_is_one_line_naming_it(tiny_overrides, tmp_path):
    """A Unix socket's path holds at most 107 bytes, and the trials' forkserver makes one under
    TMPDIR: a longer TMPDIR was an OSError traceback from multiprocessing. (Since issue 54, item 14,
    the socket goes under /tmp where TMPDIR is too long: here that way out is closed, as on a
    machine without a writable /tmp, to see the one line; test_fourth_list_preflight runs it.)"""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    no_way_out = ("import sys; import flopwise.tune.trial as t; t._short_socket_dir = lambda: None; "
                  "from flopwise.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", no_way_out, "preflight", *tiny_overrides, "train.compile=off",
                          "--ladder", "--isolation", "process", "--warmup", "1", "--steps", "1",
                          "--out", str(tmp_path / "pf")], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "TMPDIR": str(deep), "CUDA_VISIBLE_DEVICES": ""}, timeout=WAIT_S)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "set TMPDIR to a shorter directory" in out.stderr and str(deep) in out.stderr, out.stderr[-3000:]


# --------------------------------------------------------------------------- item 12: bad input, one line


def _no_work(*args, **kwargs):
    raise AssertionError("preflight started its end-to-end check: the input should have been refused first")


def _cli(args: list[str], capsys) -> tuple[int, str]:
    """``flopwise ARGS`` in this process: its exit status and stderr (an argparse refusal included)."""
    try:
        rc = cli_main(args)
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("headroom", ["nan", "inf", "-0.5", "0", "1.5"])
def test_headroom_outside_zero_to_one_is_refused_before_any_work(tiny_overrides, tmp_path, monkeypatch, capsys,
                                                                  headroom):
    monkeypatch.setattr("flopwise.tune.preflight.end_to_end", _no_work)
    rc, err = _cli(["preflight", *tiny_overrides, "--memory-gb", "1", "--headroom", headroom,
                    "--out", str(tmp_path / "pf")], capsys)
    assert rc == 2, err
    assert "--headroom" in err and headroom in err and "Traceback" not in err, err
    assert not (tmp_path / "pf").exists()


def test_a_device_on_which_no_micro_batch_fits_is_refused_in_one_line_before_any_trial(tiny_overrides, tmp_path,
                                                                                       monkeypatch, capsys):
    monkeypatch.setattr("flopwise.tune.preflight.end_to_end", _no_work)
    rc, err = _cli(["preflight", *tiny_overrides, "--memory-gb", "0.0001", "--out", str(tmp_path / "pf")], capsys)
    assert rc == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("flopwise preflight: no micro-batch fits"), err
    assert "--memory-gb 0.0001" in lines[0] and "activation checkpointing" in lines[0], err


def test_every_trial_out_of_memory_is_a_clear_error_not_a_traceback(tiny_overrides, tmp_path, monkeypatch):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=100", "train.compile=off"])
    monkeypatch.setattr("flopwise.tune.preflight.end_to_end", lambda *a: {"recompiles": [], "save_s": 0.0})

    def out_of_memory(cfg, spec, device):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(FlopwiseError) as e:
        preflight(cfg, TuneRequest(out_dir=tmp_path / "pf", log=lambda s: None), TuneHooks(measure_fn=out_of_memory))
    line = user_error(e.value)  # what the command line prints, exit 2
    assert line is not None and line.startswith("no micro-batch fits"), line
    assert "micro-batch 1 without checkpointing: oom" in line and "\n" not in line, line


def test_the_end_to_end_check_takes_its_four_steps_whatever_the_runs_time_budget(tiny_overrides):
    """The run's train.max_hours is the run's: under it the check's trainer stopped before its
    first step (a deadline shorter than a step and a save), and the check read no loss."""
    import torch

    cfg = build_config(overrides=tiny_overrides + ["train.max_hours=1e-7", "train.compile=off"])
    e2e = end_to_end(cfg, torch.device("cpu"), lambda s: None)
    assert e2e["finite"] and e2e["checkpoint_identical"]
