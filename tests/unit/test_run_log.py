"""Run files: the failed episodes of a step are kept with their reasons."""

import json

from tir_rl.report.run_log import append_episode_errors
from tir_rl.types import RolloutStatus, Trajectory


def episode(status: RolloutStatus, error: str | None, episode_id: int) -> Trajectory:
    return Trajectory(
        prompt_ids=[],
        completion_ids=[],
        loss_mask=[],
        sampler_logprobs=[],
        turn_ids=[],
        reward=0.0,
        status=status,
        group_id=4,
        episode_id=episode_id,
        error=error,
    )


def test_only_failed_episodes_are_appended_with_their_reason(tmp_path):
    path = tmp_path / "episode_errors.jsonl"
    append_episode_errors(path, [episode(RolloutStatus.FINISHED, None, 0)], step=1)
    assert not path.exists()  # nothing failed: no file
    failed = episode(RolloutStatus.ERROR_AGENT, "the agent worker died", 1)
    append_episode_errors(path, [episode(RolloutStatus.FINISHED, None, 0), failed], step=2)
    append_episode_errors(path, [failed], step=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"step": s, "group_id": 4, "episode_id": 1, "status": "error_agent",
         "error": "the agent worker died"}
        for s in (2, 3)
    ]  # fmt: skip
