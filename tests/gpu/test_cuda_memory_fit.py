"""On CUDA the memory check compares the plan with the GPU's free memory (torch.cuda.mem_get_info).

Skipped without a GPU; run on a CUDA machine with ``python -m pytest -q tests/gpu``.
"""

import pytest
import torch

from flopwise.plan.fit import available_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_free_gpu_memory_is_what_a_rank_has():
    device = torch.device("cuda:0")
    got, source = available_memory(device, local_ranks=8)  # ranks do not share a GPU: not divided
    free, total = torch.cuda.mem_get_info(device)
    assert 0 < got <= total and abs(got - free) < 0.05 * total
    assert "mem_get_info" in source


def test_a_model_no_gpu_holds_is_refused_before_the_model_exists(cli, tiny_overrides):
    proc = cli("train", *tiny_overrides, "train.device=cuda", "model.d_model=32768", "model.n_layers=100",
               "train.max_steps=2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flopwise train: the planned step needs "), proc.stderr
    assert "CUDA memory available is" in lines[0] and "free on cuda:0" in lines[0]
    assert "out of memory" not in proc.stderr.lower()
