"""How busy an engine is: the time it has at least one request in flight, and its tokens.

`MeteredEngine` wraps any `Engine` and counts its `generate` calls as they start and end,
from whatever thread or event loop they come. The asynchronous loop reads it to report the
engine's busy fraction beside the trainer's (`perf/engine_busy_fraction`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tir_rl.engine.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    R,
    ServersHealth,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ActivityReading:
    """Totals since the engine was wrapped."""

    busy_s: float
    """Seconds with at least one `generate` request in flight."""
    num_sampled_tokens: int
    """Tokens returned by finished `generate` calls."""


class MeteredEngine:
    """An `Engine` that measures its own busy time; everything else is the wrapped one's."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._tokens = 0

    def reading(self) -> ActivityReading:
        """The totals now (a request in flight counts up to this moment)."""
        with self._lock:
            busy = self._busy_s
            if self._in_flight:
                busy += time.perf_counter() - self._busy_since
            return ActivityReading(busy, self._tokens)

    def _start(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def _end(self, num_tokens: int) -> None:
        with self._lock:
            self._in_flight -= 1
            self._tokens += num_tokens
            if self._in_flight == 0:
                self._busy_s += time.perf_counter() - self._busy_since

    @property
    def model_info(self) -> ModelInfo:
        """The wrapped engine's."""
        return self.inner.model_info

    @property
    def policy_version(self) -> int:
        """The wrapped engine's."""
        return self.inner.policy_version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """The wrapped engine's `generate`, timed."""
        self._start()
        num_tokens = 0
        try:
            result = await self.inner.generate(request)
            num_tokens = len(result.token_ids)
            return result
        finally:
            self._end(num_tokens)

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The wrapped engine's."""
        return await self.inner.prompt_logprobs(token_ids)

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> None:
        """The wrapped engine's."""
        await self.inner.update_weights(state_dict, version=version)

    async def check_each_copy(
        self, check: Callable[[Engine], Awaitable[R]], *, version: int
    ) -> list[R]:
        """The wrapped engine's."""
        return await self.inner.check_each_copy(check, version=version)

    def servers_health(self) -> ServersHealth | None:
        """The wrapped engine's."""
        return self.inner.servers_health()

    def close(self) -> None:
        """The wrapped engine's."""
        self.inner.close()
