"""`tir_rl/ReasoningGym-v0`: any `reasoning-gym` task as a ToolEnv (needs ``reasoning-gym``).

``gymnasium.make("tir_rl/ReasoningGym-v0", task="chain_sum")`` wraps the procedural dataset
``reasoning_gym.create_dataset(task, size=..., seed=..., **task_config)``. Without tools the
episode is single-turn; with ``use_python=True`` the model gets the sandboxed Python tool and
may take as many turns as it likes.

Reward: ``correct`` is the dataset's own scorer, ``dataset.score_answer(answer, entry)``
(in [0, 1]; some tasks give partial credit), on the text inside ``<answer>``; plus
``Config.format_reward`` for the tag.

Splits: like MathPython, task ``index`` of split ``s`` is the first dataset entry along a
hashed walk ``(index, attempt)`` whose *question text* hashes into ``s`` (20% test), so the
two splits never share a question.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any

from tir_rl.envs.answers import ANSWER_INSTRUCTIONS
from tir_rl.envs.base import Split, Task, ToolEnv
from tir_rl.errors import ConfigError, SetupError

if TYPE_CHECKING:
    from tir_rl.tools import ToolRegistry

TEST_PERCENT = 20
"""Share of the question hash space that belongs to the test split."""

_PLAIN_PROMPT = "Solve the problem. Think step by step if it helps. "
_PYTHON_PROMPT = (
    "Solve the problem. You have a `python` tool that runs code in a persistent session and "
    "returns what you print; use it whenever computing or checking helps. "
)


def split_of_question(question: str) -> Split:
    """The split a question belongs to, from a hash of its text."""
    digest = hashlib.sha256(question.encode()).digest()
    return Split.TEST if int.from_bytes(digest[:8], "big") % 100 < TEST_PERCENT else Split.TRAIN


def load_reasoning_gym() -> Any:
    """Import `reasoning_gym`, or say how to install it."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as exc:
        raise SetupError(
            "tir_rl/ReasoningGym-v0 needs the reasoning-gym package: pip install reasoning-gym "
            "(it builds pycosat from source, so a C compiler is needed)"
        ) from exc


class ReasoningGymEnv(ToolEnv):
    """A reasoning-gym procedural dataset, scored by its own verifier."""

    @dataclass(kw_only=True)
    class Config(ToolEnv.Config):
        """ReasoningGym settings."""

        task: str = "chain_sum"
        """reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``)."""
        task_config: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of the dataset's config (e.g. ``{"min_terms": 3}``)."""
        dataset_seed: int = 0
        """Seed of the underlying dataset (the pools of both splits come from it)."""
        dataset_size: int = 100_000
        """Number of dataset entries the tasks are drawn from."""
        use_python: bool = False
        """Give the model the sandboxed Python tool (multi-turn) instead of no tool."""

        def validate(self) -> None:
            """Check values; raise `ConfigError` naming the bad field."""
            super().validate()
            if self.dataset_size < 10:
                raise ConfigError(f"dataset_size={self.dataset_size}: must be at least 10")

    config: Config

    def __init__(self, *args: Any, dataset: Any = None, **kwargs: Any) -> None:
        """Build the environment (see `ToolEnv`).

        Args:
            *args: Passed to `ToolEnv`.
            dataset: A ready dataset object (indexable, with ``score_answer``) to use instead
                of ``reasoning_gym.create_dataset`` (tests, custom datasets).
            **kwargs: Passed to `ToolEnv` (config overrides, ``sandbox_factory``).
        """
        super().__init__(*args, **kwargs)
        self._dataset = dataset

    @property
    def dataset(self) -> Any:
        """The underlying reasoning-gym dataset (created on first use)."""
        if self._dataset is None:
            rg = load_reasoning_gym()
            names = sorted(rg.factory.DATASETS)
            if self.config.task not in names:
                import difflib

                near = difflib.get_close_matches(self.config.task, names, n=3)
                raise ConfigError(f"unknown reasoning-gym task {self.config.task!r}; close: {near}")
            self._dataset = rg.create_dataset(
                self.config.task,
                size=self.config.dataset_size,
                seed=self.config.dataset_seed,
                **self.config.task_config,
            )
        return self._dataset

    def build_tools(self) -> ToolRegistry:
        """The Python tool when ``use_python`` is set, else no tools."""
        from tir_rl.tools import ToolRegistry

        if not self.config.use_python:
            return ToolRegistry([])
        from tir_rl.tools.python import python

        return ToolRegistry([python])

    def generate_task(self, index: int) -> Task:
        """Task `index` of this env's split."""
        size = len(self.dataset)
        for attempt in count():
            key = f"tir_rl/ReasoningGym/{index}/{attempt}".encode()
            position = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % size
            entry = self.dataset[position]
            if split_of_question(entry["question"]) == self.split:
                break
        return Task(
            id=f"rg/{self.config.task}/{self.split}/{position}",
            question=entry["question"],
            answer=str(entry["answer"]),
            split=self.split,
            difficulty=1,
            data={"entry": entry, "position": position},
        )

    def instructions(self, task: Task) -> str:
        """The system prompt."""
        return (_PYTHON_PROMPT if self.config.use_python else _PLAIN_PROMPT) + ANSWER_INSTRUCTIONS

    def score(self, task: Task, answer: str) -> float:
        """The dataset's own score of `answer`, clipped to [0, 1] (0 when the scorer raises).

        Some reasoning-gym scorers raise on answers they cannot parse (``prime_factorization``
        on a word, for example); that is the model's mistake, so it scores 0.
        """
        try:
            value = float(self.dataset.score_answer(answer, task.data["entry"]))
        except Exception:  # noqa: BLE001 (a third-party scorer choking on a bad answer)
            return 0.0
        return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0
