"""One rank of `tir-rl train` under torchrun, for test_train_fsdp2.py.

Registers a fake env whose reward differs within a group (a random tiny model never solves
MultiHop) and saves each step's trajectories as `trajectories_stepN.pt` in the run folder,
so the test can replay step 1 in one process.

With `TIR_TEST_RANK_DIR` set, each rank writes its output to `rank{R}.log`, its pid to
`rank{R}.pid`, its node rank and the ranks on its node to `rank{R}.place`, and its exit
status to `rank{R}.exit` there (no `.exit` file: the rank was
killed). With `TIR_TEST_PARITY_FAILS_AT_SYNC=N`, the N-th parity probe of the run (1-based)
raises a ParityError, as a real sampler/trainer disagreement would. With
`TIR_TEST_HOLD_BEFORE_STEP=N`, rank 0 waits before taking step N until the file
`interrupt_sent` appears in the rank folder (the test writes it once it has sent Ctrl-C), so
that the interrupt lands between steps N-1 and N however fast the steps are.

Usage: python -m torch.distributed.run --nproc-per-node 2 fsdp2_train_worker.py train ...
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import gymnasium
import torch

from tir_rl import cli
from tir_rl.engine import parity
from tir_rl.envs.multihop import MultiHopEnv
from tir_rl.errors import ParityError
from tir_rl.rl_loop import rank0

FAKE_ENV_ID = "tests/FakeParityRewardFsdp-v0"
INJECTED_PARITY_MESSAGE = "injected parity failure for the test"


class FakeParityRewardEnv(MultiHopEnv):
    """MultiHop prompts; every turn ends the episode with a reward hashed from its text."""

    def step(self, action):
        reward = (sum(map(ord, action.content)) % 97) / 97
        return [], reward, True, False, {}


def _record_trajectories() -> None:
    take_step = rank0.Rank0Driver.take_step

    def recording_take_step(self, step, **kwargs):
        plan, works = take_step(self, step, **kwargs)
        torch.save(plan.trajectories, self.run_dir / f"trajectories_step{step + 1}.pt")
        return plan, works

    rank0.Rank0Driver.take_step = recording_take_step


def _hold_before(step_number: int, rank_dir: Path) -> None:
    take_step = rank0.Rank0Driver.take_step

    def held_take_step(self, step, **kwargs):
        if step + 1 == step_number:
            deadline = time.monotonic() + 300
            while not (rank_dir / "interrupt_sent").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        return take_step(self, step, **kwargs)

    rank0.Rank0Driver.take_step = held_take_step


def _fail_parity_at(sync: int) -> None:
    probe = parity.probe_parity
    calls = 0

    async def failing_probe(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == sync:
            raise ParityError(f"{INJECTED_PARITY_MESSAGE} (probe {calls})")
        return await probe(*args, **kwargs)

    parity.probe_parity = failing_probe


def main(argv: list[str]) -> int:
    gymnasium.register(id=FAKE_ENV_ID, entry_point=FakeParityRewardEnv)
    _record_trajectories()
    if "TIR_TEST_PARITY_FAILS_AT_SYNC" in os.environ:
        _fail_parity_at(int(os.environ["TIR_TEST_PARITY_FAILS_AT_SYNC"]))
    rank_dir = os.environ.get("TIR_TEST_RANK_DIR")
    if "TIR_TEST_HOLD_BEFORE_STEP" in os.environ:
        assert rank_dir is not None, "TIR_TEST_HOLD_BEFORE_STEP needs TIR_TEST_RANK_DIR"
        _hold_before(int(os.environ["TIR_TEST_HOLD_BEFORE_STEP"]), Path(rank_dir))
    if rank_dir is None:
        return cli.main(argv)
    rank = os.environ.get("RANK", "0")
    base = Path(rank_dir) / f"rank{rank}"
    log = open(f"{base}.log", "w")  # noqa: SIM115 (stays open as the rank's stdout/stderr)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    Path(f"{base}.pid").write_text(str(os.getpid()))
    Path(f"{base}.place").write_text(f"{os.environ['GROUP_RANK']} {os.environ['LOCAL_WORLD_SIZE']}")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    code: int | str | None = 1
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # SIGTERM (`tir_rl.process.termination.exit_on_sigterm`)
        code = exc.code
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        Path(f"{base}.exit").write_text(str(code))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
