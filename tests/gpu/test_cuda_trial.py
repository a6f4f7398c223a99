"""Preflight trials on CUDA: in this process and in a fresh one, on the same device, with
pinned and prefetched batches; the ladder's GPU rungs present. Skipped without a GPU."""

import pytest
import torch

from flopwise.config import build_config
from flopwise.data.datadir import open_data_dir
from flopwise.tune.ladder import rungs
from flopwise.tune.trial import TrialSpec, measure, measure_in_processes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda:0")


@pytest.fixture
def cfg(tiny_overrides):
    c = build_config(overrides=tiny_overrides + ["train.device=cuda", "train.compile=off", "train.precision=bf16",
                                                 "data.prefetch=2"])
    open_data_dir(c.data, log=lambda s: None)
    return c


def test_a_cuda_trial_here_and_in_a_fresh_process_measure_the_same_step(cfg):
    here = measure(cfg, TrialSpec(8, "none", warmup=1, steps=3), CUDA)
    there = measure_in_processes(cfg, TrialSpec(8, "none", warmup=1, steps=3), CUDA, timeout_s=300)
    assert here["peak_gb"] > 0 and there["peak_gb"] > 0
    assert there["first_loss"] == pytest.approx(here["first_loss"], rel=1e-3), (there, here)


def test_the_ladder_offers_the_gpu_rungs_on_cuda(cfg):
    names = [name for name, _, _ in rungs(cfg, CUDA, [4, 8, 16])]
    assert names[:2] == ["precision", "attention"] and "compile mode" in names and "threads" not in names
