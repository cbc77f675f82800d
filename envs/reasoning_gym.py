"""`tir_rl/ReasoningGym-v0`: any `reasoning-gym` task as a ToolEnv (needs ``reasoning-gym``).

``gymnasium.make("tir_rl/ReasoningGym-v0", task="chain_sum")`` wraps the procedural dataset
``reasoning_gym.create_dataset(task, size=..., seed=..., **task_config)``. Without tools the
episode is single-turn; with ``use_python=True`` the model gets the sandboxed Python tool and
may take as many turns as it likes.

Reward: ``correct`` is the dataset's own scorer, ``dataset.score_answer(answer, entry)``
(in [0, 1]; some tasks give partial credit), on the text inside ``<answer>``; plus
``Config.format_reward`` for the tag. Beware: reasoning-gym's default scorer (and
``chain_sum``'s) gives ``len(reference) / len(answer)`` when the reference is a substring of
a wrong answer (``"1000"`` for ``"100"`` earns 0.75); ``partial_credit=False`` keeps only
full marks.

Splits: like MathPython, task ``index`` of split ``s`` is the first dataset entry along a
hashed walk ``(index, attempt)`` whose *question text* hashes into ``s`` (20% test), so the
two splits never share a question.

Checked against reasoning-gym 0.1.25 (all 106 datasets, default config): the reference
answer of 99 scores 1.0 through this adapter. Five (``boxnet``, ``graph_color``,
``propositional_logic``, ``rubiks_cube``, ``rush_hour``) have no reference answer (any valid
solution counts; `Task.answer` is empty and there is no demonstration); ``composite`` needs a
``task_config`` and ``word_ladder`` a smaller ``dataset_size``. Upstream,
``game_of_life_halting`` scores *any* non-empty answer 1.0 (``bool("False")``): do not train
on it.
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
from tir_rl.errors import ConfigError, SetupError, did_you_mean
from tir_rl.types import Message

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
            "(its dependency pycosat is built from source, so a C compiler is needed)"
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
        """Number of dataset entries the tasks are drawn from. Most datasets make an entry
        only when it is read, so the size costs nothing; a few build them all up front
        (``acre`` takes ~19 s for 100,000) or cap it (``word_ladder``)."""
        use_python: bool = False
        """Give the model the sandboxed Python tool (multi-turn) instead of no tool."""
        partial_credit: bool = True
        """Pass the scorer's partial credit through; False rounds every score below 1 to 0."""

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
                hint = did_you_mean(self.config.task, names)
                raise ConfigError(f"unknown reasoning-gym task {self.config.task!r}.{hint}")
            try:
                self._dataset = rg.create_dataset(
                    self.config.task,
                    size=self.config.dataset_size,
                    seed=self.config.dataset_seed,
                    **self.config.task_config,
                )
            except (TypeError, ValueError, AssertionError) as exc:
                # reasoning-gym rejects bad settings with these: an unknown keyword
                # (TypeError), ``Config.validate`` (assert), a size its generator cannot reach.
                raise ConfigError(
                    f"reasoning-gym rejected task={self.config.task!r} with "
                    f"task_config={self.config.task_config!r}, "
                    f"dataset_size={self.config.dataset_size}: {type(exc).__name__}: {exc} "
                    f"(see reasoning_gym.factory.DATASETS[{self.config.task!r}] for its config)"
                ) from exc
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
        reference = entry.get("answer")
        return Task(
            id=f"rg/{self.config.task}/{self.split}/{position}",
            question=entry["question"],
            answer="" if reference is None else str(reference),
            split=self.split,
            difficulty=1,
            data={"entry": entry, "position": position},
        )

    def instructions(self, task: Task) -> str:
        """The system prompt."""
        return (_PYTHON_PROMPT if self.config.use_python else _PLAIN_PROMPT) + ANSWER_INSTRUCTIONS

    def demonstration(self, task: Task) -> list[Message]:
        """The dataset's reference answer as a one-turn episode (no tool call needed).

        Raises:
            NotImplementedError: The task has no reference answer, or the dataset's own
                scorer does not give it full marks.
        """
        if not task.answer or self.score(task, task.answer) != 1.0:
            raise NotImplementedError(
                f"reasoning-gym task {self.config.task!r} has no reference answer that its "
                "scorer accepts (any valid solution counts), so there is no demonstration"
            )
        return [Message.assistant(f"<answer>{task.answer}</answer>")]

    def score(self, task: Task, answer: str) -> float:
        """The dataset's own score of `answer`, clipped to [0, 1] (0 when the scorer raises).

        Some reasoning-gym scorers raise on answers they cannot parse (``prime_factorization``
        on a word, for example); that is the model's mistake, so it scores 0.
        """
        try:
            value = float(self.dataset.score_answer(answer, task.data["entry"]))
        except Exception:  # noqa: BLE001 (a third-party scorer choking on a bad answer)
            return 0.0
        if not math.isfinite(value):
            return 0.0
        if not self.config.partial_credit:
            return 1.0 if value >= 1.0 else 0.0
        return min(max(value, 0.0), 1.0)
