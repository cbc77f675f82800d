"""The update every rank runs on its share of a step's batch.

`StepWork` is what a rank gets from rank 0 (`tir_rl.rl_loop.step_plan` plans it); `Update` is
what every rank does with it: the trainer's step (recompute ℓ^old, measure and correct the
mismatch, PPO-clip loss, AdamW), or a scoring pass when the batch carries no learning signal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tir_rl import distributed as tdist
from tir_rl.errors import TirError
from tir_rl.mismatch.guard import CollapseGuard
from tir_rl.trainer import StepResult, Trainer
from tir_rl.trainer.batch import TrainBatch

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3
"""Steps in a row without a trainable episode after which the run stops."""


@dataclass
class StepWork:
    """What one rank gets from rank 0 for a step: its share of the batch, or none."""

    batch: TrainBatch | None
    """This rank's sequences; None when no episode of the step sampled a token."""
    advantages: torch.Tensor | None
    """[b] advantages of `batch`; None when the step only scores the batch (no signal)."""
    first_error: str = ""
    """The first episode error of a step without any sampled token."""


class Update:
    """Every rank's part of a step: the trainer's update (or scoring pass) on its share."""

    def __init__(self, trainer: Trainer, guard: CollapseGuard) -> None:
        self.trainer = trainer
        self.guard = guard
        self._failed_in_a_row = 0
        self.steps_with_tokens = 0
        """Steps in which at least one episode sampled a token."""
        self.first_error: str | None = None
        """The first episode error of the first step that sampled nothing."""

    def check_sampled(self, steps_run: int) -> None:
        """Refuse to end a run in which no episode of any step sampled a token.

        Raises:
            TirError: `steps_run` > 0 steps ran (in this process: a resumed run counts from
                its checkpoint) and none had a trainable episode.
        """
        if steps_run and not self.steps_with_tokens:
            raise TirError(
                f"No episode of this run's {steps_run} step(s) sampled a token: nothing was "
                f"trained. First error: {self.first_error or 'none recorded'}. Run `tir-rl "
                "rollout --config ...` or `tir-rl doctor --config ...` to inspect the episodes."
            )

    def __call__(self, step: int, work: StepWork) -> StepResult:
        """Recompute ℓ^old, measure and correct the mismatch, update; see `Trainer.train_step`.

        Returns the trainer's result (a scoring pass, `Trainer.score_step`, when the batch
        carries no learning signal), or `StepResult.no_batch()` when no episode sampled a token.

        Raises:
            TirError: `MAX_FAILED_STEPS` steps in a row had no trainable episode.
        """
        if work.batch is None:
            self._failed_in_a_row += 1
            self.first_error = self.first_error or work.first_error
            if tdist.is_rank0():
                logger.warning(
                    "step %d: no episode sampled any token; skipping the update. First error: %s",
                    step, work.first_error or "none recorded",
                )  # fmt: skip
            if self._failed_in_a_row >= MAX_FAILED_STEPS:
                raise TirError(
                    f"{MAX_FAILED_STEPS} steps in a row produced no trainable episode. First "
                    f"error: {work.first_error or 'none recorded'}. Run `tir-rl rollout "
                    "--config ...` or `tir-rl doctor --config ...` to inspect the episodes."
                )
            return StepResult.no_batch()
        self._failed_in_a_row = 0
        self.steps_with_tokens += 1
        if work.advantages is None:  # no signal: score the batch; the guard still watches it
            return self.trainer.score_step(work.batch, guard=self.guard, run_step=step)
        # One forward per micro-batch; its detached logprobs are ℓ^old.
        return self.trainer.train_step(work.batch, work.advantages, guard=self.guard, run_step=step)
