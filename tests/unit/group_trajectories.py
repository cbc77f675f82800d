"""GRPO groups of trajectories for the packing tests: a shared prompt, several completions."""

from __future__ import annotations

from tir_rl.types import Trajectory


def group_batch(
    prompt_len: int, completions: list[list[int]], *, group_id: int = 0
) -> list[Trajectory]:
    """One group: the same prompt, then each sample's completion (every token sampled)."""
    return [
        Trajectory(
            prompt_ids=list(range(100, 100 + prompt_len)),
            completion_ids=c,
            loss_mask=[1] * len(c),
            sampler_logprobs=[-1.0] * len(c),
            turn_ids=[0] * len(c),
            group_id=group_id,
        )
        for c in completions
    ]
