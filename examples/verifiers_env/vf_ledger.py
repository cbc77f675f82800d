"""vf-ledger: a multi-turn `verifiers` 0.4.0 environment whose tool keeps state across turns.

Each task lists 2-4 amounts and asks the model to enter them in a ledger one at a time with
the `add` tool, then to answer with the final total in `<total>` tags. The ledger is a
taskset-scoped verifiers toolset (`Ledger`, declared in `LedgerTaskset.toolsets`): one MCP
tool server that verifiers starts once for the environment, in a local subprocess, and that
every episode calls. Its tools read and write the calling episode's `LedgerState`, which
verifiers keeps per episode (through its signed per-episode state channel) across the
episode's turns and hands to the rubric. The rewards: `total` (1 when the answer is the sum)
and `entered` (the amounts entered in order, as a share of the amounts or of the entries,
whichever is more; read from the state, so an answer computed without the tool scores 0
there). `@vf.stop` ends the episode after `MAX_TURNS` model turns; otherwise it ends when the
model answers without a tool call.

It runs in the verifiers virtual environment (`scripts/setup_verifiers.sh`); `worker.py
--env vf_ledger` plays it. verifiers starts the tool server as ``python -m vf_ledger``, so
this folder must be on `PYTHONPATH` (`vf_play.prepare_process_env` puts it there).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

__all__ = ["LedgerTaskset"]

SYSTEM = (
    "You keep a ledger. Enter every amount with the add tool, one call per amount, in the "
    "order given. Then answer with the final total in <total></total> tags."
)
MAX_TURNS = 6
_TOTAL = re.compile(r"<total>\s*(-?\d+)\s*</total>")


class LedgerState(vf.State):
    entries: list[int] = []
    """The amounts entered so far, in order."""


class Ledger(vf.Toolset[vf.ToolsetConfig, LedgerState]):
    """The episode's ledger: `add` an amount, read the `balance`."""

    TOOL_PREFIX = None  # the model calls `add` and `balance`, not `ledger_add`

    @vf.tool
    async def add(self, amount: int) -> str:
        """Enter one amount in the ledger; returns the new balance."""
        self.state.entries = [*self.state.entries, amount]
        return str(sum(self.state.entries))

    @vf.tool
    async def balance(self) -> str:
        """The ledger's balance so far."""
        return str(sum(self.state.entries))


class LedgerData(vf.TaskData):
    amounts: list[int]


class LedgerTask(vf.Task[LedgerData, LedgerState]):
    @vf.stop
    async def out_of_turns(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= MAX_TURNS

    @vf.reward(weight=1.0)
    async def total(self, trace: vf.Trace) -> float:
        match = _TOTAL.search(trace.last_reply or "")
        return float(match is not None and int(match.group(1)) == sum(self.data.amounts))

    @vf.reward(weight=1.0)
    async def entered(self, trace: vf.Trace) -> float:
        entries, amounts = trace.state.entries, self.data.amounts
        in_order = sum(a == b for a, b in zip(entries, amounts, strict=False))
        return in_order / max(len(entries), len(amounts))


class LedgerConfig(vf.TasksetConfig):
    split: str = "train"
    """`train` or `test`: which tasks `load` builds (each split from its own seed)."""
    num_tasks: int = 32
    """Tasks in the split."""


class LedgerTaskset(vf.Taskset[LedgerTask, LedgerConfig]):
    """`num_tasks` lists of 2-4 amounts between 1 and 20, drawn from the split's seed."""

    @classmethod
    def toolsets(cls, config: LedgerConfig) -> list[vf.Toolset]:
        """The ledger, one server for every episode (verifiers keeps each one's state)."""
        return [Ledger(vf.SharedToolsetConfig())]

    def load(self) -> list[LedgerTask]:
        """The split's tasks, in order (verifiers sets each one's `idx`)."""
        rng = random.Random(f"vf-ledger/{self.config.split}")
        tasks = []
        for _ in range(self.config.num_tasks):
            amounts = [rng.randint(1, 20) for _ in range(rng.randint(2, 4))]
            prompt = "Amounts: " + ", ".join(map(str, amounts)) + "."
            data = LedgerData(prompt=prompt, system_prompt=SYSTEM, amounts=amounts)
            tasks.append(LedgerTask(data, self.config.task))
        return tasks


if __name__ == "__main__":  # verifiers starts the tool server this way, once per split
    Ledger.run()
