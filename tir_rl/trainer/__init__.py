"""The learning stage: a batch of trajectories in, one optimizer step on the policy out.

`Trainer` (`trainer.py`) runs the step: micro-batches planned by `batch.py`, per-token
logprobs and entropy from `token_stats.py`, the mismatch correction (`tir_rl.mismatch`), the
policy loss (`loss/`, chosen by `loss.name`), AdamW with clipping (`optimizer.py`) at the rate of
`lr_schedule.py`, the frozen reference policy of a KL penalty (`reference.py`) and LoRA
(`lora.py`); its outcome is a `StepResult` (`step_result.py`). `checkpoint.py` saves and
resumes the trainer's state and writes the Hugging Face model folder SFT writes too.
"""

from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.trainer.loss.base import PolicyLoss
from tir_rl.trainer.lr_schedule import LRSchedule
from tir_rl.trainer.step_result import StepResult, UpdateStatus
from tir_rl.trainer.trainer import Trainer

__all__ = [
    "LRSchedule",
    "Packing",
    "PolicyLoss",
    "StepResult",
    "TrainBatch",
    "Trainer",
    "UpdateStatus",
]
