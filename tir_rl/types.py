"""Core data types shared across tir-rl: messages, tool calls and results, trajectories."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    """Who wrote a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool, as parsed from an assistant turn."""

    name: str
    """Name of the tool the model asked for."""
    arguments: dict[str, Any]
    """Decoded JSON arguments (not yet validated against the tool's schema)."""


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """Tool calls parsed from an assistant message (empty for other roles)."""
    name: str | None = None
    """For tool messages: the tool that produced this result."""
    call_blocks: tuple[ToolCall | ToolResult, ...] = ()
    """Every tool-call block of an assistant turn in the order written, as the chat format
    read it: the parsed `ToolCall`, or, for a block it could not parse, the
    `ToolErrorKind.MALFORMED_CALL` result that answers it. Empty: `tool_calls` are the
    blocks (a message built from calls, not from model text)."""

    @property
    def blocks(self) -> tuple[ToolCall | ToolResult, ...]:
        """What an environment answers, in order: `call_blocks`, or else `tool_calls`."""
        return self.call_blocks or self.tool_calls

    @classmethod
    def system(cls, content: str) -> Message:
        """Build a system message."""
        return cls(Role.SYSTEM, content)

    @classmethod
    def user(cls, content: str) -> Message:
        """Build a user message."""
        return cls(Role.USER, content)

    @classmethod
    def assistant(
        cls,
        content: str,
        tool_calls: Sequence[ToolCall] = (),
        *,
        call_blocks: Sequence[ToolCall | ToolResult] = (),
    ) -> Message:
        """Build an assistant message (`tir_rl.chat.assistant_message` parses model text)."""
        return cls(Role.ASSISTANT, content, tuple(tool_calls), call_blocks=tuple(call_blocks))

    @classmethod
    def tool(cls, content: str, name: str | None = None) -> Message:
        """Build a tool-result message."""
        return cls(Role.TOOL, content, name=name)


class ToolErrorKind(StrEnum):
    """Why a tool call failed; recorded per call for metrics."""

    MALFORMED_CALL = "malformed_call"
    """The call could not be parsed (bad JSON, unclosed tag, missing name)."""
    UNKNOWN_TOOL = "unknown_tool"
    INVALID_ARGUMENTS = "invalid_arguments"
    """Missing, extra or wrongly typed arguments."""
    TOOL_RAISED = "tool_raised"
    """The tool function raised an exception."""
    TIMEOUT = "timeout"
    SANDBOX = "sandbox"
    """The sandbox failed (crashed container, no sandbox available)."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returned, ready to be shown to the model."""

    name: str
    """The tool that was called (as the model spelled it)."""
    content: str
    """Text shown to the model: the result, or an explanation of what went wrong."""
    error: ToolErrorKind | None = None
    """Set when the call failed; `content` then tells the model how to fix it."""
    value: Any = None
    """The Python return value on success (not shown to the model)."""

    @property
    def ok(self) -> bool:
        """Whether the call succeeded."""
        return self.error is None


UNVERSIONED = -1
"""The policy version of a token no engine sampled (rendered turns, tool output)."""


class RolloutStatus(StrEnum):
    """How an episode ended."""

    FINISHED = "finished"
    TRUNCATED_MAX_TURNS = "truncated_max_turns"
    TRUNCATED_CONTEXT = "truncated_context"
    """The conversation reached the maximum context length."""
    TRUNCATED_TURN_LENGTH = "truncated_turn_length"
    """An assistant turn hit the per-turn token limit before ending."""
    ERROR_PARSE = "error_parse"
    """Too many malformed tool calls."""
    ERROR_TOOL = "error_tool"
    ERROR_ENGINE = "error_engine"
    ERROR_SANDBOX = "error_sandbox"
    ERROR_AGENT = "error_agent"
    """A harness agent (`tir_rl.rollout.agent_episode`) raised instead of returning a reward."""

    @property
    def is_error(self) -> bool:
        """Whether the episode ended because something failed."""
        return self.value.startswith("error_")


@dataclass
class EpisodeTimings:
    """Where an episode's time went: wall-clock seconds per phase, and the prefill work."""

    generate_s: float = 0.0
    tools_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    """Context tokens sent to the engine, summed over the turns: every turn re-sends the
    episode so far, which the engine prefills again except where its prefix cache holds it."""
    cached_prompt_tokens: int | None = None
    """Of `prompt_tokens`, those the engine reused from its prefix cache; None when the
    engine does not report it."""


@dataclass
class Trajectory:
    """One episode in tokens: everything the trainer needs, nothing re-tokenized.

    The per-token lists all have the length of `completion_ids`. A completion token is
    either sampled by the engine (loss mask 1, `sampler_logprobs` holds the engine's
    processed logprob) or rendered by the chat format between turns (loss mask 0,
    sampler logprob 0.0 and meaningless).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    turn_ids: list[int]
    """Index of the assistant turn a token belongs to (tool tokens: the turn they follow)."""
    reward: float = 0.0
    status: RolloutStatus = RolloutStatus.FINISHED
    group_id: int = 0
    """Ties together the G samples of one task."""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    messages: list[Message] = field(default_factory=list)
    timings: EpisodeTimings = field(default_factory=EpisodeTimings)
    error: str | None = None
    """Human-readable account of what failed, for error statuses."""
    policy_versions: list[int] = field(default_factory=list)
    """Per completion token, the policy version (trainer optimizer steps) of the weights
    that sampled it; `UNVERSIONED` (-1) for rendered tokens (loss mask 0). A trajectory
    spans several versions when the weights changed while it was played. Empty when no
    engine recorded them (trajectories built by hand, or saved before versions existed)."""
    episode_id: int | None = None
    """Set when an episode gave several samples (a harness agent whose history was not
    append-only, `tir_rl.endpoint.call_samples`): its samples share it and the episode's reward,
    and GRPO counts the episode once in its group. None: the trajectory is the episode."""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        lengths = (len(self.loss_mask), len(self.sampler_logprobs), len(self.turn_ids))
        assert all(length == n for length in lengths), (
            f"per-token lists must match completion length {n}, got {lengths}"
        )
        assert len(self.policy_versions) in (0, n), (
            f"policy_versions must be empty or match completion length {n}, "
            f"got {len(self.policy_versions)}"
        )

    @property
    def num_model_tokens(self) -> int:
        """Number of tokens the engine sampled."""
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (for JSONL dumps)."""
        return dataclasses.asdict(self)


def one_per_episode(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The first sample of each episode, in order (episode-level counts: rewards, pass@k).

    Samples with the same `group_id` and `episode_id` are one episode; a trajectory without
    an `episode_id` is an episode of its own.
    """
    seen: set[tuple[int, int]] = set()
    kept = []
    for t in trajectories:
        if t.episode_id is not None:
            key = (t.group_id, t.episode_id)
            if key in seen:
                continue
            seen.add(key)
        kept.append(t)
    return kept
