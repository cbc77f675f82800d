"""vf-reverse: a small `verifiers` 0.4.0 environment (its `verifiers.v1` API), built in code.

Each task gives a short made-up phrase and asks for it reversed character by character, in
`<reversed>` tags. The rubric is the task's `@vf.reward` methods, which verifiers runs on
the finished trace and sums by weight: `lcs` (the similarity, difflib's ratio, of the answer
to the reversed phrase; the answer is the tagged text, else the whole reply) and `exact`
(1 when they are equal). `@vf.stop` allows one model turn. Like verifiers' own
reverse-text environment, but its tasks are drawn from a seed instead of downloaded.

It runs in the verifiers virtual environment (`scripts/setup_verifiers.sh`), never in the
project's; `play_one.py` beside it plays one task through tir-rl's endpoint. The taskset id
is this module's name: verifiers imports it (this folder must be on `sys.path`).
"""

from __future__ import annotations

import random
import re
from difflib import SequenceMatcher

import verifiers.v1 as vf

__all__ = ["ReverseTaskset"]

SYSTEM = "Reverse the text character by character. Put your answer in <reversed> tags."
SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "sa", "vo", "pel", "di", "nor")
_TAG = re.compile(r"<reversed>(.*?)</reversed>", re.DOTALL)


class ReverseData(vf.TaskData):
    answer: str
    """The phrase reversed."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return SequenceMatcher(None, _answer(trace.last_reply), self.data.answer).ratio()

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(_answer(trace.last_reply) == self.data.answer)


def _answer(reply: str) -> str:
    match = _TAG.search(reply or "")
    return (match.group(1) if match else reply or "").strip()


class ReverseConfig(vf.TasksetConfig):
    split: str = "train"
    """`train` or `test`: which tasks `load` builds (each split from its own seed)."""
    num_tasks: int = 32
    """Tasks in the split."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    """`num_tasks` phrases of 2-3 made-up words, drawn from the split's seed."""

    def load(self) -> list[ReverseTask]:
        """The split's tasks, in order (verifiers sets each one's `idx`)."""
        rng = random.Random(f"vf-reverse/{self.config.split}")
        tasks = []
        for _ in range(self.config.num_tasks):
            words = ["".join(rng.choices(SYLLABLES, k=2)) for _ in range(rng.randint(2, 3))]
            phrase = " ".join(words)
            data = ReverseData(prompt=phrase, system_prompt=SYSTEM, answer=phrase[::-1])
            tasks.append(ReverseTask(data, self.config.task))
        return tasks
