"""The collapse lab's verdict on a run (`collapse_lab.verdict`)."""

import pytest

from collapse_lab.verdict import CollapseCriteria, judge_run
from tir_rl.errors import ConfigError


def rows(rewards, grad_norms=None, alerts=None, heldout=None):
    out = []
    for i, r in enumerate(rewards):
        step = i + 1
        row = {"step": step, "rollout/reward_mean": r}
        row["train/grad_norm"] = grad_norms[i] if grad_norms else 1.0
        if alerts and step in alerts:
            row["guard/alerts"] = 1.0
        out.append(row)
    for step, acc in (heldout or {}).items():
        out.append({"step": step, "eval/pass_at_1": acc})
    return out


def test_steady_learning_is_not_a_collapse() -> None:
    verdict = judge_run(rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.7]))
    assert not verdict.collapsed and verdict.collapse_step is None
    assert verdict.spike_steps == ()
    assert verdict.peak_reward == pytest.approx((0.6 + 0.6 + 0.7) / 3)


def test_spike_then_lasting_drop_is_a_collapse_and_alert_lead_is_counted() -> None:
    rewards = [0.5, 0.5, 0.6, 0.6, 0.6, 0.5, 0.1, 0.0, 0.0, 0.0]
    grads = [1.0, 1.1, 0.9, 1.0, 1.0, 30.0, 2.0, 1.0, 1.0, 1.0]
    verdict = judge_run(rows(rewards, grads, alerts={4, 6}))
    assert verdict.collapsed
    assert verdict.spike_steps == (6,)
    assert verdict.collapse_step == 8  # trailing mean of 3 first below half of the best
    assert verdict.first_alert_step == 4
    assert verdict.alert_lead_steps == 4


def test_transient_dip_without_spike_that_recovers_is_not_a_collapse() -> None:
    verdict = judge_run(rows([0.6, 0.6, 0.6, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6, 0.6]))
    assert not verdict.collapsed


def test_transient_dip_right_after_a_spike_is_a_collapse() -> None:
    rewards = [0.6, 0.6, 0.6, 0.6, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6]
    grads = [1, 1, 1, 1, 50, 1, 1, 1, 1, 1]
    verdict = judge_run(rows(rewards, grads))
    assert verdict.collapsed and verdict.spike_steps == (5,)
    assert not verdict.persisting  # the reward came back


def test_a_drop_that_lasts_to_the_end_is_a_persisting_collapse() -> None:
    verdict = judge_run(rows([0.6, 0.6, 0.6, 0.6, 0.0, 0.0, 0.0, 0.0]))
    assert verdict.collapsed and verdict.persisting
    assert not judge_run(rows([0.6, 0.6, 0.6, 0.7])).persisting


def test_a_run_that_never_learned_cannot_collapse() -> None:
    verdict = judge_run(rows([0.02, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert not verdict.collapsed


def test_degradation_compares_first_and_last_heldout() -> None:
    verdict = judge_run(rows([0.3] * 5, heldout={0: 0.5, 3: 0.6, 5: 0.25}))
    assert verdict.degraded
    assert (verdict.heldout_before, verdict.heldout_after) == (0.5, 0.25)
    assert not judge_run(rows([0.3] * 5, heldout={0: 0.5, 5: 0.5})).degraded


def test_alert_after_the_collapse_gives_no_lead() -> None:
    rewards = [0.6, 0.6, 0.6, 0.0, 0.0, 0.0]
    verdict = judge_run(rows(rewards, alerts={6}))
    assert verdict.collapsed and verdict.alert_lead_steps is None


def test_nan_values_are_ignored() -> None:
    data = rows([0.5, 0.5, 0.5, 0.5], [1.0, float("nan"), 1.0, 1.0])
    assert judge_run(data).spike_steps == ()


def test_bad_criteria_are_refused() -> None:
    with pytest.raises(ConfigError):
        CollapseCriteria(drop_fraction=1.5)
