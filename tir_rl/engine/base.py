"""The sampling-engine contract: token ids in, sampled token ids and sampler logprobs out.

Every backend (`vllm_local`, `vllm_http`) implements `Engine`. The agent loop keeps many
episodes in flight on one event loop and sends each assistant turn as its own
`GenerateRequest`, so `generate` is a coroutine and a backend batches concurrent requests
continuously. A failed request raises `tir_rl.errors.EngineError` for that request only.

Logprobs are the sampler's *processed* logprobs: `log_softmax(logits / temperature)` of
each sampled token, the quantity the trainer recomputes (see DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    import torch

PROCESSED_LOGPROBS = "processed_logprobs"
"""The only logprobs mode whose values match the trainer's `log_softmax(logits / T)`."""


class FinishReason(StrEnum):
    """Why the engine stopped generating for one request."""

    STOP = "stop"
    """A stop token id or a stop token sequence was sampled (it is kept in `token_ids`)."""
    LENGTH = "length"
    """`max_tokens` was reached, or the context reached the engine's `max_model_len`."""
    ABORT = "abort"
    """The request was aborted (engine paused or shut down, client went away)."""
    ERROR = "error"
    """The engine failed this request; `generate` raises `EngineError` instead of returning
    it, so this value is for callers that record failed requests as results."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation request (one assistant turn), entirely in token ids."""

    prompt_token_ids: Sequence[int]
    """The whole context so far; the engine continues it."""
    max_tokens: int
    """Most tokens to sample (the engine may stop earlier at `max_model_len`)."""
    temperature: float = 1.0
    """Sampling temperature, > 0; the trainer must divide its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1: off. The trainer replays the kept set
    (`tir_rl.engine.truncation`)."""
    top_k: int | None = None
    """Top-k sampling; None means off."""
    min_p: float = 0.0
    """Min-p sampling in [0, 1); 0 means off."""
    seed: int | None = None
    """Per-request sampling seed; the same seed, prompt and weights give the same tokens."""
    stop_token_ids: Sequence[int] = ()
    """Single tokens that end the turn (e.g. `<|im_end|>`); kept in the output."""
    stop_token_sequences: Sequence[Sequence[int]] = ()
    """Multi-token stops (e.g. the ids of `</tool_call>`), matched on sampled ids, never on
    text; the output is cut right after the first complete match."""
    affinity: str | None = None
    """Requests with the same key go to the same engine of a pool while it is up (an
    episode's turns extend one context, which that server's prefix cache holds); None: any
    engine. A single engine ignores it."""
    read_prefix_cache: bool = True
    """False: prefill the whole prompt even where the engine's prefix cache holds it (the
    doctor compares the two paths). A server (`VLLMHttpEngine`) cannot and refuses it."""

    def validate(self) -> None:
        """Raise `ConfigError` if the request cannot be sampled."""
        if not self.prompt_token_ids:
            raise ConfigError("GenerateRequest.prompt_token_ids is empty: give at least 1 token")
        if self.max_tokens < 1:
            raise ConfigError(f"GenerateRequest.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise ConfigError(
                f"GenerateRequest.temperature must be > 0, got {self.temperature}: greedy "
                "decoding has no sampler logprobs to correct against; use a small temperature"
            )
        self.truncation.validate("GenerateRequest")
        if any(len(seq) == 0 for seq in self.stop_token_sequences):
            raise ConfigError("GenerateRequest.stop_token_sequences contains an empty sequence")

    @property
    def truncation(self) -> SamplingTruncation:
        """The request's min-p, top-k and top-p."""
        return SamplingTruncation(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)


@dataclass(frozen=True, kw_only=True)
class GenerateResult:
    """What the engine sampled for one request."""

    token_ids: list[int]
    """Sampled ids exactly as the engine returned them, including the stop token/sequence."""
    logprobs: list[float]
    """Processed sampler logprob of each sampled token; same length as `token_ids`."""
    finish_reason: FinishReason
    policy_versions: list[int]
    """Policy version of the weights that sampled each token (the trainer's optimizer step
    count at the weight sync); same length as `token_ids`. One request spans several
    versions when the weights change while it is in flight (`Engine.update_weights`)."""
    stop_sequence: tuple[int, ...] | None = None
    """The stop token id or stop token sequence that ended generation, if any."""
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int | None = None
    """Prompt tokens the engine took from its prefix cache instead of computing them (whole
    KV blocks only); None when the engine does not report it."""

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one logprob per sampled token"
        assert len(self.policy_versions) == len(self.token_ids), "one version per sampled token"


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the engine serves, as needed to check parity with the trainer."""

    model_path: str
    """Checkpoint folder (local engine) or the served model's name / root (HTTP)."""
    dtype: str
    """Engine compute dtype, e.g. `float32`; `unknown` when a server does not expose it."""
    max_model_len: int
    """Longest context (prompt + completion) the engine accepts, in tokens."""
    logprobs_mode: str
    """vLLM logprobs mode; tir-rl requires `processed_logprobs`."""
    enable_prefix_caching: bool | None = None
    """Whether the engine reuses KV blocks across requests (None: unknown)."""


