"""Typed errors raised to users of tir-rl.

Every error a user can cause (bad config, missing set-up, an unreachable service) is a
`TirError` subclass whose message says what went wrong and what to do about it.
Mistakes made by the *model* (a malformed tool call, wrong arguments) are never raised:
they become error tool results (`tir_rl.types.ToolResult`) so that training goes on.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TirError(Exception):
    """Base class of every error tir-rl raises on purpose."""


class ConfigError(TirError, ValueError):
    """A configuration value is missing, unknown or inconsistent."""


class ToolDefinitionError(TirError, TypeError):
    """A Python function cannot be turned into a tool (raised at decoration time)."""


class ToolCallError(TirError):
    """A tool call could not be carried out; used inside the registry, never leaks from it."""


class ChatFormatError(TirError):
    """The tokenizer or conversation cannot be rendered in the chat format."""


class ModelError(TirError):
    """A model checkpoint is missing or cannot be prepared."""


class SandboxError(TirError):
    """The code sandbox is unavailable or broke (not: the model's code failed)."""


class EngineError(TirError):
    """The sampling engine failed or does not match the configuration."""


class EngineUnavailableError(EngineError):
    """The engine cannot be reached (connection refused, server gone, process dead).

    Unlike other `EngineError`s it says nothing about the request: the same request may
    succeed on another engine, which is what a pool (`tir_rl.engine.pool`) does with it.
    """


class ParityError(EngineError):
    """Sampler and trainer logprobs disagree beyond the configured tolerance."""


class EnvironmentSpecError(TirError):
    """A user environment violates the ToolEnv API."""


class RankLostError(TirError):
    """Another rank of a multi-rank job stopped answering (killed, crashed, or its node lost)."""


class SetupError(TirError):
    """A required component is not installed; the message names the set-up command."""


def closest(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The candidate most like `name` (a likely typo), or None: for "did you mean" hints."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str:
    """`" Did you mean 'x'?"` for the closest candidate, or "" when none is close."""
    near = closest(name, candidates, cutoff=cutoff)
    return f" Did you mean {near!r}?" if near else ""
