"""The loader's buffers in the dry run's memory (issue 43, item 4): on CUDA the loader puts each
batch -- its tokens ``(B, T+1)`` and, with ``model.doc_mask``, its document ids ``(B, T)``, int64
-- in pinned host memory, and holds the device copies of the batches it prefetched through the
step. The trace of the tiny model reports the pinned host bytes apart from the GPU's (they are
not HBM) and counts the device copies in its peak, as the kind ``batches``; both equal what the
loader's rules allocate, worked out here from micro-batch x sequence x 8 bytes x buffers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flopwise.config import build_config
from flopwise.plan import hardware
from flopwise.tune.dryrun import torch_name

B, T = 4, 128
GIB = 1024**3
CONFIGS = {  # name -> overrides of the tiny preset (eager: the loader's part does not depend on compile)
    "prefetch 2, doc mask": ["data.prefetch=2", "model.doc_mask=true"],
    "no prefetch, pageable": ["data.prefetch=0", "data.pin_memory=false"],
    "no prefetch": ["data.prefetch=0"],
}


@pytest.fixture(scope="module")
def traced(fake_cuda_shim, tmp_path_factory) -> dict[str, dict]:
    shim = fake_cuda_shim
    tmp = tmp_path_factory.mktemp("loader-memory")
    paths = []
    for i, overrides in enumerate(CONFIGS.values()):
        cfg = build_config("tiny", overrides=[f"train.seq_len={T}", f"train.micro_batch_size={B}",
                                              f"train.global_batch_size={2 * B}", "train.compile=off", *overrides])
        paths.append(str(tmp / f"config-{i}.yaml"))
        Path(paths[-1]).write_text(cfg.to_yaml())
    h100 = hardware.find("h100")
    request = {"gpu": {"name": torch_name(h100), "capability": [9, 0], "memory_bytes": h100.memory_bytes},
               "world": 1, "nproc_per_node": 1, "headroom": 0.9, "configs": paths}
    (tmp / "request.json").write_text(json.dumps(request))
    env = dict(os.environ, LD_PRELOAD=str(shim), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    done = subprocess.run([sys.executable, "-m", "flopwise.tune.worker", str(tmp / "request.json"),
                           str(tmp / "result.json")], env=env, capture_output=True, text=True, timeout=1200)
    assert (tmp / "result.json").is_file(), f"the worker died ({done.returncode}): {done.stderr[-3000:]}"
    results = json.loads((tmp / "result.json").read_text())["results"]
    for name, r in zip(CONFIGS, results):
        assert "error" not in r, f"{name}: {r['error']} at {r.get('where')}"
    return {name: r["trace"] for name, r in zip(CONFIGS, results)}


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_pinned_host_bytes_are_the_loaders(traced):
    tokens, docs = B * (T + 1) * 8, B * T * 8  # int64 ids
    # prefetch 2: two batches assembled ahead, and up to two handed out whose copy may still run
    got = traced["prefetch 2, doc mask"]["loader"]
    assert got["host_pinned"] == 4 * (tokens + docs) and got["host_pinned_batches"] == 4
    assert got["host_pinned_reserved"] == 4 * (pow2(tokens) + pow2(docs))  # the host allocator's power-of-two blocks
    assert got["device_prefetched"] == 2 * (tokens + docs)
    # no prefetch: the one batch whose copy is in flight; pageable memory: nothing pinned
    assert traced["no prefetch"]["loader"]["host_pinned"] == tokens
    assert traced["no prefetch, pageable"]["loader"]["host_pinned"] == 0


def test_device_batches_are_in_the_traced_peak(traced):
    """At the step's peak the device holds the micro-batch in use (inputs, targets and document
    ids, ``(B, T)`` each) and, with prefetch, the copies of the batches waiting behind it."""
    tokens, docs, row = B * (T + 1) * 8, B * T * 8, B * T * 8
    prefetching = traced["prefetch 2, doc mask"]["eager_memory"]["by_kind_gib"]["batches"] * GIB
    assert prefetching == 2 * (tokens + docs) + 3 * row
    plain = traced["no prefetch"]["eager_memory"]["by_kind_gib"]["batches"] * GIB
    assert plain == 2 * row
    # the host's pinned bytes are reported apart: the peak is the GPU's alone
    assert traced["no prefetch"]["eager_memory"]["peak_gib"] == traced["no prefetch, pageable"]["eager_memory"][
        "peak_gib"]
