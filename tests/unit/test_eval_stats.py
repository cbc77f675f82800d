import json
import math

import pytest

from tir_rl.report.eval_stats import (
    Estimate,
    EvalReport,
    EvalSampling,
    bootstrap_mean,
    bootstrap_paired_change,
    bootstrap_seeds_and_tasks,
    build_report,
    describe_change,
    format_table,
    num_turns,
    pass_at_k,
    wilson_interval,
)
from tir_rl.types import Message, RolloutStatus, ToolCall, Trajectory


@pytest.mark.parametrize(("k", "expected"), [(1, 2 / 5), (2, 1 - 3 / 10), (5, 1.0)])
def test_pass_at_k_matches_hand_computed_values(k, expected):
    # n=5, c=2: pass@k = 1 - C(3, k) / C(5, k); C(3,1)/C(5,1) = 3/5, C(3,2)/C(5,2) = 3/10,
    # C(3,5) = 0.
    assert pass_at_k(5, 2, k) == pytest.approx(expected)


def test_pass_at_k_equals_the_binomial_formula_everywhere():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_and_bad_input():
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 5, 1)


def test_bootstrap_interval_contains_the_mean_and_shrinks_with_more_tasks():
    pattern = [0.0, 1.0, 0.5, 0.0, 1.0, 0.2, 0.8, 0.0, 1.0, 0.4]
    small = bootstrap_mean(pattern)
    large = bootstrap_mean(pattern * 20)
    for estimate in (small, large):
        assert estimate.low <= estimate.value <= estimate.high
        assert estimate.low < estimate.high
    assert small.value == pytest.approx(large.value)
    assert (large.high - large.low) < 0.5 * (small.high - small.low)
    assert bootstrap_mean(pattern, seed=0) == small  # reproducible with a fixed seed


def test_bootstrap_of_a_single_task_is_the_point_estimate():
    estimate = bootstrap_mean([0.25])
    assert (estimate.low, estimate.value, estimate.high) == (0.25, 0.25, 0.25)


def test_task_scores_follow_the_group_ids_whatever_order_the_episodes_came_in():
    shuffled = list(reversed(synthetic_episodes()))
    report = build_report(shuffled, env_id="e", split="test", k=1)
    assert report.task_pass_at_1 == pytest.approx([0.5, 0.0, 1.0])


def test_the_interval_over_seeds_and_tasks_widens_with_the_spread_between_seeds():
    tasks = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0] * 4
    failed = [0.0] * len(tasks)
    same = bootstrap_seeds_and_tasks([tasks, tasks, tasks, tasks])
    apart = bootstrap_seeds_and_tasks([tasks, failed, tasks, failed])
    assert same.value == pytest.approx(0.625)
    assert apart.value == pytest.approx(0.3125)
    assert same.low <= same.value <= same.high and apart.low <= apart.value <= apart.high
    # identical seeds add nothing beyond resampling one run's tasks
    single = bootstrap_mean(tasks)
    assert same.high - same.low == pytest.approx(single.high - single.low, abs=0.05)
    # two of four seeds failing everything: resampling the seeds moves the mean a lot
    assert apart.high - apart.low > 1.8 * (same.high - same.low)
    assert bootstrap_seeds_and_tasks([tasks]) == bootstrap_mean(tasks)


def test_the_interval_over_seeds_and_tasks_refuses_ragged_or_empty_input():
    with pytest.raises(ValueError, match="same tasks"):
        bootstrap_seeds_and_tasks([[1.0, 0.0], [1.0]])
    with pytest.raises(ValueError, match="at least one run"):
        bootstrap_seeds_and_tasks([])


def test_a_paired_change_sees_a_rise_that_the_two_marginal_intervals_cannot():
    # 40 tasks of mixed difficulty, every one of them solved a little more often after.
    before = [0.0, 0.25, 0.5, 0.75] * 10
    after = [b + 0.125 for b in before]
    marginal_before, marginal_after = bootstrap_mean(before), bootstrap_mean(after)
    assert marginal_after.low <= marginal_before.high  # the marginal intervals overlap
    change = bootstrap_paired_change(before, after)
    assert change.value == pytest.approx(0.125)
    assert change.low == pytest.approx(0.125) and change.high == pytest.approx(0.125)


def test_a_paired_change_of_two_noisy_evaluations_of_one_policy_straddles_zero():
    before = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0] * 8
    after = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0] * 8  # the same rate, other tasks
    change = bootstrap_paired_change(before, after)
    assert change.value == pytest.approx(0.0)
    assert change.low < 0.0 < change.high


def test_a_paired_change_refuses_evaluations_of_different_tasks():
    with pytest.raises(ValueError, match="same tasks"):
        bootstrap_paired_change([1.0, 0.0], [1.0])


def test_wilson_interval_contains_the_proportion_and_shrinks():
    small = wilson_interval(3, 10)
    large = wilson_interval(300, 1000)
    assert small.low < 0.3 < small.high and large.low < 0.3 < large.high
    assert (large.high - large.low) < (small.high - small.low)
    # Textbook value: 3/10 at 95% -> [0.1078, 0.6032].
    assert (small.low, small.high) == pytest.approx((0.1078, 0.6032), abs=1e-3)
    assert wilson_interval(0, 5).low == 0.0 and wilson_interval(5, 5).high == 1.0


def episode(group_id, reward, *, turns=2, calls=1, errors=0, status=RolloutStatus.FINISHED):
    messages = [Message.user("task")]
    for turn in range(turns):
        tool_calls = [ToolCall("python", {"code": "1"})] if turn < calls else []
        messages.append(Message.assistant("...", tool_calls))
        if tool_calls:
            messages.append(Message.tool("1", name="python"))
    return Trajectory(
        prompt_ids=[1],
        completion_ids=[5, 6],
        loss_mask=[1, 1],
        sampler_logprobs=[-0.1, -0.2],
        turn_ids=[0, 0],
        reward=reward,
        status=status,
        group_id=group_id,
        num_tool_calls=calls,
        num_tool_errors=errors,
        messages=messages,
    )


