"""OpenAI chat-completions requests read into tir-rl's types, and responses written back.

The endpoint samples for training, so a request field that would change what the sampler
draws (and so the logprobs the trainer recomputes) is honoured exactly or refused with a
`RequestError` naming the field; fields that change nothing the sampler does (`user`,
`metadata`, `store`, ...) are accepted and ignored. What is refused, and why:

- `temperature`, `top_p`, `top_k` or `min_p` other than the endpoint's (the run's rollout
  settings): the trainer divides its logits by the run's temperature and replays the run's
  kept set; a request sampled otherwise would carry logprobs of another policy.
- `logit_bias`, presence/frequency penalties, `stop` strings,
  `tool_choice` "required" or a named function, structured `response_format`: each cuts or
  bends the distribution the tokens are drawn from, which the trainer does not reproduce.
- `top_logprobs` > 0, non-text content parts: not implemented.

`stream: true` is honoured: the completion is sampled whole and sent as one stream of chunks
(`tir_rl.endpoint.streaming`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tir_rl.errors import TirError
from tir_rl.types import Message, Role, ToolCall

__all__ = [
    "ChatRequest",
    "RequestError",
    "assistant_json",
    "parse_chat_request",
    "same_assistant_turn",
]

IGNORED_FIELDS = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "stream_options",
        "parallel_tool_calls",
        "reasoning_effort",
        "modalities",
        "prediction",
        "return_token_ids",
    }
)
"""Fields read elsewhere or that change nothing the sampler draws."""


class RequestError(TirError):
    """A request the endpoint refuses; answered with HTTP `status` and this message."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def to_json(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """One `/v1/chat/completions` request, read and checked."""

    messages: tuple[Message, ...]
    """The conversation, in tir-rl's message types (tool messages named after their call)."""
    tool_schemas: tuple[dict[str, Any], ...]
    """The `tools` as OpenAI function schemas (`{"type": "function", "function": {...}}`)."""
    show_tools: bool
    """False for `tool_choice: "none"`: the tools are not shown to the model."""
    n: int
    max_tokens: int | None
    """`max_completion_tokens` (or the older `max_tokens`); None: as many as fit."""
    temperature: float | None
    """None: the endpoint's temperature."""
    truncation: RequestedTruncation
    """The top_p, top_k and min_p the request names (None each: the endpoint's)."""
    seed: int | None
    logprobs: bool
    return_token_ids: bool
    """vLLM's extension: the prompt's and each choice's token ids in the response."""


@dataclass(frozen=True)
class RequestedTruncation:
    """A request's min-p, top-k and top-p, each None where the request names none."""

    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None


def _requested_truncation(body: Mapping[str, Any]) -> RequestedTruncation:
    """Read top_p, top_k and min_p; vLLM's "off" values (top_k 0 or −1) read as not given."""
    values: dict[str, Any] = {}
    for name, kind in (("top_p", int | float), ("top_k", int), ("min_p", int | float)):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RequestError(f"'{name}' must be a number", param=name)
        values[name] = value
    if values.get("top_k") in (0, -1):
        values["top_k"] = None
    return RequestedTruncation(
        top_p=None if "top_p" not in values else float(values["top_p"]),
        top_k=values.get("top_k"),
        min_p=None if "min_p" not in values else float(values["min_p"]),
    )


