"""Shared builders for the trainer tests: tiny model, multi-turn trajectories."""

from __future__ import annotations

import random

import torch

from tir_rl.trainer.batch import TrainBatch
from tir_rl.types import Trajectory


def multi_turn_trajectory(
    rng: random.Random, *, prompt_len: int, turn_lens: list[int], tool_len: int = 3
) -> Trajectory:
    """Assistant turns (mask 1) separated by rendered tool tokens (mask 0, garbage logprobs)."""
    completion, mask, logprobs, turns = [], [], [], []
    for turn, n in enumerate(turn_lens):
        if turn:
            completion += [rng.randrange(1, 2000) for _ in range(tool_len)]
            mask += [0] * tool_len
            logprobs += [0.0] * tool_len
            turns += [turn - 1] * tool_len
        completion += [rng.randrange(1, 2000) for _ in range(n)]
        mask += [1] * n
        logprobs += [-7.0] * n
        turns += [turn] * n
    return Trajectory(
        prompt_ids=[rng.randrange(1, 2000) for _ in range(prompt_len)],
        completion_ids=completion,
        loss_mask=mask,
        sampler_logprobs=logprobs,
        turn_ids=turns,
    )


def make_batch(seed: int = 0, shapes=((6, [5, 4]), (3, [9]), (10, [2, 3, 2]), (4, [7]))):
    rng = random.Random(seed)
    return TrainBatch.from_trajectories(
        [multi_turn_trajectory(rng, prompt_len=p, turn_lens=t) for p, t in shapes]
    )


def with_sampler_logprobs(batch: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    """The same batch with the sampler logprobs replaced where the mask is 1."""
    sampler = torch.where(batch.loss_mask, logprobs, batch.sampler_logprobs)
    return TrainBatch(**{**batch.__dict__, "sampler_logprobs": sampler})


def make_group_batch(
    seed: int = 0, groups: tuple[tuple[int, int], ...] = ((12, 3), (7, 4), (9, 1))
) -> TrainBatch:
    """GRPO groups: per (prompt length, G), G multi-turn samples of one shared prompt.

    Every other sample of a group opens with the same two sampled tokens, so the group's
    common prefix sometimes reaches past the prompt into the completions.
    """
    rng = random.Random(seed)
    trajectories = []
    for group_id, (prompt_len, size) in enumerate(groups):
        prompt = [rng.randrange(1, 2000) for _ in range(prompt_len)]
        opening = [rng.randrange(1, 2000) for _ in range(2)]
        for sample in range(size):
            t = multi_turn_trajectory(
                rng, prompt_len=1, turn_lens=[rng.randint(2, 6), rng.randint(1, 5)]
            )
            lead = opening if sample % 2 == 0 else []
            trajectories.append(
                Trajectory(
                    prompt_ids=prompt,
                    completion_ids=lead + t.completion_ids,
                    loss_mask=[1] * len(lead) + t.loss_mask,
                    sampler_logprobs=[-7.0] * len(lead) + t.sampler_logprobs,
                    turn_ids=[0] * len(lead) + t.turn_ids,
                    group_id=group_id,
                )
            )
    return TrainBatch.from_trajectories(trajectories)
