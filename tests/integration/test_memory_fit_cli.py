"""A model this machine cannot hold, through the real command line: refused by the planner's
numbers before anything is allocated (plan/fit.py), in one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

try:
    import resource
except ImportError:  # not on POSIX: run without the address-space cap
    resource = None

CAP = 8 * 1024**3  # bytes of address space: far below the plan, and below what would OOM this machine


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def test_a_model_no_machine_holds_is_refused_in_one_line_before_allocating(tiny_overrides, tmp_path):
    # ~0.3T parameters (under the 2e12 a model may have, plan/flops.py): ~4,800 GiB planned. Before
    # the check, the model was being built when the allocator refused ("can't allocate memory: you
    # tried to allocate ...") -- or, on a machine with more memory, the kernel's OOM killer struck.
    # Under the address-space cap a model being built fails at once, so this also shows that
    # nothing was allocated.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "flopwise", "train", *tiny_overrides, "train.device=cpu",
                           "model.d_model=32768", "model.n_layers=100", "train.max_steps=2"],
                          capture_output=True, text=True, env=env, timeout=600,
                          preexec_fn=_cap_address_space if resource is not None else None)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("flopwise train: the planned step needs "), line
    planned, available = line.split(" but ", 1)
    assert "GiB" in planned and available.startswith("CPU memory available is ") and "GiB" in available
    assert "nothing was allocated" in line
    assert "can't allocate memory" not in proc.stderr  # the planner refused it, not the allocator
    assert not (tmp_path / "run").exists()  # no run directory left behind