def parse_chat_request(body: Mapping[str, Any]) -> ChatRequest:
    """Read a request body; raise `RequestError` for anything the endpoint cannot honour."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    _refuse_sampling_changes(body)
    tools = _tool_schemas(body.get("tools"))
    show_tools = _tool_choice(body.get("tool_choice"), bool(tools))
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    n = _int(body, "n", 1, low=1)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError("'max_completion_tokens' must be an integer >= 1", param="max_tokens")
    temperature = body.get("temperature")
    if temperature is not None and not isinstance(temperature, int | float):
        raise RequestError("'temperature' must be a number", param="temperature")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise RequestError("'seed' must be an integer", param="seed")
    return ChatRequest(
        messages=tuple(openai_messages(raw_messages)),
        tool_schemas=tools,
        show_tools=show_tools,
        n=n,
        max_tokens=max_tokens,
        temperature=None if temperature is None else float(temperature),
        truncation=_requested_truncation(body),
        seed=seed,
        logprobs=bool(body.get("logprobs", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
    )


def _refuse_sampling_changes(body: Mapping[str, Any]) -> None:
    if not isinstance(body.get("stream", False), bool | None):
        raise RequestError("'stream' must be true or false", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    checks: list[tuple[str, bool, str]] = [
        ("logit_bias", bool(body.get("logit_bias")), "logit_bias changes the distribution"),
        ("presence_penalty", bool(body.get("presence_penalty")), "penalties change it"),
        ("frequency_penalty", bool(body.get("frequency_penalty")), "penalties change it"),
        ("stop", bool(body.get("stop")), "stop strings cut turns on text, not on token ids"),
        (
            "top_logprobs",
            bool(body.get("top_logprobs")),
            "only the sampled token's logprob is kept",
        ),
    ]
    for name, refused, why in checks:
        if refused:
            raise RequestError(
                f"'{name}' is not supported by the training endpoint: {why}, which the trainer "
                f"does not reproduce. Leave it out.",
                param=name,
            )
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type", "text") != "text":
        raise RequestError(
            "structured 'response_format' is not supported: constrained decoding changes the "
            "distribution the trainer recomputes. Ask for the format in the prompt instead.",
            param="response_format",
        )
    known = IGNORED_FIELDS | {
        "messages", "tools", "tool_choice", "n", "max_tokens", "max_completion_tokens",
        "temperature", "seed", "logprobs", "stream", "top_p", "top_k", "min_p", "logit_bias",
        "presence_penalty", "frequency_penalty", "stop", "top_logprobs", "response_format",
    }  # fmt: skip
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(
            f"unknown request field(s) {unknown}: the training endpoint refuses fields it "
            "cannot honour. Remove them.",
            param=unknown[0],
        )


def _int(body: Mapping[str, Any], name: str, default: int, *, low: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RequestError(f"'{name}' must be an integer >= {low}, got {value!r}", param=name)
    return value


def _tool_schemas(tools: object) -> tuple[dict[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    schemas = []
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise RequestError(
                "every tool must be {'type': 'function', 'function': {...}}", param="tools"
            )
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError("a tool's 'function' needs a 'name'", param="tools")
        schemas.append({"type": "function", "function": dict(function)})
    return tuple(schemas)


def _tool_choice(choice: object, has_tools: bool) -> bool:
    if choice in (None, "auto"):
        return has_tools
    if choice == "none":
        return False
    raise RequestError(
        f"tool_choice {choice!r} is not supported: forcing a call changes the distribution the "
        "tokens are drawn from, which the trainer does not reproduce. Use 'auto' or 'none'.",
        param="tool_choice",
    )


def openai_messages(raw: Sequence[object]) -> list[Message]:
    """OpenAI message dicts as tir-rl `Message`s; a tool message is named after its call."""
    call_names: dict[str, str] = {}
    messages: list[Message] = []
    for index, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise RequestError(f"messages[{index}] must be an object", param="messages")
        role = item.get("role")
        content = _text(item.get("content"), index)
        if role in ("system", "developer"):
            messages.append(Message.system(content))
        elif role == "user":
            messages.append(Message.user(content))
        elif role == "assistant":
            calls = _assistant_calls(item.get("tool_calls"), index)
            for call_id, call in calls:
                call_names[call_id] = call.name
            messages.append(Message.assistant(content, [c for _, c in calls]))
        elif role == "tool":
            call_id = item.get("tool_call_id")
            if str(call_id) not in call_names:
                raise RequestError(
                    f"messages[{index}] is a tool message whose tool_call_id {call_id!r} answers "
                    "no tool call of an earlier assistant message: give the id of the call "
                    "it answers",
                    param="messages",
                )
            name = item.get("name") or call_names[str(call_id)]
            messages.append(Message.tool(content, name=name))
        else:
            raise RequestError(
                f"messages[{index}] has role {role!r}: use system, developer, user, assistant "
                "or tool",
                param="messages",
            )
    return messages


def _text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise RequestError(
                    f"messages[{index}] has a non-text content part: only text is supported",
                    param="messages",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"messages[{index}].content must be a string or parts", param="messages")


def _assistant_calls(raw: object, index: int) -> list[tuple[str, ToolCall]]:
    if not raw:
        return []
    if not isinstance(raw, list):
        raise RequestError(f"messages[{index}].tool_calls must be a list", param="messages")
    calls = []
    for position, call in enumerate(raw):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"messages[{index}].tool_calls[{position}] needs function.name", param="messages"
            )
        arguments = function.get("arguments") or "{}"
        try:
            decoded = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise RequestError(
                f"messages[{index}].tool_calls[{position}].function.arguments is not JSON: {exc}",
                param="messages",
            ) from exc
        if not isinstance(decoded, dict):
            decoded = {"value": decoded}
        calls.append(
            (str(call.get("id", f"call_{index}_{position}")), ToolCall(function["name"], decoded))
        )
    return calls


def same_assistant_turn(given: Message, sampled: Message) -> bool:
    """Whether a client's assistant message is the turn the endpoint returned.

    The content is compared without surrounding whitespace (clients drop or strip it), and
    a client may drop the content of a turn with calls; the calls must be the same.
    """
    if given.role != Role.ASSISTANT or sampled.role != Role.ASSISTANT:
        return False
    calls_given = [(c.name, _canonical(c.arguments)) for c in given.tool_calls]
    calls_sampled = [(c.name, _canonical(c.arguments)) for c in sampled.tool_calls]
    if calls_given != calls_sampled:
        return False
    content = given.content.strip()
    return content == sampled.content.strip() or (not content and bool(calls_sampled))


def _canonical(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def assistant_json(message: Message, call_ids: Sequence[str]) -> dict[str, Any]:
    """The OpenAI assistant message of a sampled turn (`content` None when empty)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": json.dumps(call.arguments, ensure_ascii=False),
                },
            }
            for call_id, call in zip(call_ids, message.tool_calls, strict=True)
        ]
    return out


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry (-inf becomes the most negative float)."""
    return value if math.isfinite(value) else -3.4e38
