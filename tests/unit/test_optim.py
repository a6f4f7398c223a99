"""Learning-rate schedule and optimizer parameter groups."""

import pytest
import torch

from flopwise.config import OptimConfig
from flopwise.train.optim import build_optimizer, lr_at, param_groups


def test_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    total = 111  # 10 warm-up steps, then 100 decay intervals
    lrs = [lr_at(s, total, cfg) for s in range(total)]
    assert lrs[0] == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert lrs[9] == pytest.approx(1e-3)  # warm-up ends at the peak
    assert lrs[10] == pytest.approx(1e-3)  # cosine starts at the peak
    assert lrs[-1] == pytest.approx(1e-4)  # ... and ends at the floor on the last step
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-2)  # halfway


def test_constant_schedule_and_no_warmup():
    cfg = OptimConfig(lr=2e-3, warmup_steps=0, schedule="constant")
    assert {lr_at(s, 50, cfg) for s in range(50)} == {2e-3}


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and len(decay["params"]) == 2
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 3


def test_tied_weights_counted_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == 1


def test_fused_is_off_on_cpu_by_default():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert not opt.defaults.get("fused")
