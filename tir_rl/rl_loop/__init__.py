"""The training entry point: `run_train(config)` (see `tir_rl.rl_loop.loop` for the loop).

`loop` is the step sequence every rank runs, `rank0` the driver of rollouts, evaluation and
logging that only rank 0 runs, `step_plan` rank 0's plan of a step's batch and each rank's
share, `update` the update every rank runs on its share.
"""

from tir_rl.rl_loop.loop import (
    TrainSummary,
    exec_under_torchrun,
    load_resume_config,
    run_train,
)
from tir_rl.rl_loop.step_plan import plan_step
from tir_rl.trainer.checkpoint import latest_checkpoint

__all__ = [
    "TrainSummary",
    "exec_under_torchrun",
    "latest_checkpoint",
    "load_resume_config",
    "plan_step",
    "run_train",
]
