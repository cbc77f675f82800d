"""The trainer applies its learning-rate schedule at each optimizer step (tiny model)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_batch

from tir_rl.trainer.lr_schedule import LRSchedule


def max_update(trainer, batch, advantages) -> float:
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step(batch, advantages)
    return max(
        (p.detach() - b).abs().max().item()
        for p, b in zip(trainer.model.parameters(), before, strict=True)
    )


def test_warmup_and_cosine_set_the_optimizer_lr_of_each_step(make_trainer):
    trainer = make_trainer(
        lr=1e-3, lr_schedule=LRSchedule.COSINE, warmup_steps=2, schedule_steps=5, min_lr_ratio=0.1
    )
    batch = make_batch()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    expected = [1e-3 / 3, 2e-3 / 3, 1e-3, 0.775e-3, 0.325e-3, 0.1e-3]  # 3 decay steps
    seen, group_lrs = [], []
    for _ in expected:
        result = trainer.train_step(batch, advantages)
        assert not result.skipped
        seen.append(result.metrics["train/lr"])
        group_lrs.append(trainer.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx(expected) and group_lrs == pytest.approx(expected)


def test_the_first_warmup_step_moves_the_weights_by_the_warmed_up_lr(make_trainer):
    # Adam's first step moves each parameter by about lr (|m / sqrt(v)| = 1), so the largest
    # change of any weight measures the lr the optimizer really used.
    batch = make_batch()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    full = max_update(make_trainer(lr=1e-3), batch, advantages)
    warm = max_update(make_trainer(lr=1e-3, warmup_steps=3), batch, advantages)
    assert full == pytest.approx(1e-3, rel=0.02)
    assert warm == pytest.approx(0.25e-3, rel=0.02)
