"""What vLLM's request outputs say, in tir-rl's terms.

Each sampled token's logprob, its policy version, and why the request finished.
"""

from __future__ import annotations

from typing import Any

from tir_rl.engine.base import FinishReason
from tir_rl.errors import EngineError


def sampled_logprobs(entries: Any, token_ids: list[int]) -> list[float]:
    """Each sampled token's logprob from vLLM's per-position `{token: Logprob}` entries."""
    if entries is None or len(entries) != len(token_ids):
        raise EngineError("vLLM returned no logprobs for sampled tokens (logprobs=0 was set)")
    return [entry[tok].logprob for entry, tok in zip(entries, token_ids, strict=True)]


def versions_from_spans(spans: Any, num_tokens: int, request_id: str) -> list[int]:
    """One policy version per output token from vLLM's `WeightVersionSpan`s.

    Raises:
        EngineError: the spans do not cover the tokens, or a label is not an integer (the
            engine's weights were labelled by something other than tir-rl).
    """
    if num_tokens == 0:
        return []
    versions: list[int] = []
    try:
        for span in spans or ():
            versions += [int(span.version)] * (min(span.end, num_tokens) - len(versions))
    except ValueError as exc:
        raise EngineError(
            f"request {request_id}: vLLM labelled its weights {exc}; tir-rl labels them with "
            "integer policy versions (do not call update_weight_version on this engine)"
        ) from exc
    if len(versions) != num_tokens:
        raise EngineError(
            f"request {request_id}: vLLM's weight-version spans cover {len(versions)} of "
            f"{num_tokens} sampled tokens"
        )
    return versions


def finish_reason(reason: object) -> FinishReason:
    """Map vLLM's finish reason string; anything unexpected counts as an error."""
    try:
        return FinishReason(str(reason))
    except ValueError:
        return FinishReason.ERROR
