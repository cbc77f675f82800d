"""A user-defined environment in its own module, trained with `env.id=product_env:Product-v0`.

Run from this folder (or put it on PYTHONPATH)::

    cd examples
    tir-rl train --config ../configs/quickstart.yaml --set env.id=product_env:Product-v0

Importing the module registers ``Product-v0``; tir-rl imports it when it resolves the id.
See docs/bring_your_env.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import gymnasium

from tir_rl.envs import Task, ToolEnv
from tir_rl.envs.answers import ANSWER_INSTRUCTIONS, numbers_equal
from tir_rl.errors import ConfigError
from tir_rl.tools import ToolRegistry, tool


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: first factor
        b: second factor
    """
    return a * b


class ProductEnv(ToolEnv):
    """What is x * y? (with a multiplication tool, no sandbox)."""

    @dataclass(kw_only=True)
    class Config(ToolEnv.Config):
        """Product settings."""

        digits: int = 6
        """Digits of each factor."""

        def validate(self) -> None:
            """Check values."""
            super().validate()
            if not 1 <= self.digits <= 30:
                raise ConfigError(f"digits={self.digits}: choose 1..30")

    config: Config

    def build_tools(self) -> ToolRegistry:
        """The multiplication tool."""
        return ToolRegistry([multiply])

    def generate_task(self, index: int) -> Task:
        """Task `index`: even seeds are train, odd seeds test, so the splits never overlap."""
        rng = random.Random(2 * index + (self.split == "test"))
        low, high = 10 ** (self.config.digits - 1), 10**self.config.digits
        x, y = rng.randrange(low, high), rng.randrange(low, high)
        return Task(
            id=f"product/{self.split}/{index}",
            question=f"What is {x} * {y}?",
            answer=str(x * y),
            split=self.split,
            difficulty=self.config.digits,
        )

    def instructions(self, task: Task) -> str:
        """The system prompt."""
        return "Use the multiply tool. " + ANSWER_INSTRUCTIONS

    def score(self, task: Task, answer: str) -> float:
        """1.0 for the exact product."""
        return float(numbers_equal(answer, int(task.answer)))


if "Product-v0" not in gymnasium.registry:
    gymnasium.register(id="Product-v0", entry_point=ProductEnv)
