"""Issue 44's dry-run items: the tracing worker imports nothing from the current directory
(item 4), dies with the dry run and leaves no temporary directory behind (item 7), the shim
cache says what is wrong with it and rebuilds a damaged library (item 14), the figures say
what the search did not try and the dry run refuses what the run refuses (item 16), and an
empty ``--gpu`` is an error, not an H100.

The commands run as a user runs them: the ``flopwise`` console script in a subprocess, in a
directory of the test's own. A signal is a real one, to the real dry run, while its worker is
held (a ``sitecustomize`` on PYTHONPATH that, in the process with the fake-CUDA shim preloaded,
waits before torch is imported until the test releases it), and each wait is on a condition
in a bounded loop."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flopwise.tune.shim import DryRunUnavailable, compiler, ensure_shim, shim_path, torch_install

FLOPWISE = str(Path(sys.executable).with_name("flopwise"))  # the console script: sys.path[0] is its bin/
TINY = ["--preset", "tiny", "train.seq_len=128", "train.compile=off"]
WAIT_S = 600  # generous: a loaded 2-core machine imports torch in tens of seconds
GONE_S = 120  # for what follows a signal at once: a process ending, a directory removed


@pytest.fixture(scope="module")
def shim() -> Path:
    if compiler() is None:
        pytest.skip("no C++ compiler: the dry run's shim cannot be built (install g++)")
    return ensure_shim()


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    (tmp / "tmpdir").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "tmpdir"), "PYTHONUNBUFFERED": "1", **extra}


def _wait_for(condition, what: str, timeout_s: float = WAIT_S):
    """``condition()``'s first true value, polled; fails saying ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"waited {timeout_s:.0f} s for {what}")


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaped has ended too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


# --------------------------------------------------------------------------- item 4 and 16

PLANTED = """
import os, pathlib
pathlib.Path({marker!r}).write_text(__file__)
"""


