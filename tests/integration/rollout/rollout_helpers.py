"""Helpers shared by the agent-loop tests on real vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from tir_rl.engine.base import GenerateRequest, GenerateResult, ModelInfo


@dataclass
class RecordingEngine:
    """Passes requests to the real engine and keeps each result, keyed by (prompt, seed)."""

    engine: object
    calls: dict[tuple[tuple[int, ...], int | None], GenerateResult] = field(default_factory=dict)

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await self.engine.generate(request)
        self.calls[(tuple(request.prompt_token_ids), request.seed)] = result
        return result
