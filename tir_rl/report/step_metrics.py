"""The metrics row of one RL step, as the sinks of `run.loggers` record it.

The train loop hands over what the step produced (rollout statistics, the trainer's result,
timings, the parity probe); this module names and derives the columns, so the loop stays a
sequence of stages and every column is defined in one place.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tir_rl.types import one_per_episode

if TYPE_CHECKING:
    import torch

    from tir_rl.engine.parity import ParityReport
    from tir_rl.trainer import StepResult
    from tir_rl.trainer.batch import TrainBatch
    from tir_rl.types import Trajectory


def episode_row(trajectories: Sequence[Trajectory], *, prefix: str) -> dict[str, float]:
    """`prefix/...` statistics of a batch of episodes: rewards, tokens, tool use, statuses.

    Means are per episode: an agent episode's samples (`Trajectory.episode_id`) count once
    for its reward and status, and their tokens and calls add up.
    """
    episodes = one_per_episode(trajectories)
    n = max(len(episodes), 1)
    rewards = [t.reward for t in episodes]
    statuses = Counter(str(t.status) for t in episodes)
    row = {
        f"{prefix}/episodes": float(len(episodes)),
        f"{prefix}/reward_mean": sum(rewards) / n,
        f"{prefix}/reward_max": max(rewards, default=0.0),
        f"{prefix}/model_tokens": float(sum(t.num_model_tokens for t in trajectories)),
        f"{prefix}/completion_tokens_mean": sum(len(t.completion_ids) for t in trajectories) / n,
        f"{prefix}/tool_calls_mean": sum(t.num_tool_calls for t in trajectories) / n,
        f"{prefix}/tool_errors_mean": sum(t.num_tool_errors for t in trajectories) / n,
    }
    for status, count in statuses.items():
        row[f"{prefix}/status/{status}"] = count / n
    reported = [t.timings for t in episodes if t.timings.cached_prompt_tokens is not None]
    if reported:
        sent = sum(t.prompt_tokens for t in reported)
        cached = sum(t.cached_prompt_tokens or 0 for t in reported)
        row[f"{prefix}/prefix_cache_hit"] = cached / sent if sent else float("nan")
    if len(episodes) != len(trajectories):
        row[f"{prefix}/samples_per_episode"] = len(trajectories) / n
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in row.items()}


@dataclass(kw_only=True)
class StepOutcome:
    """What one step did, on rank 0."""

    rollout_row: dict[str, float]
    """`episode_row(..., prefix="rollout")` of the step's episodes, with the buffer's
    `perf/rollout_s` (how long the step waited for them) and `async/...` counts."""
    batch: TrainBatch | None
    """The step's whole batch; None when no episode sampled a token."""
    result: StepResult
    """The trainer's update, its scoring pass (`Trainer.score_step`) when the batch carried
    no learning signal, or `StepResult.no_batch()` when no episode sampled a token."""
    trainer_logprobs: torch.Tensor | None
    """[B, T] trainer logprobs of the whole batch (the update's ℓ^old, or a scoring pass)."""
    num_degenerate_groups: int
    train_s: float
    sync_s: float
    parity: ParityReport | None = None
    """The parity probe after the weight sync; None when no sync ran."""
    kept: torch.Tensor | None = None
    """[B, T] the whole batch's loss mask after the correction; None for a scoring pass."""
    is_weights: torch.Tensor | None = None
    """[B, T] the correction's importance weights (0 where rejected); None likewise."""


def step_row(outcome: StepOutcome) -> dict[str, float]:
    """The step's metrics row (a new dict; `outcome.rollout_row` is left as it was)."""
    row = dict(outcome.rollout_row)
    row.update(outcome.result.row())
    row.update(
        {
            "train/degenerate_groups": float(outcome.num_degenerate_groups),
            "perf/train_s": outcome.train_s,
            "perf/sync_s": outcome.sync_s,
        }
    )
    if outcome.parity is not None:
        row["sync/parity_max_abs_diff"] = outcome.parity.max_abs_diff
        row["sync/parity_mean_abs_diff"] = outcome.parity.mean_abs_diff
    return row


def progress_fields(row: Mapping[str, float]) -> dict[str, str]:
    """The progress bar's fields, read from a step's row where its columns are named."""
    return {
        "reward": f"{row.get('rollout/reward_mean', float('nan')):.3f}",
        "kl": f"{row.get('mismatch/kl', float('nan')):.1e}",
        "tok_s": f"{row.get('perf/rollout_tokens_per_s', float('nan')):.0f}",
    }
