"""VCPO's ESS ratio and the learning rate it scales, on hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from tir_rl.errors import ConfigError
from tir_rl.mismatch.metrics import binary_divergences
from tir_rl.trainer.ess_step import ESSRule, ESSStepSize, ess_ratio, sequence_weight_sums
from tir_rl.trainer.optimal_baseline import optimal_baseline_advantages


def test_the_ess_ratio_of_sequence_weights_is_vcpos():
    # Sequence log-ratios log 0.5, 0, log 2, log 8 (split over tokens), one empty sequence.
    trainer = torch.tensor(
        [[math.log(0.5), 0.0], [0.0, 0.0], [math.log(2) / 2, math.log(2) / 2],
         [math.log(8), 0.0], [0.0, 0.0]]
    )  # fmt: skip
    sampler = torch.zeros_like(trainer)
    mask = torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1], [0, 0]])
    sums = sequence_weight_sums(trainer, sampler, mask)
    assert sums.tolist() == pytest.approx([11.5, 69.25, 4.0])
    assert ess_ratio(*sums.tolist()) == pytest.approx(11.5**2 / 69.25 / 4, rel=1e-6)
    assert ess_ratio(0.0, 0.0, 0.0) == 1.0


def test_the_ess_ratio_sums_over_ranks():
    """Two ranks' sums add up to the whole batch's, so ρ is the global one."""
    gen = torch.Generator().manual_seed(0)
    trainer, sampler = -torch.rand(6, 5, generator=gen), -torch.rand(6, 5, generator=gen)
    mask = torch.ones(6, 5)
    whole = sequence_weight_sums(trainer, sampler, mask)
    parts = sequence_weight_sums(trainer[:2], sampler[:2], mask[:2]) + sequence_weight_sums(
        trainer[2:], sampler[2:], mask[2:]
    )
    assert torch.allclose(whole, parts, rtol=1e-12)


def test_the_learning_rate_scale_follows_the_rule():
    assert ESSStepSize().scale(0.25) == 1.0  # off
    on = ESSStepSize(enabled=True)
    assert on.scale(0.25) == pytest.approx(0.5) and on.scale(1.0) == 1.0
    assert ESSStepSize(enabled=True, rule=ESSRule.LINEAR).scale(0.25) == pytest.approx(0.25)
    assert ESSStepSize(enabled=True, reference=0.5).scale(0.25) == pytest.approx(0.5**0.5)
    assert ESSStepSize(enabled=True, reference=0.5).scale(0.9) == 1.0
    with pytest.raises(ConfigError, match="reference"):
        ESSStepSize(reference=0).validate()


def test_binary_divergences_of_the_sampled_token():
    trainer = torch.log(torch.tensor([[0.7, 0.2, 0.9]]))
    sampler = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
    valid = torch.tensor([[True, True, False]])
    tv, kl = binary_divergences(trainer, sampler, valid)
    assert tv.tolist()[0] == pytest.approx([0.2, 0.0, 0.0], abs=1e-7)
    expected = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    assert kl.tolist()[0] == pytest.approx([expected, 0.0, 0.0], abs=1e-7)


def test_the_optimal_baseline_weighs_rewards_by_gradient_norm_and_is_weight():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([3, 3, 3, 9, 9])
    norms = torch.tensor([2.0, 1.0, 1.0, 1.0, 3.0])
    log_w = torch.log(torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0]))
    advantages, baseline = optimal_baseline_advantages(rewards, groups, norms, log_w)
    # Group 3: W = 4·1, 1·4, 1·1 -> b = 4/9; σ = population std of (1, 0, 0) = √2/3.
    b = 4 / (9 + 1e-8)
    assert baseline[:3].tolist() == pytest.approx([b] * 3, rel=1e-6)
    sigma = math.sqrt(2) / 3
    assert advantages[:3].tolist() == pytest.approx([(1 - b) / sigma, -b / sigma, -b / sigma])
    # Group 9 ties (σ = 0): the advantage is R − b, which is ~0.
    assert advantages[3:].tolist() == pytest.approx([0.0, 0.0], abs=1e-8)
