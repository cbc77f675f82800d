"""`run.placebo_drop`: a control that leaves episodes out of the update by advantage sign alone."""

import pytest
import torch

from tir_rl.config import load
from tir_rl.errors import ConfigError
from tir_rl.rl_loop.step_plan import PlaceboDrop, placebo_generator, plan_step
from tir_rl.run_config import RunConfig
from tir_rl.types import Trajectory


def traj(reward: float, group: int) -> Trajectory:
    return Trajectory(
        prompt_ids=[100, 101],
        completion_ids=[1, 2, 3],
        loss_mask=[1, 1, 1],
        sampler_logprobs=[-1.0, -1.0, -1.0],
        turn_ids=[0, 0, 0],
        reward=reward,
        group_id=group,
    )


def groups(n_groups: int) -> list[Trajectory]:
    """Each group: one success and three failures (A > 0 once, A < 0 three times)."""
    return [traj(float(i == 0), g) for g in range(n_groups) for i in range(4)]


def test_without_a_placebo_every_trainable_episode_is_trained():
    plan, _ = plan_step(groups(2))
    assert plan.in_batch == list(range(8))
    assert "train/placebo_dropped_episodes" not in plan.row


@pytest.mark.parametrize(("p_failed", "p_succeeded"), [(1.0, 0.0), (0.0, 1.0)])
def test_the_placebo_drops_by_the_sign_of_the_advantage(p_failed, p_succeeded):
    trajectories = groups(3)
    placebo = PlaceboDrop(p_failed, p_succeeded, placebo_generator(0, 1))
    plan, works = plan_step(trajectories, placebo=placebo)
    kept = [trajectories[i].reward for i in plan.in_batch]
    assert kept == ([1.0] * 3 if p_failed == 1.0 else [0.0] * 9)
    assert plan.row["train/placebo_dropped_episodes"] == (9.0 if p_failed == 1.0 else 3.0)
    assert plan.row["train/dropped_episodes"] == plan.row["train/placebo_dropped_episodes"]
    # the kept episodes keep the advantages their whole group gave them
    assert works[0].advantages is not None
    assert bool(((works[0].advantages > 0) == (p_failed == 1.0)).all())


def test_the_placebo_drops_about_its_share_and_repeats_for_a_seed_and_step():
    trajectories = groups(100)
    drawn = [
        plan_step(trajectories, placebo=PlaceboDrop(0.5, 0.2, placebo_generator(seed, 7)))[0]
        for seed in (0, 0, 1)
    ]
    assert drawn[0].in_batch == drawn[1].in_batch != drawn[2].in_batch
    failed = [i for i in drawn[0].in_batch if trajectories[i].reward == 0.0]
    succeeded = [i for i in drawn[0].in_batch if trajectories[i].reward == 1.0]
    assert 0.4 < len(failed) / 300 < 0.6 and 0.7 < len(succeeded) / 100 < 0.9


def test_a_placebo_that_is_not_two_probabilities_is_refused():
    with pytest.raises(ConfigError, match="placebo_drop"):
        load(RunConfig, "configs/lab_sft.yaml", ["run.placebo_drop=[1.5, 0.2]"])
    config = load(RunConfig, "configs/lab_sft.yaml", ["run.placebo_drop=[0.7, 0.2]"])
    assert config.run.placebo_drop == (0.7, 0.2)


def test_the_generator_depends_on_seed_and_step_only():
    draw = [torch.rand(4, generator=placebo_generator(s, t)) for s, t in ((3, 5), (3, 5), (3, 6))]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2])
