"""What `VLLMHttpEngine` sends: every sampling setting named, so that a server fills none of
them from the model's `generation_config.json` (vLLM's `--generation-config auto`)."""

from __future__ import annotations

import asyncio
from typing import Any

from tir_rl.engine.vllm_http import VLLMHttpEngine

CARD_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty")  # fmt: skip
"""The sampling keys a vLLM server reads from a model's card (`ModelConfig.
get_diff_sampling_param`, vLLM 0.32), `max_tokens` aside (every request sets it)."""


class FakeResponse:
    """A completion with one sampled token (a fake of the server's answer)."""

    def json(self) -> dict[str, Any]:
        return {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}}]}


def engine_recording(sent: list[dict[str, Any]]) -> VLLMHttpEngine:
    """An engine whose requests are recorded instead of sent (no server: `_completion` only)."""
    engine = object.__new__(VLLMHttpEngine)
    engine._model = "served"

    async def request(method: str, path: str, **kwargs: Any) -> FakeResponse:
        sent.append(kwargs["json"])
        return FakeResponse()

    engine._request = request  # type: ignore[method-assign]
    return engine


def test_a_request_names_every_setting_a_server_would_take_from_the_card():
    sent: list[dict[str, Any]] = []
    engine = engine_recording(sent)
    asyncio.run(engine._completion([1, 2], max_tokens=1, temperature=0.7, top_p=0.9))
    (body,) = sent
    assert set(CARD_KEYS) <= set(body)
    assert (body["temperature"], body["top_p"]) == (0.7, 0.9)  # the request's own settings
    assert (body["top_k"], body["min_p"]) == (0, 0.0)  # off, whatever the card says
    assert body["repetition_penalty"] == 1.0
    assert body["presence_penalty"] == body["frequency_penalty"] == 0.0