def synthetic_episodes():
    # Task 0: 2/4 correct, task 1: 0/4, task 2: 4/4 (one with shaped reward 0.5: not correct).
    rewards = {0: [1, 0, 1, 0], 1: [0, 0, 0.5, 0], 2: [1, 1, 1, 1]}
    episodes = []
    for group, values in rewards.items():
        for i, reward in enumerate(values):
            episodes.append(
                episode(
                    group,
                    float(reward),
                    turns=1 + i % 2,
                    calls=i % 2,
                    errors=1 if (group, i) == (1, 1) else 0,
                    status=RolloutStatus.TRUNCATED_MAX_TURNS
                    if (group, i) == (1, 3)
                    else RolloutStatus.FINISHED,
                )
            )
    return episodes


def test_report_from_synthetic_trajectories():
    report = build_report(
        synthetic_episodes(), env_id="tir_rl/MathPython-v0", split="test", k=2, wall_time_s=3.5
    )
    assert (report.num_tasks, report.samples_per_task, report.k) == (3, 4, 2)
    # pass@1 per task: 2/4, 0, 1 ; pass@2 per task: 1 - C(2,2)/C(4,2) = 5/6, 0, 1.
    assert report.pass_at_1.value == pytest.approx((0.5 + 0 + 1) / 3)
    assert report.pass_at_k.value == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert report.pass_at_1.low <= report.pass_at_1.value <= report.pass_at_1.high
    assert report.mean_reward == pytest.approx((2 + 0.5 + 4) / 12)
    assert report.mean_turns == pytest.approx(1.5)
    assert report.mean_tool_calls == pytest.approx(0.5)
    assert report.tool_error_rate == pytest.approx(1 / 6)
    assert report.status_counts["finished"] == 11
    assert report.status_counts["truncated_max_turns"] == 1
    assert set(report.status_counts) == {s.value for s in RolloutStatus}

    assert report.task_pass_at_1 == pytest.approx([0.5, 0.0, 1.0])  # in group id order

    data = json.loads(report.to_json())
    assert data["task_pass_at_1"] == pytest.approx([0.5, 0.0, 1.0])
    assert data["pass_at_k"]["value"] == pytest.approx(report.pass_at_k.value)
    assert data["env_id"] == "tir_rl/MathPython-v0" and data["wall_time_s"] == 3.5

    table = format_table(report)
    assert len(table.splitlines()) <= 24 and max(map(len, table.splitlines())) <= 80
    assert "pass@1" in table and "pass@2" in table and "truncated_max_turns" in table
    assert f"{report.pass_at_k.value:.3f}" in table


def test_the_report_states_how_its_episodes_were_sampled():
    sampling = EvalSampling(temperature=0.6, top_p=0.95, top_k=20)
    report = build_report(synthetic_episodes(), env_id="e", split="test", k=1, sampling=sampling)
    data = json.loads(report.to_json())
    assert data["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert "sampling: temperature 0.6, top_p 0.95, top_k 20, min_p 0" in format_table(report)
    assert "top_k off" in EvalSampling(temperature=1.0).describe()


def test_report_rejects_k_above_the_samples_per_task():
    with pytest.raises(ValueError, match="k=5"):
        build_report(synthetic_episodes(), env_id="e", split="test", k=5)
    with pytest.raises(ValueError, match="at least one trajectory"):
        build_report([], env_id="e", split="test", k=1)


def test_success_threshold_decides_what_counts_as_correct():
    report = build_report(
        synthetic_episodes(), env_id="e", split="test", k=1, success_threshold=0.5
    )
    assert report.pass_at_1.value == pytest.approx((0.5 + 0.25 + 1) / 3)
    assert isinstance(report, EvalReport)


def test_num_turns_falls_back_to_turn_ids_without_messages():
    t = Trajectory(
        prompt_ids=[1],
        completion_ids=[5, 6, 7, 8],
        loss_mask=[1, 0, 1, 1],
        sampler_logprobs=[0.0] * 4,
        turn_ids=[0, 0, 1, 2],
    )
    assert num_turns(t) == 3


def test_describe_change_says_whether_the_intervals_overlap():
    before, after = Estimate(0.25, 0.16, 0.36), Estimate(0.55, 0.43, 0.67)
    line = describe_change("held-out pass@1", before, after)
    assert line == (
        "held-out pass@1: 0.250 [0.160, 0.360] -> 0.550 [0.430, 0.670] "
        "(change +0.300; the 95% intervals do not overlap)"
    )
    close = describe_change("held-out pass@1", before, Estimate(0.30, 0.20, 0.41))
    assert close.endswith("(change +0.050; the 95% intervals overlap)")


def test_describe_change_gives_the_paired_change_when_it_has_one():
    before, after = Estimate(0.25, 0.16, 0.36), Estimate(0.33, 0.25, 0.42)
    line = describe_change("held-out pass@1", before, after, Estimate(0.08, 0.02, 0.14))
    assert line == (
        "held-out pass@1: 0.250 [0.160, 0.360] -> 0.330 [0.250, 0.420] "
        "(change +0.080 [+0.020, +0.140], paired over the same tasks)"
    )


def test_describe_change_without_one_side():
    assert describe_change("x", None, None) == "x: not measured"
    assert describe_change("x", Estimate(0.5, 0.4, 0.6), None) == "x: before 0.500 [0.400, 0.600]"
