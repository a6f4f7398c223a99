"""The language-model objective: token cross-entropy, summed, in float32.

At the model layer because both sides use it: training (``train/step.py``, the reference
the chunked and fused heads of ``train/losses.py`` are tested against) and evaluation
(``evaluate/loss.py``, which the trainer calls for its validation loss) -- so ``evaluate``
needs nothing from ``train``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token cross-entropies, computed in float32 (logits may be bf16 under autocast)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
        reduction="sum", ignore_index=ignore_index,
    )
