"""AdamW with decoupled weight decay on 2-D weights only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from flopwise.config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay for matrices (linear and embedding weights); none for norms and biases.

    Tied parameters appear once: ``named_parameters`` de-duplicates shared tensors.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; the fused kernel on CUDA by default (one launch for all parameters)."""
    fused = device.type == "cuda" if cfg.fused == "auto" else cfg.fused == "true"
    kwargs = {"fused": True} if fused else {"foreach": device.type == "cuda"}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **kwargs,
    )


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warm-up from lr/warmup to lr over ``warmup_steps``, then cosine decay to
    ``lr * min_lr_ratio`` at the last step (or constant at lr).
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
