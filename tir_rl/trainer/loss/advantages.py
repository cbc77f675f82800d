"""Group-relative advantages: each sample's reward against its group's (GRPO, Dr. GRPO)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of N samples that come in groups of completions of the same task."""

    advantages: Tensor
    """[N] float; exactly 0 for every sample of a degenerate group."""
    degenerate: Tensor
    """[N] bool; the sample's group has all rewards equal (it contributes no gradient)."""
    num_groups: int
    num_degenerate_groups: int
    """Groups whose rewards are all equal (including groups of one sample)."""


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    episode_ids: Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> GroupAdvantages:
    """Group-relative advantages: reward minus the group mean, optionally over the group std.

    Args:
        rewards: [N] rewards.
        group_ids: [N] integer ids; samples with the same id are completions of one task.
        episode_ids: [N] integer ids, or None (every row is an episode). Rows of one group
            with the same id are samples of one episode (an agent whose history was not
            append-only): they share its reward and advantage, and the episode counts once
            in the group's mean and std.
        normalize_std: divide by the group's (Bessel-corrected) standard deviation + eps,
            as in the GRPO paper; False gives the plain mean baseline (Dr. GRPO).
        eps: added to the std before dividing.
    """
    rewards = rewards.to(torch.float32)
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max().item()) + 1 if group.numel() else 0
    dev = rewards.device
    weight = _first_of_each_episode(group, episode_ids).to(device=dev, dtype=torch.float32)
    counts = torch.zeros(num_groups, device=dev).index_add_(0, group, weight)
    mean = torch.zeros(num_groups, device=dev).index_add_(0, group, rewards * weight) / counts
    centered = rewards - mean[group]
    lo = torch.full((num_groups,), torch.inf, device=dev).scatter_reduce(0, group, rewards, "amin")
    hi = torch.full((num_groups,), -torch.inf, device=dev).scatter_reduce(0, group, rewards, "amax")
    degenerate_group = lo == hi
    if normalize_std:
        sq = torch.zeros(num_groups, device=dev).index_add_(0, group, centered.square() * weight)
        std = (sq / (counts - 1).clamp(min=1)).sqrt()
        centered = centered / (std[group] + eps)
    degenerate = degenerate_group[group]
    advantages = torch.where(degenerate, torch.zeros_like(centered), centered)
    return GroupAdvantages(
        advantages=advantages,
        degenerate=degenerate,
        num_groups=num_groups,
        num_degenerate_groups=int(degenerate_group.sum().item()),
    )


def _first_of_each_episode(group: Tensor, episode_ids: Tensor | None) -> Tensor:
    """[N] 1 at the first row of each (group, episode), 0 at the episode's other samples."""
    n = group.numel()
    if episode_ids is None or n == 0:
        return torch.ones(n)
    pairs = torch.stack([group.cpu(), episode_ids.cpu().to(torch.long)])
    _, episode = torch.unique(pairs, dim=1, return_inverse=True)
    rows = torch.arange(n)
    first = torch.full((int(episode.max()) + 1,), n).scatter_reduce(0, episode, rows, "amin")
    return torch.zeros(n).index_fill_(0, first, 1.0)
