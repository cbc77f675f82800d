"""The optimizer side of an update, shared by the RL trainer (`trainer.py`) and SFT (`lab/sft.py`).

Seeding, AdamW over the trainable parameters, and clipping by the global gradient norm:
one implementation, so the two pipelines cannot drift apart.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from tir_rl import distributed as tdist


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_adamw(
    parameters: Iterable[nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """AdamW over the parameters that require a gradient (frozen ones get no state)."""
    return torch.optim.AdamW(
        [p for p in parameters if p.requires_grad],
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
    )


def grad_norm(parameters: Iterable[nn.Parameter]) -> float:
    """Global L2 norm of the gradients, across ranks when sharded (`distributed.grad_norm`)."""
    return float(tdist.grad_norm(parameters))


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale the gradients so that their global norm `norm` (pre-clip) becomes `max_norm`.

    Nothing happens when `max_norm` is 0 or less (clipping off) or `norm` is within it.
    """
    if max_norm <= 0 or norm <= max_norm:
        return
    scale = max_norm / (norm + 1e-6)
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(scale)
