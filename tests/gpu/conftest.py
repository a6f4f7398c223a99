"""The CUDA tests take the GPU one at a time: the suite runs its files on several workers at
once (pyproject's addopts), and these tests read free memory, fill it and time on it."""

import fcntl

import pytest


@pytest.fixture(autouse=True)
def one_gpu_test_at_a_time(tmp_path_factory):
    """An exclusive lock, for the test's length, on a file every worker of this session sees
    (the parent of the per-worker temporary directories; this run's own under one process)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if base.name.startswith("popen-gw") else base
    with open(shared / "gpu-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
