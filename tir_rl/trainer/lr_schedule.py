r"""Learning-rate schedules of the RL trainer: constant or cosine, each with a linear warm-up.

The trainer sets its optimizer's learning rate to ``lr · lr_factor(s, ...)`` before the
optimizer step of its ``s``-th `train_step` call (s = 0, 1, ...; `Trainer.step`, saved in
checkpoints, so a resumed run continues the schedule). With W warm-up steps, S schedule
steps and floor r (``min_lr_ratio``)::

    s < W:   (s + 1) / (W + 1)                               linear warm-up (both kinds)
    constant, s ≥ W:  1
    cosine,   s ≥ W:  r + (1 − r) · ½ (1 + cos(π · min(1, (s − W) / (S − W))))

so cosine reaches ``r · lr`` at step S and stays there. A linear warm-up followed by a
constant rate is ``constant`` with W > 0.
"""

from __future__ import annotations

import math
from enum import StrEnum

from tir_rl.errors import ConfigError


class LRSchedule(StrEnum):
    """The shape of the learning rate after the warm-up."""

    CONSTANT = "constant"
    """The configured lr (after the warm-up, if any)."""
    COSINE = "cosine"
    """Cosine decay from lr to ``min_lr_ratio · lr`` at ``schedule_steps``."""


def check_schedule(
    schedule: LRSchedule, *, warmup_steps: int, schedule_steps: int, min_lr_ratio: float
) -> None:
    """Refuse inconsistent schedule settings (`schedule_steps` 0 means "not known yet").

    Raises:
        ConfigError: naming the `trainer.` key that is wrong and what to set.
    """
    schedule = LRSchedule(schedule)
    if warmup_steps < 0 or schedule_steps < 0:
        raise ConfigError(
            f"trainer.warmup_steps={warmup_steps} and trainer.schedule_steps={schedule_steps} "
            "must be >= 0"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"trainer.min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if schedule is LRSchedule.CONSTANT:
        for key, value, default in (
            ("schedule_steps", schedule_steps, 0),
            ("min_lr_ratio", min_lr_ratio, 0.0),
        ):
            if value != default:
                raise ConfigError(
                    f"trainer.{key}={value} has no effect with trainer.lr_schedule=constant: "
                    f"set trainer.lr_schedule=cosine, or leave {key} at {default}"
                )
    elif schedule_steps and warmup_steps >= schedule_steps:
        raise ConfigError(
            f"trainer.warmup_steps={warmup_steps} must be smaller than trainer.schedule_steps="
            f"{schedule_steps} (the cosine decays over the steps after the warm-up)"
        )


def lr_factor(
    step: int,
    schedule: LRSchedule,
    *,
    warmup_steps: int = 0,
    schedule_steps: int = 0,
    min_lr_ratio: float = 0.0,
) -> float:
    """The multiplier of the base lr at optimizer step `step` (see the module docstring).

    Raises:
        ConfigError: cosine without `schedule_steps`, or settings `check_schedule` refuses.
    """
    check_schedule(
        schedule,
        warmup_steps=warmup_steps,
        schedule_steps=schedule_steps,
        min_lr_ratio=min_lr_ratio,
    )
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if LRSchedule(schedule) is LRSchedule.CONSTANT:
        return 1.0
    if schedule_steps == 0:
        raise ConfigError(
            "trainer.lr_schedule=cosine needs trainer.schedule_steps (the step where the decay "
            "ends); a run config sets it to run.steps when it is left at 0"
        )
    progress = min(1.0, (step - warmup_steps) / (schedule_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
