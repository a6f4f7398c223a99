"""`flopwise train` refuses a step the planner says cannot fit this machine's memory, before it
builds the model or a batch (plan/fit.py), naming both numbers and what would fit.

The machine's memory is injected (``memory_fit.available_memory``) so "this machine has 1 GiB"
is deterministic; tests/integration/test_memory_fit_cli.py runs the real check on this machine."""

from __future__ import annotations

import pytest
import torch

from flopwise.config import build_config
from flopwise.errors import FlopwiseError
from flopwise.plan import fit as memory_fit
from flopwise.plan.budget import GIB, plan_for_run
from flopwise.plan.fit import MemoryFitError, available_memory, check_memory_fit
from flopwise.train import setup
from flopwise.train.trainer import train

CPU = torch.device("cpu")
# micro-batch 32 x seq 1024 of a 4-layer d_model=256 model: about 1.8 GiB planned in float32
BIG_BATCH = ["model.d_model=256", "model.n_layers=4", "model.max_seq_len=1024", "train.seq_len=1024",
             "train.micro_batch_size=32", "train.global_batch_size=64"]


def _has(gib: float, source: str = "this test's machine"):
    return lambda device, local_ranks: (int(gib * GIB), source)


def _cfg(tiny_overrides, extra):
    return build_config(overrides=tiny_overrides + extra)


def _plan(cfg):
    return plan_for_run(cfg, None, "float32", loss="chunked")


def test_a_step_above_the_available_memory_is_refused_with_both_numbers_and_what_fits(tiny_overrides):
    cfg = _cfg(tiny_overrides, BIG_BATCH)
    plan = _plan(cfg)
    assert 1 < plan["memory_gb"] < 4
    with pytest.raises(MemoryFitError) as caught:
        check_memory_fit(cfg, plan, CPU, "float32", "chunked", "single", 1, measure=_has(1.0))
    message = str(caught.value)
    assert isinstance(caught.value, FlopwiseError) and "\n" not in message
    assert f"needs {plan['memory_gb']:,.2f} GiB" in message
    assert "available is 1.00 GiB (this test's machine)" in message
    assert "nothing was allocated" in message
    # plan's own suggestions (fit_suggestions), as training overrides: a smaller micro-batch first
    assert "fits with train.micro_batch_size=8 (" in message
    assert "train.activation_checkpointing=full (" in message


def test_a_step_within_the_available_memory_goes_on(tiny_overrides):
    cfg = _cfg(tiny_overrides, BIG_BATCH)
    plan = _plan(cfg)
    measured = check_memory_fit(cfg, plan, CPU, "float32", "chunked", "single", 1,
                                measure=_has(plan["memory_gb"] * 1.001))
    assert measured is not None  # a plan just under all of the memory is not refused: it is an estimate
    assert check_memory_fit(cfg, plan, CPU, "float32", "chunked", "single", 1,
                            measure=lambda device, local_ranks: None) is None  # unknown memory: no check


def test_nothing_that_fits_says_so(tiny_overrides):
    cfg = _cfg(tiny_overrides, ["model.d_model=1024", "model.n_layers=8"])  # the weights alone exceed it
    with pytest.raises(MemoryFitError, match="no smaller micro-batch, activation checkpointing or strategy fits"):
        check_memory_fit(cfg, _plan(cfg), CPU, "float32", "chunked", "single", 1, measure=_has(0.25))


def test_cpu_memory_is_shared_by_the_ranks_on_the_host(monkeypatch):
    monkeypatch.setattr(memory_fit, "_meminfo_available", lambda: 8 * GIB)
    monkeypatch.setattr(memory_fit, "_cgroup_available", lambda: None)
    assert available_memory(CPU) == (8 * GIB, "MemAvailable in /proc/meminfo")
    got, source = available_memory(CPU, 4)
    assert got == 2 * GIB and "shared by 4 ranks on this host" in source
    monkeypatch.setattr(memory_fit, "_cgroup_available", lambda: 3 * GIB)  # a container's limit leaves less
    assert available_memory(CPU)[0] == 3 * GIB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert memory_fit.local_rank_count(8) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert memory_fit.local_rank_count(8) == 8


def test_this_machines_memory_is_read():
    got = available_memory(CPU)
    assert got is not None and got[0] > 0


@pytest.mark.parametrize("files, want", [
    ({"memory.max": "4294967296\n", "memory.current": "1073741824\n", "memory.stat": "inactive_file 536870912\n"},
     4 * GIB - GIB // 2),  # cgroup v2: the limit less what is used, reclaimable page cache not counted
    ({"memory.max": "max\n", "memory.current": "1073741824\n"}, None),  # no limit
    ({"memory/memory.limit_in_bytes": "2147483648\n", "memory/memory.usage_in_bytes": "1073741824\n",
      "memory/memory.stat": "total_inactive_file 0\n"}, GIB),  # cgroup v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"}, None),
])
def test_a_cgroup_limit_is_read(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert memory_fit._cgroup_available(tmp_path) == want


def test_train_refuses_before_it_builds_the_model(tiny_overrides, tmp_path, monkeypatch):
    """The whole start-up path: on "a machine with 1 GiB" nothing is built and no run is left behind."""
    monkeypatch.setattr(memory_fit, "available_memory", _has(1.0))

    def must_not_build(*args, **kwargs):
        raise AssertionError("the model was built although the plan does not fit")

    monkeypatch.setattr(setup, "build_step", must_not_build)
    monkeypatch.setattr(setup, "train_loader", must_not_build)  # nor a batch
    cfg = _cfg(tiny_overrides, BIG_BATCH + [f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(MemoryFitError, match=r"available is 1\.00 GiB .*fits with train\.micro_batch_size=8"):
        train(cfg, log=lambda s: None)
    assert not (tmp_path / "run").exists()