def _plant(cwd: Path, marker: Path) -> None:
    """A ``flopwise`` package and a ``torch`` one in ``cwd`` whose import writes ``marker``."""
    for pkg in ("flopwise", "flopwise/tune", "torch"):
        (cwd / pkg).mkdir(parents=True)
        (cwd / pkg / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    (cwd / "flopwise" / "tune" / "worker.py").write_text(PLANTED.format(marker=str(marker)))
    (cwd / "flopwise" / "__main__.py").write_text(PLANTED.format(marker=str(marker)))


def _result(fit: dict) -> dict:
    """A dry run's result, as :func:`render` reads it, around ``fit``."""
    memory = {"peak_gib": 0.27, "by_kind_gib": {"parameters": 0.01}}
    flops = {"matmul": 1, "matmul_expected": 1, "attention": 1, "attention_model": 1, "recompute_fraction": 0,
             "per_step_scale": 1}
    return {"request": {"world": 1, "gpu": {"memory_bytes": 80 * 2**30, "spec": "H100 SXM"}, "nproc_per_node": 1,
                        "nnodes": 1, "headroom": 0.9},
            "trace": {"eager_memory": memory, "traced_accum": 2, "syncs": [], "flops": flops, "collectives": {}},
            "torch": "2.13", "strategy": "single", "precision": "bf16", "compile": "off", "loss": "plain",
            "micro_batch": 16, "accum": 2, "seq_len": 128, "plan": {"total": 0.29}, "fit": fit}


def test_the_fit_search_says_when_it_stopped_at_its_cap():
    """Every size the search traces fits (the tiny model on an H100): it stops at its cap,
    which is then no largest micro-batch."""
    from flopwise.tune.dryrun import render
    from flopwise.tune.worker import largest_fit

    fit = largest_fit({"micro_batch": 16, "memory": {"peak_gib": 0.27}}, cap=72 * 2**30, limit=1024,
                      peak=lambda b: 0.25 * 2**30 + b * 2**20)
    line = [ln for ln in render(_result(fit)) if ln.strip().startswith("fits")][0]
    assert "cap of 1024" in line and "larger not tried" in line and "largest" not in line, line
    assert fit["micro_batch"] == 1024 and fit["capped"] and not fit["confirmed"], fit


@pytest.fixture(scope="module")
def dry_run_in_planted_dir(shim, tmp_path_factory):
    """``flopwise preflight --dry-run`` of the tiny model on an H100 (a micro-batch of 1024
    fits: the search's cap), run where the current directory holds a planted ``flopwise/``."""
    tmp = tmp_path_factory.mktemp("planted")
    cwd, marker = tmp / "cwd", tmp / "imported-from-cwd"
    _plant(cwd, marker)
    done = subprocess.run([FLOPWISE, "preflight", "--dry-run", "--gpu", "h100", *TINY], cwd=cwd,
                          env=_env(tmp), capture_output=True, text=True, timeout=1800)
    return done, marker, tmp


def test_dry_run_worker_never_imports_from_the_current_directory(dry_run_in_planted_dir):
    done, marker, tmp = dry_run_in_planted_dir
    assert not marker.exists(), f"the dry run imported {marker.read_text()} from the current directory"
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((tmp / "tmpdir").iterdir()), "the dry run left its temporary directory behind"


def test_fit_at_the_search_cap_is_not_reported_as_the_largest(dry_run_in_planted_dir):
    done, _, _ = dry_run_in_planted_dir
    assert done.returncode == 0, done.stderr[-3000:]
    fits = [ln for ln in done.stdout.splitlines() if ln.strip().startswith("fits")]
    assert len(fits) == 1, done.stdout
    assert "cap of 1024" in fits[0] and "larger not tried" in fits[0], fits[0]
    assert "largest micro-batch by trace" not in fits[0], fits[0]


def test_dry_run_refuses_diloco_fragments_the_run_refuses(shim, tmp_path):
    """The real run's DiLoCo cuts the parameters into ``parallel.fragments`` runs of tensors
    and refuses more fragments than tensors: the dry run says the same, as a config error."""
    done = subprocess.run([FLOPWISE, "preflight", "--dry-run", "--gpu", "h100", "--nproc-per-node", "2", *TINY,
                           "train.global_batch_size=64", "parallel.strategy=diloco", "parallel.inner_steps=100",
                           "parallel.fragments=100"],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=1800)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert err == ["flopwise preflight: invalid configuration (1 problem(s)):",  # as train says it
                   "  - parallel.fragments=100 but the model has 26 parameter tensors"], err


@pytest.mark.parametrize("command", [["preflight", "--dry-run", "--preset", "tiny"], ["plan", "--model", "tiny"]])
def test_empty_gpu_name_is_an_error_listing_the_known_names(command, capsys):
    from flopwise.cli import main

    assert main([*command, "--gpu", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu ''" in err[0] and "H100 SXM" in err[0] and "A100" in err[0], err


# --------------------------------------------------------------------------- item 7

HOLD = """
import os, sys, time, pathlib
if "fake_cuda_guard" in os.environ.get("LD_PRELOAD", ""):  # the dry run's tracing process only
    class _Hold:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                here = pathlib.Path({hold!r})
                (here / f"held-{{os.getpid()}}").write_text("")
                deadline = time.monotonic() + 600
                while not (here / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            return None
    sys.meta_path.insert(0, _Hold())
"""


def _start_held_dry_run(tmp: Path, command: list[str], hold_in: str = "hold") -> tuple[subprocess.Popen, int, Path]:
    """The dry run started, and its worker held before it imports torch: (the dry run, the
    worker's pid, the dry run's temporary directory, the only one there)."""
    hold = tmp / hold_in
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD.format(hold=str(hold)))
    env = _env(tmp, PYTHONPATH=os.pathsep.join(filter(None, [str(hold), os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.Popen([FLOPWISE, *command], cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    held = _wait_for(lambda: list(hold.glob("held-*")) or proc.poll() is not None, "the tracing process")
    assert proc.poll() is None, f"the dry run ended before its worker was held: {proc.stderr.read()[-2000:]}"
    worker = int(held[0].name.split("-")[1])
    dirs = list((tmp / "tmpdir").glob("flopwise-dryrun-*"))
    assert len(dirs) == 1, f"{dirs}: another dry run's directory is left"
    return proc, worker, dirs[0]


def _release_and_kill(tmp: Path, *pids: int, hold_in: str = "hold") -> None:
    (tmp / hold_in / "release").write_text("")
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("command", [["preflight", "--dry-run", "--gpu", "l4", *TINY],
                                     ["plan", "--model", "tiny", "--gpu", "l4", "--seq-len", "128", "--trace"]])
def test_sigterm_ends_the_dry_run_with_its_worker_and_temporary_directory(shim, tmp_path, command):
    proc, worker, tmp = _start_held_dry_run(tmp_path, command)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=WAIT_S)
        _wait_for(lambda: _gone(worker), f"the tracing process {worker} to end with the dry run", GONE_S)
        _wait_for(lambda: not tmp.exists(), f"{tmp} to be removed", GONE_S)
        assert code == 128 + signal.SIGTERM, (code, proc.stderr.read()[-2000:])
    finally:
        _release_and_kill(tmp_path, proc.pid, worker)


def test_sigkill_ends_the_worker_which_removes_the_temporary_directory(shim, tmp_path):
    proc, worker, tmp = _start_held_dry_run(tmp_path, ["preflight", "--dry-run", "--gpu", "l4", *TINY])
    try:
        proc.kill()
        proc.wait(timeout=WAIT_S)
        _wait_for(lambda: _gone(worker), f"the tracing process {worker} to end with the dry run", GONE_S)
        _wait_for(lambda: not tmp.exists(), f"{tmp} to be removed", GONE_S)
    finally:
        _release_and_kill(tmp_path, proc.pid, worker)


def test_the_next_dry_run_removes_what_a_dry_run_killed_with_its_worker_left(shim, tmp_path):
    command = ["preflight", "--dry-run", "--gpu", "l4", *TINY]
    proc, worker, tmp = _start_held_dry_run(tmp_path, command)
    try:  # both killed, the dry run first stopped so that it cannot clean up when its worker dies
        proc.send_signal(signal.SIGSTOP)
        os.kill(worker, signal.SIGKILL)
        _wait_for(lambda: _gone(worker), f"the tracing process {worker} to end", GONE_S)
        proc.kill()
        proc.wait(timeout=WAIT_S)
        assert tmp.is_dir(), "nothing should have removed it yet"
    finally:
        _release_and_kill(tmp_path, proc.pid, worker)
    proc, worker, mine = _start_held_dry_run(tmp_path, command, hold_in="hold-next")  # one directory: its own
    try:
        assert not tmp.exists() and mine.is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
        _release_and_kill(tmp_path, proc.pid, worker, hold_in="hold-next")


# --------------------------------------------------------------------------- item 14

FAKE_CXX = """#!{python}
import pathlib, sys
calls = pathlib.Path({calls!r})
calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
out = sys.argv[sys.argv.index("-o") + 1]
if {writes}:
    pathlib.Path(out).write_bytes(b"\\x7fELF" + b"fake shim library" * 64)
"""


def _fake_compiler(tmp: Path, monkeypatch, writes: bool = True) -> Path:
    """$CXX: a script that writes a stand-in library (or, ``writes=False``, nothing) and counts its calls."""
    cxx, calls = tmp / "fake-cxx", tmp / "calls"
    cxx.write_text(FAKE_CXX.format(python=sys.executable, calls=str(calls), writes=writes))
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    return calls


def test_a_damaged_cached_library_is_rebuilt(tmp_path, monkeypatch):
    calls = _fake_compiler(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    built = ensure_shim(cache=cache)
    good = built.read_bytes()
    built.write_bytes(good[: len(good) // 2])  # cut short, as a full disk or a killed copy leaves it
    assert ensure_shim(cache=cache) == built
    assert built.read_bytes() == good and calls.read_text() == "xx"
    assert ensure_shim(cache=cache) == built and calls.read_text() == "xx"  # intact: used as it is


def test_a_file_where_the_cache_directory_should_be_is_one_line_naming_it(tmp_path, monkeypatch):
    _fake_compiler(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    with pytest.raises(DryRunUnavailable, match=f"{re.escape(str(cache))} is not a directory"):
        ensure_shim(cache=cache)


def test_a_directory_where_the_library_should_be_is_one_line_naming_it(tmp_path, monkeypatch):
    _fake_compiler(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    where = shim_path(torch_install(), cache)
    where.mkdir(parents=True)
    with pytest.raises(DryRunUnavailable, match=f"{re.escape(str(where))} is a directory"):
        ensure_shim(cache=cache)


def test_a_compiler_that_writes_nothing_is_one_line_naming_it(tmp_path, monkeypatch):
    _fake_compiler(tmp_path, monkeypatch, writes=False)
    with pytest.raises(DryRunUnavailable, match="fake-cxx.*wrote no library"):
        ensure_shim(cache=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.so")), "nothing is left where the library goes"



# --------------------------------------------------------------------------- item 4: the other processes

TRIAL_PROCESS_IN = """
import os, sys
from flopwise.tune import trial
os.chdir(sys.argv[1])  # where preflight runs: its trial processes fork from a forkserver started now
process = trial._Process()
process.close()
print("exit code", process.proc.exitcode)
"""


def test_preflight_trial_processes_never_import_from_the_current_directory(tmp_path):
    """Preflight's trials fork from a forkserver, a ``python -c`` process (the current directory
    first on its sys.path) that imports torch before anything else; a ``torch/`` or
    ``multiprocessing/`` folder where preflight runs must not be what it imports."""
    cwd, marker = tmp_path / "cwd", tmp_path / "imported-from-cwd"
    _plant(cwd, marker)
    (cwd / "multiprocessing").mkdir()
    (cwd / "multiprocessing" / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # Python 3.11+'s switch: not relied on
    done = subprocess.run([sys.executable, "-c", TRIAL_PROCESS_IN, str(cwd)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=WAIT_S, env=env)
    assert not marker.exists(), f"a trial's process imported {marker.read_text()} from the current directory"
    assert done.returncode == 0 and "exit code 0" in done.stdout, done.stderr[-3000:]