R = TypeVar("R")


@dataclass(frozen=True)
class ServersHealth:
    """How an engine made of several servers is doing, as the run's metrics report it."""

    servers_up: int
    """Servers still sampling."""
    failovers: int
    """Requests sent again to another server after theirs became unreachable."""


@runtime_checkable
class Engine(Protocol):
    """A sampling engine. Coroutines may be awaited from any event loop."""

    @property
    def model_info(self) -> ModelInfo:
        """The served model and the settings that matter for parity."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample a continuation of `request.prompt_token_ids`; raises `EngineError`."""
        ...

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each token of `token_ids` after the first, given its prefix (T = 1)."""
        ...

    @property
    def policy_version(self) -> int:
        """The version label of the weights the engine samples with now (0 at start)."""
        ...

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> None:
        """Replace the engine's weights in place (Hugging Face parameter names).

        Requests in flight are not cut: they go on with the new weights, and their tokens
        sampled after the update carry `version` (None keeps the current label). The
        prefix cache never serves blocks computed with the old weights to new requests.
        """
        ...

    async def check_each_copy(
        self, check: Callable[[Engine], Awaitable[R]], *, version: int
    ) -> list[R]:
        """Run `check` on every engine holding its own copy of the weights of `version`.

        One engine checks itself. An engine made of several servers checks each one up,
        refuses servers whose weights are not `version` (`EngineError`), and drops a server
        that cannot be reached (`EngineUnavailableError` when none is left); a
        `ParityError` names the server. The caller never learns how many servers there are.
        """
        ...

    def servers_health(self) -> ServersHealth | None:
        """Servers up and failovers of an engine made of several servers; None for one."""
        ...

    def close(self) -> None:
        """Release the engine (idempotent)."""
        ...


class SingleEngine:
    """The `Engine` methods of an engine that is one copy of the weights, not several servers.

    A base class for engines and test fakes; `Engine` itself stays a protocol.
    """

    async def check_each_copy(
        self, check: Callable[[Engine], Awaitable[R]], *, version: int
    ) -> list[R]:
        """One engine, one copy of the weights: `check` runs on it."""
        return [await check(self)]  # type: ignore[arg-type]  # a subclass is an Engine

    def servers_health(self) -> ServersHealth | None:
        """None: one engine, not several servers."""
        return None


@dataclass
class StopSequenceMatcher:
    """Finds the first multi-token stop sequence in a growing list of sampled ids.

    vLLM's own stop strings match detokenized text, which tir-rl never does; this matches
    on ids. Feed it the ids as they stream in; `match` returns the cut point.
    """

    sequences: Sequence[Sequence[int]]
    _seqs: list[tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self._seqs = [tuple(s) for s in self.sequences if len(s) > 0]

    def find(self, token_ids: Sequence[int], start: int = 0) -> tuple[int, tuple[int, ...]] | None:
        """Earliest stop sequence that *ends* at index >= `start`.

        Returns:
            `(end, sequence)` where `token_ids[:end]` keeps the sequence, or None.
        """
        for end in range(max(start, 0) + 1, len(token_ids) + 1):
            for seq in self._seqs:
                n = len(seq)
                if end >= n and tuple(token_ids[end - n : end]) == seq:
                    return end, seq
        return None

    @property
    def max_len(self) -> int:
        """Length of the longest stop sequence (0 if none)."""
        return max((len(s) for s in self._seqs), default=0)


def truncate_at_stop_sequence(
    token_ids: list[int],
    logprobs: list[float],
    sequences: Sequence[Sequence[int]],
) -> tuple[list[int], list[float], tuple[int, ...] | None]:
    """Cut `token_ids`/`logprobs` right after the first complete stop sequence, if any."""
    found = StopSequenceMatcher(sequences).find(token_ids)
    if found is None:
        return token_ids, logprobs, None
    end, seq = found
    return token_ids[:end], logprobs[:end], seq
