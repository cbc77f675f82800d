"""What the endpoint sampled, call by call, under the episode id the client passed.

Every choice of every completion is kept as a `RecordedCall`: the prompt's token ids as the
engine saw them, the sampled ids with their sampler logprobs and policy versions, the
messages of the request and the assistant message returned. `tir_rl.endpoint.call_samples`
turns an episode's calls into training samples.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tir_rl.engine.base import FinishReason
from tir_rl.errors import TirError
from tir_rl.types import Message

__all__ = ["CallRecorder", "RecordedCall", "UnknownEpisodeError"]


class UnknownEpisodeError(TirError):
    """No call was recorded under this episode id (or it was already taken)."""


@dataclass(frozen=True, kw_only=True)
class RecordedCall:
    """One sampled choice of one chat-completions call."""

    episode_id: str
    call_index: int
    """Order of the call within its episode (0-based); the choices of a call share it."""
    choice_index: int
    messages: tuple[Message, ...]
    """The request's conversation."""
    tool_schemas: tuple[dict[str, Any], ...] = ()
    """The tools shown to the model (none for `tool_choice: "none"`)."""
    prompt_ids: list[int]
    """What the engine continued: reused tokens of an earlier call when the request extends
    it (`extends_call`), else the request rendered by the chat format."""
    completion_ids: list[int]
    """Sampled ids verbatim, end-of-turn token included."""
    logprobs: list[float]
    """Sampler logprob of each sampled id."""
    policy_versions: list[int]
    """Policy version of the weights that sampled each id."""
    finish_reason: FinishReason
    response: Message
    """The assistant message returned to the client (its calls parsed)."""
    call_ids: tuple[str, ...] = ()
    """The ids given to the returned tool calls."""
    extends_call: tuple[int, int] | None = None
    """(call, choice) whose prompt and completion this prompt starts with, token for token."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt and completion."""
        return self.prompt_ids + self.completion_ids

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (`GET /episodes/<id>`): token ids, logprobs, versions, the turn."""
        return {
            "call_index": self.call_index,
            "choice_index": self.choice_index,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logprobs": self.logprobs,
            "policy_versions": self.policy_versions,
            "finish_reason": self.finish_reason.value,
            "content": self.response.content,
            "tool_calls": [
                {"name": c.name, "arguments": c.arguments} for c in self.response.tool_calls
            ],
            "extends_call": list(self.extends_call) if self.extends_call else None,
        }


@dataclass
class _Episode:
    calls: list[RecordedCall] = field(default_factory=list)
    next_call: int = 0
    cut: bool = False
    """A call was refused because the episode had made its most calls."""


class CallRecorder:
    """Recorded calls by episode id; safe to use from several threads."""

    def __init__(self, *, open_on_first_call: bool = True) -> None:
        """Start with no episode.

        Args:
            open_on_first_call: a call under an id never seen starts that episode (`tir-rl
                serve`, where clients name their episodes). False: only ids given to `open`
                are accepted (a run's agent episodes, whose ids the run hands out), so a
                client cannot start episodes nobody takes, nor call into one that ended.
        """
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._open_on_first_call = open_on_first_call

    @property
    def clients_open_episodes(self) -> bool:
        """Whether a client starts an episode by calling under a new id (`tir-rl serve`)."""
        return self._open_on_first_call

    def open(self, episode_id: str) -> None:
        """Accept calls under `episode_id` from now until it is taken or discarded."""
        with self._lock:
            self._episodes.setdefault(episode_id, _Episode())

    def check_known(self, episode_id: str) -> None:
        """Raise `UnknownEpisodeError` if calls under `episode_id` are not accepted."""
        if self._open_on_first_call:
            return
        with self._lock:
            known = episode_id in self._episodes
        if not known:
            raise UnknownEpisodeError(
                f"episode {episode_id!r} is not open in this run (it never was, or it has "
                "ended): an agent must call the base URL it was given, during its episode"
            )

    def next_call_index(self, episode_id: str) -> int:
        """Reserve the index of a new call of `episode_id` (the episode starts if new)."""
        with self._lock:
            episode = self._episodes.setdefault(episode_id, _Episode())
            index = episode.next_call
            episode.next_call += 1
            return index

    def mark_cut(self, episode_id: str) -> None:
        """Note that a call of `episode_id` was refused at the per-episode call limit."""
        with self._lock:
            self._episodes.setdefault(episode_id, _Episode()).cut = True

    def was_cut(self, episode_id: str) -> bool:
        """Whether `episode_id` reached its call limit."""
        with self._lock:
            episode = self._episodes.get(episode_id)
            return episode is not None and episode.cut

    def add(self, calls: Sequence[RecordedCall]) -> None:
        """Keep the choices of one call."""
        with self._lock:
            for call in calls:
                self._episodes.setdefault(call.episode_id, _Episode()).calls.append(call)

    def calls(self, episode_id: str) -> list[RecordedCall]:
        """The episode's calls so far, in call then choice order (empty if none)."""
        with self._lock:
            episode = self._episodes.get(episode_id)
            calls = list(episode.calls) if episode else []
        return sorted(calls, key=lambda c: (c.call_index, c.choice_index))

    def take(self, episode_id: str) -> list[RecordedCall]:
        """The episode's calls, forgotten here; `UnknownEpisodeError` if it has none."""
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is None:
            raise UnknownEpisodeError(
                f"no call was recorded under episode id {episode_id!r}: the client must send "
                "its requests to /episodes/<id>/v1 (or with an X-Episode-Id header)"
            )
        return sorted(episode.calls, key=lambda c: (c.call_index, c.choice_index))

    def discard(self, episode_id: str) -> None:
        """Forget an episode (no error if unknown)."""
        with self._lock:
            self._episodes.pop(episode_id, None)

    @property
    def episode_ids(self) -> list[str]:
        """Episodes with recorded calls."""
        with self._lock:
            return list(self._episodes)
