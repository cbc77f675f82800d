"""Rank 0's plan of a step: GRPO advantages, the batch, and each rank's share of it.

`plan_step` turns one step's trajectories into the advantages, the batch (leaving out
degenerate groups and, under `run.placebo_drop`, a random share of episodes) and each
rank's `StepWork`; rank 0 runs it and hands the shares out (`tir_rl.rl_loop.rank0`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tir_rl import distributed as tdist
from tir_rl.rl_loop.update import StepWork
from tir_rl.trainer.batch import TrainBatch
from tir_rl.types import Trajectory


@dataclass
class StepPlan:
    """Rank 0's view of a step's batch."""

    trajectories: list[Trajectory]
    in_batch: list[int]
    """Indices of the trajectories in the batch (scored, and trained on when they carry signal)."""
    batch: TrainBatch | None
    row: dict[str, float]
    num_degenerate_groups: int
    advantages: torch.Tensor | None = None
    """[len(in_batch)] the batch's advantages; None when the step only scores it."""
    token_lags: torch.Tensor | None = None
    """[B, T] each token's policy lag behind the weights it is trained from (rank 0 sets it
    when it takes the step; None without a batch)."""


@dataclass(frozen=True)
class PlaceboDrop:
    """`run.placebo_drop`: leave failed and succeeded episodes out of the update at random."""

    p_failed: float
    p_succeeded: float
    generator: torch.Generator
    """The step's own draws (`placebo_generator`)."""

    def keep(self, advantages: torch.Tensor) -> torch.Tensor:
        """[n] bool: which of the episodes with these advantages stay in the update."""
        p_drop = torch.where(advantages < 0, self.p_failed, 0.0)
        p_drop = torch.where(advantages > 0, self.p_succeeded, p_drop)
        return torch.rand(advantages.shape, generator=self.generator) >= p_drop


SEED_STRIDE = 1_000_003
"""A run seed's own range: the task seeds of run seed s start at s · SEED_STRIDE (task i has
seed s · SEED_STRIDE + i), and so do its per-step placebo draws."""


def task_seed(run_seed: int, index: int) -> int:
    """The reset seed of task `index` of run seed `run_seed`'s task stream."""
    return run_seed * SEED_STRIDE + index


def placebo_generator(seed: int, step: int) -> torch.Generator:
    """A step's placebo draws: the same for the same seed and step, whatever ran before."""
    return torch.Generator().manual_seed(task_seed(seed, step))


def plan_step(
    trajectories: list[Trajectory],
    *,
    world_size: int = 1,
    drop_degenerate_groups: bool = True,
    placebo: PlaceboDrop | None = None,
) -> tuple[StepPlan, list[StepWork]]:
    """Advantages, the batch and each rank's share of it, from one step's trajectories.

    Rank r trains on the r-th of `world_size` contiguous, near-equal slices of the batch.
    When there are fewer sequences than ranks, a rank without one gets a copy of the first
    sequence with an empty loss mask: it runs the passes FSDP2 needs and adds nothing to
    the loss or the token count (its per-rank metrics still enter the rank average).
    A `placebo` leaves some trainable episodes out after the advantages are computed (their
    group baselines stay as they were, as under a sequence mask).
    """
    from tir_rl.trainer.loss.advantages import group_advantages

    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
    episodes = torch.tensor(  # a trajectory without an episode id is an episode of its own
        [i if t.episode_id is None else -1 - t.episode_id for i, t in enumerate(trajectories)]
    )
    adv = group_advantages(rewards, groups, episode_ids=episodes, normalize_std=True)
    # Episodes that sampled nothing (e.g. the env failed to reset) carry no gradient;
    # they still count in their group's baseline above, as the failures they are.
    sampled = [i for i, t in enumerate(trajectories) if t.num_model_tokens > 0]
    trainable = sampled
    if drop_degenerate_groups:
        trainable = [i for i in sampled if not bool(adv.degenerate[i])]
    row: dict[str, float] = {}
    if placebo is not None:
        kept = placebo.keep(adv.advantages[trainable]).tolist() if trainable else []
        row["train/placebo_dropped_episodes"] = float(len(trainable) - sum(kept))
        trainable = [i for i, keep in zip(trainable, kept, strict=True) if keep]
    in_batch = trainable or sampled
    row["train/dropped_episodes"] = float(len(trajectories) - len(trainable))
    batch = TrainBatch.from_trajectories([trajectories[i] for i in in_batch]) if in_batch else None
    plan = StepPlan(trajectories, in_batch, batch, row, int(adv.num_degenerate_groups))
    if batch is None:
        errors = [t.error for t in trajectories if t.error]
        return plan, [StepWork(None, None, errors[0] if errors else "")] * world_size
    advantages = adv.advantages[trainable] if trainable else None
    plan.advantages = advantages
    if world_size == 1:
        return plan, [StepWork(batch, advantages)]
    works = []
    for piece in tdist.even_split(batch.num_sequences, world_size):
        if len(piece):
            share = batch.select(piece)
            part = advantages[piece.start : piece.stop] if advantages is not None else None
        else:
            share = batch.select([0])
            share.loss_mask = torch.zeros_like(share.loss_mask)
            part = torch.zeros(1) if advantages is not None else None
        works.append(StepWork(share, part))
    return plan, works
