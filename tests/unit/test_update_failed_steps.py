"""A step in which no episode sampled a token: skipped, and a run of only such steps refused."""

from __future__ import annotations

import pytest

from tir_rl.errors import TirError
from tir_rl.rl_loop.update import MAX_FAILED_STEPS, StepWork, Update
from tir_rl.trainer import UpdateStatus


class FakeTrainer:
    """Stands in for the trainer: a scoring pass returns a marker and keeps the run's step
    it was given (the guard names its alerts by it)."""

    def __init__(self) -> None:
        self.run_steps: list[int] = []

    def score_step(self, batch, *, guard, run_step):
        self.run_steps.append(run_step)
        return "scored"


def failed(error: str = "") -> StepWork:
    return StepWork(batch=None, advantages=None, first_error=error)


def test_a_run_of_failed_steps_is_refused_with_the_first_error():
    update = Update(FakeTrainer(), guard=None)
    assert update(0, failed("reset raised RuntimeError: gone")).status is UpdateStatus.NO_BATCH
    assert update(1, failed("later error")).status is UpdateStatus.NO_BATCH
    with pytest.raises(TirError, match="2 step") as error:
        update.check_sampled(2)
    assert "reset raised RuntimeError: gone" in str(error.value)


def test_one_step_that_sampled_is_enough_and_failed_steps_in_a_row_stop_the_run():
    trainer = FakeTrainer()
    update = Update(trainer, guard=None)
    update(0, failed())
    assert update(1, StepWork(batch=object(), advantages=None)) == "scored"
    assert trainer.run_steps == [1]
    update.check_sampled(2)  # no error
    for step in range(2, 2 + MAX_FAILED_STEPS - 1):
        update(step, failed())
    with pytest.raises(TirError, match="in a row"):
        update(2 + MAX_FAILED_STEPS, failed())
    Update(FakeTrainer(), guard=None).check_sampled(0)  # a run that took no step: nothing
