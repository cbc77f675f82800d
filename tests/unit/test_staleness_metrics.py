"""Lags from recorded versions, staleness statistics, and the mismatch split by lag."""

from __future__ import annotations

import math

import pytest
import torch

from tir_rl.mismatch.staleness import mismatch_by_lag, staleness_metrics, token_lags
from tir_rl.types import UNVERSIONED

U = UNVERSIONED


def test_lag_is_the_trained_version_minus_the_token_version_and_unrecorded_stays_negative():
    versions = torch.tensor([[3, 3, U, 4], [5, U, U, U]])
    assert token_lags(versions, 5).tolist() == [[2, 2, -1, 1], [0, -1, -1, -1]]


def test_staleness_metrics_over_model_tokens_per_turn():
    lags = torch.tensor([[2, 2, -1, 1], [0, 0, 0, -1]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    turns = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])
    row = staleness_metrics(lags, mask, turns)
    # model tokens with a version: 2, 2, 1 (turns 0, 0, 1) and 0, 0 (turn 0)
    assert row["staleness/lag_mean"] == pytest.approx(5 / 5)
    assert row["staleness/lag_max"] == 2.0
    assert row["staleness/stale_token_fraction"] == pytest.approx(3 / 5)
    assert row["staleness/num_tokens"] == 5.0
    assert row["staleness/turn_0/lag_mean"] == pytest.approx(4 / 4)
    assert row["staleness/turn_1/lag_max"] == 1.0


def test_no_recorded_version_gives_no_staleness_row():
    lags = torch.full((2, 3), -1)
    assert staleness_metrics(lags, torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long)) == {}


def test_mismatch_by_lag_keeps_fresh_and_stale_tokens_apart():
    trainer = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -1.0, -2.0, -1.5]])  # the stale tokens are the off ones
    mask = torch.tensor([[1, 1, 1, 1]])
    lags = torch.tensor([[0, 0, 1, 3]])
    row = mismatch_by_lag(trainer, sampler, mask, lags)
    assert row["mismatch/lag_0/kl"] == 0.0 and row["mismatch/lag_0/k3_kl"] == 0.0
    assert row["mismatch/lag_0/num_tokens"] == 2.0
    deltas = torch.tensor([1.0, 0.5], dtype=torch.float64)
    assert row["mismatch/lag_1+/kl"] == pytest.approx(float(-deltas.mean()))
    k3 = (deltas.exp() - deltas - 1).mean()
    assert row["mismatch/lag_1+/k3_kl"] == pytest.approx(float(k3))
    assert row["mismatch/lag_1+/abs_diff_max"] == 1.0
    assert all(math.isfinite(v) for v in row.values())


def test_a_bucket_without_tokens_is_left_out():
    row = mismatch_by_lag(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))
    assert not any(k.startswith("mismatch/lag_1+") for k in row)
