"""What one trainer step did: its status, its global figures and its metric columns.

`StepResult` is the typed outcome of `Trainer.train_step` and `Trainer.score_step`; its
`row()` is the one place the update's `train/loss`, `train/grad_norm` and `train/skipped`
columns are named. `combine_loss_metrics` folds the loss's per-micro-batch metrics
(`tir_rl.trainer.loss.LOSS_METRICS`, where each is declared with its reduction) into this
rank's row. `UpdatePass`, `StepTotals` and `StepClock` are what a train step keeps on its
way to its result: the micro-batch loop's sums, the global figures, the stage timings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from tir_rl.metric import Metric, ReduceOp
from tir_rl.mismatch import CorrectionResult
from tir_rl.mismatch.guard import GuardAction, GuardDecision
from tir_rl.trainer.loss.base import LOSS_METRICS, LOSS_TOKENS


class UpdateStatus(StrEnum):
    """What a step did with its gradient."""

    APPLIED = "applied"
    """The optimizer stepped."""
    NONFINITE = "skipped_nonfinite"
    """The loss or the gradient norm was not finite: no update."""
    ALL_REJECTED = "skipped_all_rejected"
    """The correction rejected every token: the gradient is zero, and AdamW would still move
    the weights (momentum, weight decay), so no update."""
    GUARD = "skipped_guard"
    """The collapse guard held the update back."""
    SCORED = "scored"
    """A scoring pass (`Trainer.score_step`): a batch without learning signal, measured only."""
    NO_BATCH = "no_batch"
    """No episode sampled a token: there was nothing to train on or score."""


SKIP_COUNTS = (UpdateStatus.NONFINITE, UpdateStatus.GUARD, UpdateStatus.ALL_REJECTED)
"""The statuses a trainer counts over its life (`train/<status>` columns, in checkpoints)."""


def update_columns(loss: float, grad_norm: float) -> dict[str, float]:
    """The update's global loss and pre-clip gradient norm, as metric columns."""
    return {"train/loss": loss, "train/grad_norm": grad_norm}


@dataclass
class StepResult:
    """What one `train_step` did, or one `score_step` (a batch without learning signal)."""

    loss: float
    """Global loss (sum over micro-batches and ranks of the globally normalized loss); NaN
    when no update was computed."""
    grad_norm: float
    """Global gradient L2 norm before clipping; NaN when no update was computed."""
    status: UpdateStatus
    metrics: dict[str, float] = field(default_factory=dict)
    """The other `train/...` and the `mismatch/...` metrics, identical on every rank (a
    scoring pass has the `mismatch/...` ones only)."""
    guard: GuardDecision | None = None
    """The collapse guard's verdict, when a guard was given."""
    logprobs: torch.Tensor | None = None
    """[B, T] float32 (CPU) trainer logprobs ℓ^old the step used: the given `old_logprobs`
    (as given: every completion token when they come from `compute_logprobs`), or, in the
    one-pass path, the update forward's own detached ℓ^θ of the model tokens (loss mask 1)
    only, 0 at tool/rendered tokens and past each completion's end (lm_head runs only where
    the update uses a logprob). Only loss-mask-1 values are meaningful to the mismatch
    metrics, the correction and the loss."""
    correction: CorrectionResult | None = None
    """This rank's rows as the update's correction left them (kept mask, importance weights);
    None when no update was computed."""

    @classmethod
    def no_batch(cls) -> StepResult:
        """The result of a step in which no episode sampled a token."""
        return cls(math.nan, math.nan, UpdateStatus.NO_BATCH)

    @property
    def skipped(self) -> bool:
        """True when no optimizer step was applied (a scoring pass never updates)."""
        return self.status is not UpdateStatus.APPLIED

    @property
    def stop(self) -> bool:
        """Whether the guard asked the loop to checkpoint and stop."""
        return self.guard is not None and self.guard.action is GuardAction.STOP

    def row(self) -> dict[str, float]:
        """Every metric column of the step: `metrics`, the loss, gradient norm and skip flag."""
        columns = {**self.metrics, **update_columns(self.loss, self.grad_norm)}
        columns["train/skipped"] = float(self.skipped)
        if self.guard is not None:
            columns["guard/alerts"] = float(len(self.guard.alerts))
        return columns

    def gathered_rows(self) -> tuple[torch.Tensor | None, ...]:
        """This rank's per-sequence tensors rank 0 keeps: ℓ^old, the kept mask, the weights."""
        correction = self.correction
        if correction is None:
            return self.logprobs, None, None
        return self.logprobs, correction.loss_mask.float(), correction.weights


def combine_loss_metrics(rows: Sequence[torch.Tensor]) -> dict[str, Metric]:
    """This rank's loss metrics: its micro-batches' rows combined as `LOSS_METRICS` declares.

    Each row is [loss-token count, *values in `LOSS_METRICS` order]; micro-batches without
    tokens are ignored. Means are token-weighted; `LOSS_TOKENS`, this rank's total, weighs
    its means and bounds its extremes across ranks.
    """
    if not rows:
        return {}
    table = torch.stack([row.cpu() for row in rows]).tolist()
    total = sum(row[0] for row in table)
    out: dict[str, Metric] = {LOSS_TOKENS: Metric.count(total)}
    for column, metric in enumerate(LOSS_METRICS, start=1):
        if metric.reduce is None or metric.reduce is ReduceOp.SUM:  # the loss; the count
            continue
        values = [(row[0], row[column]) for row in table if row[0] > 0]
        if not values:
            continue
        if metric.reduce is ReduceOp.MAX:
            out[metric.key] = Metric.max(max(v for _, v in values), LOSS_TOKENS)
        elif metric.reduce is ReduceOp.MIN:
            out[metric.key] = Metric.min(min(v for _, v in values), LOSS_TOKENS)
        else:
            mean = sum(w * v for w, v in values) / max(total, 1e-12)
            out[metric.key] = Metric.mean(mean, LOSS_TOKENS)
    return out


@dataclass
class StepTotals:
    """A train step's global figures, identical on every rank (before its result is made)."""

    loss: float
    grad_norm: float
    num_loss_tokens: int
    num_tokens_computed: int
    """Every token of the ranks' batches (prompt, completion, padding the packer kept)."""
    metrics: dict[str, float]
    ess_ratio: float = 1.0
    """VCPO's ESS ratio of the step's sequence weights (`tir_rl.trainer.ess_step`)."""

    @property
    def finite(self) -> bool:
        """Whether the loss and the gradient norm are finite numbers."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class StepClock:
    """Seconds since the step started, at the marks of its stages."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        """`stage` ends now."""
        self.marks[stage] = time.perf_counter()

    def metrics(self) -> dict[str, float]:
        """`train/<stage>_s` for each stage (from the previous mark) and `train/step_s`."""
        out, previous = {}, self.start
        for stage, at in self.marks.items():
            out[f"train/{stage}_s"] = at - previous
            previous = at
        out["train/step_s"] = previous - self.start
        return out


@dataclass
class UpdatePass:
    """What the micro-batch loop of one step leaves behind."""

    logprobs: torch.Tensor
    """[B, T] float32 CPU, detached ℓ^θ of the model tokens (loss mask 1); 0 elsewhere."""
    sums: torch.Tensor
    """[3] float64 on the device: unnormalized loss sum, entropy sum over model tokens, and
    the model tokens outside the replayed kept set."""
    metric_rows: list[torch.Tensor]
    """Per micro-batch, on the device: [1 + len(LOSS_METRICS)], its loss-token count first."""
    corrected: CorrectionResult | None
    """The batch's correction as the micro-batches computed it, or None when the whole batch
    was corrected before the loop."""
