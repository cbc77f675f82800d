"""The metrics row of one RL step (`tir_rl.report.step_metrics`)."""

import math

from tir_rl.engine.parity import ParityReport
from tir_rl.mismatch.guard import Alert, GuardAction, GuardDecision
from tir_rl.report.step_metrics import StepOutcome, episode_row, step_row
from tir_rl.trainer import StepResult, UpdateStatus
from tir_rl.trainer.batch import TrainBatch
from tir_rl.types import EpisodeTimings, RolloutStatus, Trajectory


def trajectory(reward: float, status=RolloutStatus.FINISHED, *, logprob=-0.5) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        completion_ids=[10, 11, 12],
        loss_mask=[1, 0, 1],
        sampler_logprobs=[logprob, 0.0, logprob],
        turn_ids=[0, 0, 1],
        reward=reward,
        status=status,
        num_tool_calls=1,
        num_tool_errors=int(reward == 0),
    )


def test_episode_row_summarises_rewards_tokens_tools_and_statuses():
    row = episode_row(
        [trajectory(1.0), trajectory(0.0, RolloutStatus.TRUNCATED_MAX_TURNS)], prefix="eval"
    )
    assert row["eval/reward_mean"] == 0.5 and row["eval/reward_max"] == 1.0
    assert row["eval/model_tokens"] == 4.0  # two model tokens per episode
    assert row["eval/completion_tokens_mean"] == 3.0
    assert row["eval/tool_errors_mean"] == 0.5
    assert row["eval/status/finished"] == row["eval/status/truncated_max_turns"] == 0.5


def outcome(**overrides) -> StepOutcome:
    fields = dict(
        rollout_row={"perf/rollout_s": 2.0, "rollout/model_tokens": 100.0},
        batch=None,
        result=StepResult.no_batch(),
        trainer_logprobs=None,
        num_degenerate_groups=3,
        train_s=1.5,
        sync_s=0.25,
    )
    return StepOutcome(**{**fields, **overrides})


def test_step_row_of_an_update():
    result = StepResult(
        loss=0.5, grad_norm=2.0, status=UpdateStatus.APPLIED, metrics={"mismatch/k3": 0.01}
    )
    parity = ParityReport(
        num_tokens=8, mean_abs_diff=1e-5, max_abs_diff=1e-4, argmax_position=2, tolerance=1e-3
    )
    given = outcome(result=result, parity=parity)
    row = step_row(given)
    assert row["train/loss"] == 0.5 and row["train/grad_norm"] == 2.0
    assert row["train/skipped"] == 0.0 and row["train/degenerate_groups"] == 3.0
    assert row["mismatch/k3"] == 0.01
    assert (row["perf/train_s"], row["perf/sync_s"]) == (1.5, 0.25)
    assert row["sync/parity_max_abs_diff"] == 1e-4
    assert "train/loss" not in given.rollout_row  # the rollout row is not modified


def test_step_row_of_a_scoring_pass_keeps_its_mismatch_metrics_and_guard_alerts():
    alert = Alert(step=0, metric="mismatch/k3_kl", value=0.3, threshold=0.01, reason="absolute")
    scored = StepResult(
        loss=math.nan, grad_norm=math.nan, status=UpdateStatus.SCORED,
        metrics={"mismatch/k3_kl": 0.3}, guard=GuardDecision(GuardAction.CONTINUE, (alert,)),
    )  # fmt: skip
    batch = TrainBatch.from_trajectories([trajectory(1.0), trajectory(1.0)])
    row = step_row(outcome(batch=batch, result=scored, trainer_logprobs=batch.sampler_logprobs))
    assert math.isnan(row["train/loss"]) and row["train/skipped"] == 1.0
    assert row["mismatch/k3_kl"] == 0.3 and row["guard/alerts"] == 1.0


def test_step_row_without_any_batch_has_no_mismatch_columns():
    row = step_row(outcome())
    assert not any(key.startswith("mismatch/") for key in row)
    assert math.isnan(row["train/loss"]) and math.isnan(row["train/grad_norm"])
    assert row["train/skipped"] == 1.0


def test_prefix_cache_hit_is_the_cached_share_of_the_context_sent_when_the_engine_reports_it():
    unreported = trajectory(1.0)
    assert "rollout/prefix_cache_hit" not in episode_row([unreported], prefix="rollout")
    hits = []
    for sent, cached in ((100, 64), (300, 0)):
        t = trajectory(1.0)
        t.timings = EpisodeTimings(prompt_tokens=sent, cached_prompt_tokens=cached)
        hits.append(t)
    row = episode_row([*hits, unreported], prefix="rollout")
    assert row["rollout/prefix_cache_hit"] == 64 / 400
