"""Out of memory for real, on CPU: a process whose address space is capped (RLIMIT_AS) builds a
model that does not fit under the cap, and the allocator's own failure is what the user sees
-- no ``RuntimeError("out of memory")`` made up by the test.

The cap is set *inside* the child, after it has imported torch and flopwise: its own VmSize
then plus ``HEADROOM``. So it does not depend on how much address space this machine's torch
maps at import (a CUDA build maps far more than the CPU one), and the imports always work.

``HEADROOM`` = 512 MiB, measured on torch 2.13 CPU (2-core x86): VmSize after importing torch
and flopwise.cli ~645 MiB; a whole tiny run (d_model 64, 2 steps, validation, a checkpoint)
peaks ~265 MiB above that and completes under this cap. The model here (``BIG``: d_model
2048, 2 layers, 123M parameters) needs 492 MB for its weights alone (its largest tensors
64-128 MiB), so it cannot be built in what is left -- while the planner's memory check
(~2 GiB with gradients and AdamW state, against MemAvailable) lets it through on any machine
with a few GiB free; where it does not, the test skips and says so.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import tiny_model_overrides

pytestmark = pytest.mark.slow  # a python process with torch per test (the trial: two), ~5 s each

HEADROOM_MIB = 512
BIG = ["model.d_model=2048", "model.n_layers=2", "model.n_heads=16", "model.n_kv_heads=4", "model.ffn_hidden=8192"]

# Caps its own address space at VmSize + HEADROOM, then runs what ``python -m flopwise`` runs.
_CAPPED = """
import resource, runpy, sys
import torch, flopwise.cli
vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom} * 2**20, resource.RLIM_INFINITY))
{body}
"""
_CLI = "sys.argv = ['flopwise'] + sys.argv[1:]\nrunpy.run_module('flopwise', run_name='__main__', alter_sys=True)"
_TRIAL = """
import json
from flopwise.config import build_config
from flopwise.tune.trial import TrialError, TrialSpec, failure_status, measure_in_processes
cfg = build_config(overrides=sys.argv[1:])
try:
    measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=2), torch.device("cpu"))
    print(json.dumps({"status": "ok"}))
except TrialError as e:
    print(json.dumps({"status": failure_status(e), "message": str(e)}))
"""


def _capped(body: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = _CAPPED.format(headroom=HEADROOM_MIB, body=body)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_train_out_of_memory_ends_in_one_line_and_exit_2(small_builtin, tmp_path):
    cache, _ = small_builtin
    proc = _capped(_CLI, ["train", *tiny_model_overrides(cache), *BIG, "train.device=cpu", "train.max_steps=2",
                          "eval.every=0", "eval.sample_tokens=0", f"train.run_dir={tmp_path / 'run'}"])
    if "the planned step needs" in proc.stderr:  # the planner refused before anything was allocated
        pytest.skip(f"too little memory here for the planner to let the model be built: {proc.stderr.strip()}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("flopwise train: out of memory: "), lines[0]
    assert "can't allocate memory" in lines[0], lines[0]  # the allocator's own words: a real failed allocation


@pytest.fixture(scope="module")
def trial_out_of_memory(small_builtin) -> dict:
    """A one-rank preflight trial (``measure_in_processes``) of a model that cannot be built under
    the cap: its spawned process inherits the cap (the parent's VmSize + HEADROOM; a freshly
    spawned trial process is no larger than its parent after the same imports) and fails
    allocating. d_model 4096 (1.9 GB of weights, 512 MiB tensors): trials have no planner check."""
    cache, _ = small_builtin
    overrides = [*tiny_model_overrides(cache), "train.compile=off", "train.threads=1", "train.device=cpu",
                 "model.d_model=4096", "model.n_heads=16", "model.n_kv_heads=4", "model.ffn_hidden=16384"]
    proc = _capped(_TRIAL, overrides)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_trial_out_of_memory_fails_with_the_allocators_error(trial_out_of_memory):
    assert trial_out_of_memory["status"] != "ok", "the trial ran: the cap did not bind"
    message = trial_out_of_memory["message"]
    assert "\n" not in message and "can't allocate memory" in message, message


def test_a_trial_out_of_memory_is_reported_as_oom(trial_out_of_memory):
    assert trial_out_of_memory["status"] == "oom", trial_out_of_memory
