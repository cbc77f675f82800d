"""One rank of `tir-rl train` under torchrun, for test_train_fsdp2.py.

Registers a fake env whose reward differs within a group (a random tiny model never solves
MultiHop) and saves each step's trajectories as `trajectories_stepN.pt` in the run folder,
so the test can replay step 1 in one process.

Usage: python -m torch.distributed.run --nproc-per-node 2 fsdp2_train_worker.py train ...
"""

from __future__ import annotations

import sys

import gymnasium
import torch

from tir_rl import cli, train
from tir_rl.envs.multihop import MultiHopEnv

FAKE_ENV_ID = "tests/FakeParityRewardFsdp-v0"


class FakeParityRewardEnv(MultiHopEnv):
    """MultiHop prompts; every turn ends the episode with a reward hashed from its text."""

    def step(self, action):
        reward = (sum(map(ord, action.content)) % 97) / 97
        return [], reward, True, False, {}


def main(argv: list[str]) -> int:
    gymnasium.register(id=FAKE_ENV_ID, entry_point=FakeParityRewardEnv)
    rollouts = train._TrainLoop._rollouts

    def recording_rollouts(self, step):
        plan, works = rollouts(self, step)
        torch.save(plan.trajectories, self.run_dir / f"trajectories_step{step + 1}.pt")
        return plan, works

    train._TrainLoop._rollouts = recording_rollouts
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
