"""Shared fixtures: a small prepared slice of the embedded corpus, made once per session,
the command line as a user runs it, and a real small filesystem to fill. Comparisons the
tests share (weights relative to their norm, logged gradient norms) are in helpers.py.

``pytest -m "not slow"`` is the fast lane (under two minutes on 2 cores); ``pytest`` runs
everything but the on-request lane, the end-to-end runs marked ``slow`` included; ``pytest -m
extended`` runs the on-request lane: tests marked ``extended`` repeat, at more cost, a
configuration the default lane already covers (each says which), and are deselected unless the
``-m`` expression names ``extended``."""

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import run_flopwise, tiny_model_overrides

# One intra-op thread in the test process and, through the environment, in every CLI and
# torchrun child, unless the caller set OMP_NUM_THREADS: the tests' tiny tensors gain
# nothing from a second thread, and on a loaded 2-core machine OpenMP's barriers make each
# op wait for a free core (the fast lane took 394 s with 2 threads, 86 s with 1, at load
# ~2.5; the distributed tests always ran their ranks with 1). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): a worker per core, at most 8. The tests start
    torchrun and trial processes of their own (up to 8 ranks), and the preflight tests time
    real steps, which stretch on an oversubscribed machine."""
    return max(1, min(os.cpu_count() or 1, 8))


def _run_cli(*args, cwd=None):
    return run_flopwise(list(args), cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)


@pytest.fixture
def cli():
    """``cli("train", ...)`` runs ``python -m flopwise`` in a process of its own and returns the
    CompletedProcess (forked from a forkserver that imported torch once: helpers.run_flopwise)."""
    return _run_cli


# Files whose tests cost the most (the dry-run matrix, the docs lane, the 2-rank ladder, the virtual
# preflight), heaviest first: they run first, so each of the two workers starts on one of the two largest
# and the run ends on small files; without this xdist hands out files by their number of tests, and two
# large ones could queue on one worker while the other finishes (pyproject: --no-loadscope-reorder).
HEAVY_FIRST = ("integration/test_dryrun.py", "integration/test_doc_commands.py", "integration/test_preflight.py",
               "integration/test_virtual_preflight.py")


def pytest_collection_modifyitems(config, items):
    """The heavy files first (:data:`HEAVY_FIRST`), and the on-request lane (marked ``extended``)
    deselected unless ``-m`` names it."""
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, name in enumerate(HEAVY_FIRST) if path.endswith(name)), len(HEAVY_FIRST))

    items.sort(key=rank)  # stable: the order within a file and among the rest is kept
    if "extended" in (config.getoption("markexpr") or ""):
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]


def _shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory every xdist worker of this run shares (the run's temporary root; this process's
    own under ``-n0``): what one worker builds there, the others find."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # basetemp is <run root>/popen-gwN under xdist
    path = root / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def small_builtin(tmp_path_factory):
    """The embedded corpus capped at 0.6 MB of source, a 512-token BPE: a real data directory,
    prepared once per run (``prepare_builtin`` serialises the workers on its lock file: one
    builds, the others find it cached)."""
    from flopwise.data.builtin import prepare_builtin

    cache = _shared_dir(tmp_path_factory, "flopwise-cache")
    path = prepare_builtin(cache, vocab_size=512, max_mb=0.6, log=lambda s: None)
    return cache, path


@pytest.fixture(scope="session")
def fake_cuda_shim(tmp_path_factory) -> Path:
    """The dry run's fake-CUDA shim (``flopwise.tune.shim``), built once per torch install: the
    workers wait on one lock, so the first builds it (about 15 s of a core) and the others find it
    in the user's cache, where the dry run's own processes look. Skipped without a C++ compiler."""
    from flopwise.tune.shim import compiler, ensure_shim

    if compiler() is None:
        pytest.skip("no C++ compiler: the dry run's shim cannot be built (install g++)")
    with open(_shared_dir(tmp_path_factory, "locks") / "fake-cuda-shim.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_shim()


@pytest.fixture
def tiny_overrides(small_builtin, tmp_path):
    """Overrides for a seconds-long CPU run on the small corpus, in a fresh run directory."""
    cache, _ = small_builtin
    return [*tiny_model_overrides(cache), "train.log_every=5", "eval.every=10", "eval.sample_tokens=16",
            f"train.run_dir={tmp_path / 'run'}"]


def _saved_bytes(fn) -> int:
    """Bytes of every tensor autograd saves for backward while ``fn`` runs (no de-duplication)."""
    import torch

    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.fixture
def saved_bytes():
    """``saved_bytes(fn)``: what autograd saves for backward while ``fn`` runs, in bytes."""
    return _saved_bytes


_CAP_SYS_ADMIN = 21  # linux/capability.h


def _mount_refusal() -> str:
    """Why this process cannot mount a tmpfs, "" when it may try. Mounting needs CAP_SYS_ADMIN
    (root has it, unless a container dropped it: then ``mount`` itself fails and says so).
    Without it there is no other real small filesystem to be had: a loop device needs root
    too, a FUSE mount needs a size-limited FUSE filesystem (none is a dependency) and
    ``/dev/fuse``, and a user namespace (``unshare -rm``) would hold the mount in a child
    process, out of this one's sight."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no `mount`/`umount` command on PATH"
    if os.geteuid() == 0:
        return ""
    try:
        status = Path("/proc/self/status").read_text()
        cap_eff = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        cap_eff = 0
    if cap_eff >> _CAP_SYS_ADMIN & 1:
        return ""
    return (f"mounting a tmpfs needs root or CAP_SYS_ADMIN; this process is uid {os.geteuid()} without it "
            "(a loop mount needs root too, and no size-limited FUSE filesystem is installed)")


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs("256k")`` mounts a tmpfs of that size and returns its path: a real filesystem
    that fills up -- ENOSPC from ``write``, torch.save's zip-writer RuntimeError -- not an
    imitation of a full disk. Where mounting is not permitted (not root and no CAP_SYS_ADMIN,
    no ``mount``, a container that refuses it) the test is skipped with the reason, which
    pytest's ``-ra`` (pyproject's addopts) prints in the summary with the count of such skips;
    unmounts everything at teardown."""
    mounted: list[Path] = []

    def mount(size: str = "1m") -> Path:
        refusal = _mount_refusal()
        if refusal:
            pytest.skip(f"no real full disk to test on: {refusal}")
        point = tmp_path / f"small_fs{len(mounted)}"
        point.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            why = " ".join(r.stderr.split()) or f"exit status {r.returncode}"
            pytest.skip(f"no real full disk to test on: `mount -t tmpfs` failed: {why}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in reversed(mounted):
            if subprocess.run(["umount", str(point)], capture_output=True, timeout=60).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=60)


@pytest.fixture
def nan_at(monkeypatch):
    """``nan_at({3, 5})``: the loss of the 3rd and 5th ``forward_backward`` calls of a training
    run becomes NaN, as a divergence would (a rollback trains a step again: calls, not steps,
    are counted)."""
    from flopwise.train import train_step as trainer_module  # where the training step calls it

    def install(calls: set[int]) -> None:
        real = trainer_module.forward_backward
        n = {"calls": 0}

        def forward_backward(*a, **kw):
            n["calls"] += 1
            loss = real(*a, **kw)
            return loss * float("nan") if n["calls"] in calls else loss

        monkeypatch.setattr(trainer_module, "forward_backward", forward_backward)

    return install


def _fill(path, leave_bytes: int) -> None:
    st = os.statvfs(path)
    with open(Path(path) / "ballast", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave_bytes))


@pytest.fixture
def fill_fs():
    """``fill_fs(path, leave_bytes)``: fill the filesystem of ``path`` with a file named
    ``ballast`` until at most ``leave_bytes`` are free (a small_fs, usually)."""
    return _fill


class TickClock:
    """A clock that moves ``tick`` seconds each time it is read: a run's deadline logic
    (``train.max_hours``, a time-fitted schedule) sees time pass at a fixed pace per step,
    however fast or loaded this machine is."""

    def __init__(self, tick: float = 0.1):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture
def tick_clock() -> TickClock:
    """``train(cfg, clock=tick_clock)``: 0.1 s passes at every reading of the run's clock."""
    return TickClock()


@pytest.fixture
def short_tmp():
    """The TMPDIR of one preflight: short, since the trials' forkserver makes a Unix socket under it
    (107 bytes at most), and pytest's tmp_path under xdist is long enough to pass that."""
    tmp = Path(tempfile.mkdtemp(prefix="fw-pf-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)
