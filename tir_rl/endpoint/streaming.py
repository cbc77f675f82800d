"""A finished chat completion sent as an OpenAI stream (`"stream": true`).

The endpoint samples a call whole (the trainer needs every token before it can record the
call), so a streamed request gets the same completion as server-sent events: per choice, one
`chat.completion.chunk` whose delta carries the role, the content, the tool calls (with
their `index`), the logprobs and token ids when asked; then one with the finish reason; then,
with `stream_options: {"include_usage": true}`, a chunk with the usage and no choices; then
`data: [DONE]`. Harnesses that always stream (verifiers' chat programs, many agent
frameworks) work unchanged, and what they read is what a non-streamed request returns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["completion_chunks", "sse_events"]


def completion_chunks(completion: Mapping[str, Any], *, include_usage: bool) -> list[dict]:
    """The `chat.completion.chunk` objects that stream `completion` (a `chat.completion`)."""
    head = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
    }
    usage_field = {"usage": None} if include_usage else {}
    chunks = []
    for choice in completion["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {"index": position, **call} for position, call in enumerate(message["tool_calls"])
            ]
        body: dict[str, Any] = {
            "index": choice["index"],
            "delta": delta,
            "logprobs": choice.get("logprobs"),
            "finish_reason": None,
        }
        if "token_ids" in choice:
            body["token_ids"] = choice["token_ids"]
        first = {**head, "choices": [body], **usage_field}
        if "prompt_token_ids" in completion:
            first["prompt_token_ids"] = completion["prompt_token_ids"]
        chunks.append(first)
        end = {"index": choice["index"], "delta": {}, "logprobs": None}
        chunks.append({**head, "choices": [{**end, "finish_reason": choice["finish_reason"]}]})
        chunks[-1].update(usage_field)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return chunks


def sse_events(chunks: list[dict]) -> Iterator[bytes]:
    """`chunks` as server-sent events, ending with `data: [DONE]`."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
    yield b"data: [DONE]\n\n"
