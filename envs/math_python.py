r"""`tir_rl/MathPython-v0`: procedurally generated math problems solved with a Python tool.

The problems (see `tir_rl.envs.math_problems`) are big-number arithmetic, modular
arithmetic, counting and small algebra: trivial with an interpreter, error-prone by hand.

Reward: ``correct`` is 1 when the final answer equals the exact rational reference answer
(``1,234``, ``1234.0``, ``3/4``, ``\frac{3}{4}`` and ``\boxed{}`` all parse), else 0; plus
``Config.format_reward`` when it used the ``<answer>`` tag.

Splits: task ``index`` of split ``s`` is the first candidate problem drawn from the seed
stream ``(index, attempt = 0, 1, ...)`` whose question text hashes into ``s`` (20% of the
hash space is test). A question's split is a function of the question itself, so the train
and test pools never share a question, by construction.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

from tir_rl.envs.answers import ANSWER_INSTRUCTIONS, numbers_equal
from tir_rl.envs.base import Split, Task, ToolEnv
from tir_rl.envs.math_problems import FAMILIES, Problem
from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    from tir_rl.tools import ToolRegistry

TEST_PERCENT = 20
"""Share of the problem hash space that belongs to the test split (fixed: changing it would
move problems between splits)."""

SYSTEM_PROMPT = (
    "You are a careful mathematician with a Python interpreter. Use the `python` tool to do "
    "every computation: it runs your code in a persistent session (variables survive between "
    "calls) and returns what you print. Do not compute large numbers by hand. The answer is "
    "an exact number: an integer, or a fraction p/q in lowest terms. "
) + ANSWER_INSTRUCTIONS


def split_of(problem: Problem) -> Split:
    """The split a problem belongs to, from a hash of its question text."""
    digest = hashlib.sha256(problem.canonical.encode()).digest()
    return Split.TEST if int.from_bytes(digest[:8], "big") % 100 < TEST_PERCENT else Split.TRAIN


class MathPythonEnv(ToolEnv):
    """Math problems that want code; the model's tool is the sandboxed Python interpreter."""

    @dataclass(kw_only=True)
    class Config(ToolEnv.Config):
        """MathPython settings."""

        difficulty: int | None = None
        """Fixed difficulty 1..5 (None: each task draws 1, 2 or 3)."""
        families: tuple[str, ...] = ()
        """Problem families to draw from (empty: all of `math_problems.FAMILIES`)."""

        def validate(self) -> None:
            """Check values; raise `ConfigError` naming the bad field."""
            super().validate()
            if self.difficulty is not None and not 1 <= self.difficulty <= 5:
                raise ConfigError(f"difficulty={self.difficulty}: choose 1..5 or None")
            unknown = sorted(set(self.families) - set(FAMILIES))
            if unknown:
                raise ConfigError(f"families: unknown {unknown}; choose from {sorted(FAMILIES)}")

    config: Config

    def build_tools(self) -> ToolRegistry:
        """The sandboxed Python tool."""
        from tir_rl.tools import ToolRegistry
        from tir_rl.tools.python import python

        return ToolRegistry([python])

    def problem(self, index: int) -> Problem:
        """The problem behind task `index` of this env's split."""
        families = sorted(self.config.families or FAMILIES)
        for attempt in count():
            rng = random.Random(f"tir_rl/MathPython/{index}/{attempt}")
            family = families[rng.randrange(len(families))]
            difficulty = self.config.difficulty or rng.randint(1, 3)
            problem = FAMILIES[family](rng, difficulty)
            if split_of(problem) == self.split:
                return problem
        raise AssertionError("unreachable")

    def generate_task(self, index: int) -> Task:
        """Task `index` of this env's split."""
        problem = self.problem(index)
        digest = hashlib.sha256(problem.canonical.encode()).hexdigest()[:10]
        return Task(
            id=f"math/{self.split}/{problem.family}/d{problem.difficulty}/{digest}",
            question=problem.question,
            answer=problem.answer_text,
            split=self.split,
            difficulty=problem.difficulty,
            data={"family": problem.family, "params": problem.params},
        )

    def instructions(self, task: Task) -> str:
        """The system prompt."""
        return SYSTEM_PROMPT

    def score(self, task: Task, answer: str) -> float:
        """1.0 when `answer` is exactly the reference number."""
        from fractions import Fraction

        return float(numbers_equal(answer, Fraction(task.answer)))
