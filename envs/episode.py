"""Typed records of an episode: the task, what reset and step report, the reward, the spaces.

``reset`` and ``step`` return their info as a plain dict, as Gymnasium promises (its wrappers
and vector envs add keys to it). `ResetInfo` and `StepInfo` are typed views of those dicts:
``ResetInfo.from_info(info).tool_schemas``; their ``to_info`` builds a new dict on every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Self

import gymnasium

from tir_rl.errors import ConfigError, EnvironmentSpecError
from tir_rl.types import Message, Role, ToolResult

if TYPE_CHECKING:
    from tir_rl.tools import ToolRegistry


class Split(StrEnum):
    """Which task pool an environment draws from; pools of one environment never overlap."""

    TRAIN = "train"
    TEST = "test"


@dataclass(frozen=True)
class Task:
    """One problem: what the model is asked and what counts as right."""

    id: str
    """Stable identifier (the same seed or task index always gives the same id)."""
    question: str
    """The user message."""
    answer: str
    """The reference answer, as text."""
    split: Split
    difficulty: int
    """1 (easiest) and up; what it means is environment-specific."""
    data: dict[str, Any] = field(default_factory=dict)
    """Environment-specific parameters (the generator's inputs, for verification)."""


def _from_info(cls: type[Any], info: Mapping[str, Any]) -> Any:
    """Build the dataclass `cls` from the keys of `info` (extra keys are ignored)."""
    if not isinstance(info, Mapping):
        raise EnvironmentSpecError(
            f"an env's info must be a dict (the Gymnasium API), got {type(info).__name__}"
        )
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in info:
            values[f.name] = info[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise EnvironmentSpecError(
                f"the info dict has no {f.name!r} key (keys: {sorted(info)}); a "
                f"{cls.__name__} needs {[g.name for g in dataclasses.fields(cls)]}"
            )
    return cls(**values)


def _to_info(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


@dataclass(frozen=True)
class ResetInfo:
    """What ``reset`` reports besides the messages (a typed view of its info dict)."""

    task_id: str
    split: Split
    difficulty: int
    tools: ToolRegistry
    """The task's tools; render their schemas into the system turn."""
    task: Task

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function-calling schemas of the tools."""
        return list(self.tools.json_schemas)

    def to_info(self) -> dict[str, Any]:
        """The info dict ``reset`` returns (a new dict on every call)."""
        return _to_info(self)

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> Self:
        """The typed view of a ToolEnv's reset info (keys added by wrappers are ignored).

        Raises:
            EnvironmentSpecError: `info` is not a dict or lacks one of the fields.
        """
        return _from_info(cls, info)


@dataclass(frozen=True)
class Reward:
    """How the reward of a finished episode was made: ``total = correct + format + shaping``."""

    correct: float
    """The verifier's score of the final answer, in [0, 1]."""
    format: float = 0.0
    """``Config.format_reward`` when the answer used the ``<answer>`` tag, else 0."""
    shaping: float = 0.0
    """Environment-specific progress bonus (0 unless the environment's config enables it)."""

    @property
    def total(self) -> float:
        """The scalar reward ``step`` returns."""
        return float(self.correct + self.format + self.shaping)


@dataclass(frozen=True)
class StepInfo:
    """What ``step`` reports besides messages, reward and the end flags (a view of its info)."""

    turn: int
    """1-based index of the assistant turn just handled."""
    tool_results: tuple[ToolResult, ...] = ()
    """One result per tool call of the turn, in order (errors included)."""
    answer: str | None = None
    """The extracted final answer, on the final turn."""
    reward: Reward | None = None
    """The reward breakdown, on the final turn."""
    nudged: bool = False
    """Whether the env answered with a nudge because the turn had no call and no answer."""

    @property
    def num_tool_errors(self) -> int:
        """Calls of this turn that failed."""
        return sum(not r.ok for r in self.tool_results)

    def to_info(self) -> dict[str, Any]:
        """The info dict ``step`` returns (a new dict on every call)."""
        return _to_info(self)

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> Self:
        """The typed view of a ToolEnv's step info (keys added by wrappers are ignored).

        Raises:
            EnvironmentSpecError: `info` is not a dict or has no ``turn``.
        """
        return _from_info(cls, info)


class MessagesSpace(gymnasium.Space[list[Message]]):
    """Observation space: a list of chat messages."""

    def contains(self, x: Any) -> bool:
        """Whether `x` is a list of `Message`."""
        return isinstance(x, list) and all(isinstance(m, Message) for m in x)

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        """A fixed sample (the space is not meant for random sampling)."""
        return [Message.user("Hello")]


class AssistantMessageSpace(gymnasium.Space[Message]):
    """Action space: one assistant message."""

    def contains(self, x: Any) -> bool:
        """Whether `x` is an assistant `Message`."""
        return isinstance(x, Message) and x.role == Role.ASSISTANT

    def sample(self, mask: Any = None, probability: Any = None) -> Message:
        """A fixed sample: an assistant turn with an empty answer."""
        return Message.assistant("<answer></answer>")


def task_index(options: Mapping[str, Any] | None, rng: Any, num_tasks: int | None) -> int:
    """The index of the task an episode plays.

    `options["task_index"]` when given, else one drawn from `rng` (the env's seeded
    `np_random`) among `num_tasks` (None: effectively unbounded).

    Raises:
        ConfigError: `task_index` is not an int >= 0.
    """
    index = (options or {}).get("task_index")
    if index is None:
        return int(rng.integers(0, num_tasks or 2**62))
    if not isinstance(index, int) or index < 0:
        raise ConfigError(f"options['task_index']={index!r}: must be an int >= 0")
    return index
