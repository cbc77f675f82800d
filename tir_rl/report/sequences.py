"""One record per trained sequence and step: its advantage and what the correction did to it.

`sequences.jsonl` in the run folder (`run.save_sequences`) holds, for every sequence of every
step's batch, the GRPO advantage it was trained with, its sampler/trainer log-ratio (the
sequence-level ratio a sequence mask judges is exp of the sum or of the mean), how many of its
model tokens the correction kept, and their mean importance weight. With these, "which
episodes does a sequence mask drop, and with which advantage sign?" is a query over a file,
not a rerun.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tir_rl.mismatch.staleness import token_lags
from tir_rl.trainer.batch import TrainBatch

SEQUENCES_FILE = "sequences.jsonl"


@dataclass(frozen=True)
class SequenceRecord:
    """One sequence of one step's batch."""

    step: int
    """The step (optimizer step count after it, as in `metrics.jsonl`)."""
    group_id: int
    reward: float
    advantage: float | None
    """GRPO advantage; None when the step only scored the batch (no learning signal)."""
    model_tokens: int
    """Sampled tokens (loss mask 1) before the correction."""
    kept_tokens: int | None
    """Model tokens the correction kept (None: the step applied no correction)."""
    is_weight_mean: float | None
    """Mean importance weight over the kept tokens (None: none kept, or no correction)."""
    log_ratio_sum: float
    """Σ (ℓ^old − ℓ^μ) over the model tokens: the log of the sequence's ratio π_old/μ."""
    log_ratio_mean: float
    """The same sum over the model-token count: the log of the geometric-mean ratio."""
    log_ratio_min: float
    log_ratio_max: float
    lag_max: int
    """Largest policy-version lag of its tokens (−1: no version recorded)."""


def sequence_records(
    step: int,
    batch: TrainBatch,
    trainer_logprobs: torch.Tensor,
    *,
    advantages: torch.Tensor | None,
    kept: torch.Tensor | None,
    weights: torch.Tensor | None,
    trained_version: int,
) -> list[SequenceRecord]:
    """The records of one step's batch (rank 0's whole batch; row i is sequence i).

    Args:
        step: the step number logged with the metrics.
        batch: the step's batch.
        trainer_logprobs: [B, T] ℓ^old of the update (or of the scoring pass).
        advantages: [B] the update's advantages; None for a scoring pass.
        kept: [B, T] the loss mask after the correction; None without an update.
        weights: [B, T] the correction's importance weights (0 where rejected); None without.
        trained_version: the policy version the update trained (for the lags).
    """
    mask = batch.loss_mask.bool()
    log_ratio = (trainer_logprobs.float() - batch.sampler_logprobs.float()).masked_fill(~mask, 0)
    lags = token_lags(batch.policy_versions, trained_version).masked_fill(~mask, -1)
    records = []
    for i in range(batch.num_sequences):
        row_mask = mask[i]
        n = int(row_mask.sum())
        ratios = log_ratio[i][row_mask]
        kept_i = int(kept[i].bool().sum()) if kept is not None else None
        weight_mean = None
        if weights is not None and kept is not None and kept_i:
            weight_mean = float(weights[i][kept[i].bool()].mean())
        records.append(
            SequenceRecord(
                step=step,
                group_id=int(batch.group_ids[i]),
                reward=float(batch.rewards[i]),
                advantage=float(advantages[i]) if advantages is not None else None,
                model_tokens=n,
                kept_tokens=kept_i,
                is_weight_mean=weight_mean,
                log_ratio_sum=float(ratios.sum()) if n else 0.0,
                log_ratio_mean=float(ratios.mean()) if n else 0.0,
                log_ratio_min=float(ratios.min()) if n else 0.0,
                log_ratio_max=float(ratios.max()) if n else 0.0,
                lag_max=int(lags[i].max()) if n else -1,
            )
        )
    return records


def append_sequences(path: Path, records: Sequence[SequenceRecord]) -> None:
    """Append `records` to `path` as JSON lines."""
    with path.open("a", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(asdict(record)) + "\n")


def read_sequences(path: Path) -> list[SequenceRecord]:
    """The records of a `sequences.jsonl`, or of its gzip copy `sequences.jsonl.gz`."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        return [SequenceRecord(**json.loads(line)) for line in file if line.strip()]
