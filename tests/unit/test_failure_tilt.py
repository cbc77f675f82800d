"""The failure tilt: the advantage-weighted mean log-ratio of the sequences an update trains."""

import pytest
import torch

from tir_rl.metric import ReduceOp
from tir_rl.mismatch.failure_tilt import TILT_KEY, TILT_MASS_KEY, failure_tilt, tilt_sums


def batch(deltas: list[list[float]]):
    """Sampler logprobs of −1 everywhere; the trainer's differ by `deltas` (ragged rows)."""
    length = max(map(len, deltas))
    mask = torch.tensor([[float(t < len(row)) for t in range(length)] for row in deltas])
    delta = torch.tensor([row + [99.0] * (length - len(row)) for row in deltas])
    sampler = torch.full_like(delta, -1.0)
    return sampler + delta, sampler, mask


def test_failures_the_sampler_over_weighted_tilt_positive_by_the_hand_formula():
    trainer, sampler, mask = batch([[-0.2, -0.4], [0.1, 0.0, 0.2], [-0.3]])
    advantages = torch.tensor([-1.0, 1.0, -0.5])
    found = failure_tilt(trainer, sampler, mask, advantages, None)
    means = [-0.3, 0.1, -0.3]  # the padding's 99 never counts
    expected = sum(a * d for a, d in zip(advantages.tolist(), means, strict=True)) / 2.5
    assert found[TILT_KEY] == pytest.approx(expected) and found[TILT_KEY] > 0
    assert found[TILT_MASS_KEY] == pytest.approx(2.5)
    assert found[TILT_KEY].reduce is ReduceOp.MEAN and found[TILT_KEY].over == TILT_MASS_KEY


def test_a_gap_unrelated_to_the_outcome_has_no_tilt():
    trainer, sampler, mask = batch([[-0.2, -0.2], [-0.2, -0.2]])
    found = failure_tilt(trainer, sampler, mask, torch.tensor([1.0, -1.0]), None)
    assert found[TILT_KEY] == pytest.approx(0.0, abs=1e-12)


def test_a_correction_that_rejects_the_failures_leaves_the_successes_tilt():
    trainer, sampler, mask = batch([[-0.5, -0.5], [0.1, 0.1]])
    advantages = torch.tensor([-1.0, 1.0])
    weights = torch.tensor([[0.0, 0.0], [0.5, 0.5]])  # failure rejected, success weighed half
    found = failure_tilt(trainer, sampler, mask, advantages, weights)
    assert found[TILT_KEY] == pytest.approx(0.1)
    assert found[TILT_MASS_KEY] == pytest.approx(0.5)
    uncorrected = failure_tilt(trainer, sampler, mask, advantages, None)
    assert uncorrected[TILT_KEY] == pytest.approx((0.5 + 0.1) / 2)


def test_no_sequence_with_a_gradient_reports_nothing():
    trainer, sampler, mask = batch([[0.3], [-0.3]])
    assert failure_tilt(trainer, sampler, mask, torch.zeros(2), None) == {}


def test_the_record_replay_and_the_trainer_share_one_formula():
    trainer, sampler, mask = batch([[-0.2, -0.4], [0.1, 0.0, 0.2]])
    advantages = torch.tensor([-1.0, 1.0])
    tilted, mass = tilt_sums(advantages, torch.tensor([-0.3, 0.1]), torch.ones(2))
    assert failure_tilt(trainer, sampler, mask, advantages, None)[TILT_KEY] == pytest.approx(
        tilted / mass
    )
