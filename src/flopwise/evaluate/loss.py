"""Validation loss on a fixed held-out subset."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from flopwise.train.step import loss_sum


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    windows: torch.Tensor,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Mean token loss over ``windows`` (N, seq_len + 1), evaluated ``batch_size`` at a time."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for i in range(0, windows.size(0), batch_size):
        w = windows[i : i + batch_size].to(device, non_blocking=True)
        x, y = w[:, :-1], w[:, 1:]
        with autocast():
            logits = model(x)
        total += loss_sum(logits, y)
        count += y.numel()
    model.train(was_training)
    return float(total) / max(count, 1)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
