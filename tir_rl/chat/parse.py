"""Parse Hermes-style tool calls out of an assistant turn, without ever raising.

An assistant turn is free text with zero or more blocks::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Each block becomes either a `ToolCall` or a `ToolCallParseError` whose `message` tells the
model what was wrong and the exact format to use. `ToolCallParseError.to_tool_result` turns
the error into a `ToolResult` with `ToolErrorKind.MALFORMED_CALL`, so a model's mistake is
answered like any other failed tool call instead of stopping the episode.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tir_rl.types import Message, ToolCall, ToolErrorKind, ToolResult

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_FORMAT_HINT = (
    "Write each call on its own as:\n"
    f"{TOOL_CALL_OPEN}\n"
    '{"name": "<tool name>", "arguments": {"<argument name>": <value>, ...}}\n'
    f"{TOOL_CALL_CLOSE}"
)
"""The exact call format, appended to every parse error message."""

_MAX_QUOTED_CHARS = 200
_CODE_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)


class ParseErrorKind(StrEnum):
    """Why one `<tool_call>` block could not be turned into a `ToolCall`."""

    INVALID_JSON = "invalid_json"
    """The block's body is not valid JSON (or is empty)."""
    NOT_AN_OBJECT = "not_an_object"
    """The body is valid JSON but not an object (a list, a string, a number...)."""
    MISSING_NAME = "missing_name"
    """The object has no "name", or the name is not a non-empty string."""
    INVALID_ARGUMENTS = "invalid_arguments"
    """ "arguments" is neither an object nor a string holding a JSON object."""
    UNCLOSED_TAG = "unclosed_tag"
    """`<tool_call>` without `</tool_call>` (often: the turn hit the token limit)."""


@dataclass(frozen=True)
class ToolCallParseError:
    """One `<tool_call>` block that could not be parsed.

    Attributes:
        kind: What went wrong.
        message: Text for the model: what was wrong and the exact format to use.
        raw: The block's body as written (between the tags, or to the end of the turn).
        index: Position of the block among all blocks of the turn (0-based).
        name: The tool name, when it could be read despite the error.
    """

    kind: ParseErrorKind
    message: str
    raw: str
    index: int
    name: str | None = None

    def to_tool_result(self) -> ToolResult:
        """The answer to this block: an error result with `ToolErrorKind.MALFORMED_CALL`."""
        return ToolResult(
            name=self.name or "", content=self.message, error=ToolErrorKind.MALFORMED_CALL
        )

    def to_message(self) -> Message:
        """The answer to this block as a tool message (see `tool_result_message`)."""
        return tool_result_message(self.to_tool_result())


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into prose and tool calls.

    Attributes:
        content: The turn's text with every tool-call block removed, stripped of surrounding
            whitespace.
        tool_calls: The calls that parsed, in order.
        errors: The blocks that did not parse, in order.
        items: Calls and errors together in the order the blocks appear in the text; answer
            them in this order.
    """

    content: str
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[ToolCallParseError, ...]
    items: tuple[ToolCall | ToolCallParseError, ...]

    @property
    def num_blocks(self) -> int:
        """Number of `<tool_call>` blocks the model wrote (parsed or not)."""
        return len(self.items)

    @property
    def has_tool_calls(self) -> bool:
        """Whether the model tried to call a tool at all (a final answer has no blocks)."""
        return bool(self.items)


def tool_result_message(result: ToolResult) -> Message:
    """Turn a tool result (success or error) into the tool message shown to the model."""
    return Message.tool(result.content, name=result.name or None)


def assistant_message(text: str, *, parsed: ParsedTurn | None = None) -> Message:
    """The assistant message for model text: its calls and, in order, its malformed blocks.

    This is how an environment sees a sampled turn; build `env.step` actions with it when
    they come from text. `parsed`: the turn as the chat format read it (default: Hermes
    blocks, `parse_assistant_text`).
    """
    parsed = parse_assistant_text(text) if parsed is None else parsed
    blocks = tuple(
        item.to_tool_result() if isinstance(item, ToolCallParseError) else item
        for item in parsed.items
    )
    return Message.assistant(text, parsed.tool_calls, call_blocks=blocks if parsed.errors else ())


def parse_assistant_text(text: str) -> ParsedTurn:
    """Split assistant text into prose, tool calls and parse errors; never raises.

    Args:
        text: The decoded assistant turn, without the end-of-turn token.

    Returns:
        The parsed turn. A `<tool_call>` that is followed by another `<tool_call>` before
        its `</tool_call>`, or by the end of the text, is an `UNCLOSED_TAG` error. A stray
        `</tool_call>` without an opening tag is left in the content.
    """
    prose: list[str] = []
    items: list[ToolCall | ToolCallParseError] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        prose.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        next_open = text.find(TOOL_CALL_OPEN, body_start)
        if end == -1 or (next_open != -1 and next_open < end):
            body_end = len(text) if next_open == -1 else next_open
            items.append(_unclosed(text[body_start:body_end], len(items)))
            pos = body_end
            continue
        items.append(_parse_block(text[body_start:end], len(items)))
        pos = end + len(TOOL_CALL_CLOSE)
    prose.append(text[pos:])
    calls = tuple(item for item in items if isinstance(item, ToolCall))
    errors = tuple(item for item in items if isinstance(item, ToolCallParseError))
    return ParsedTurn("".join(prose).strip(), calls, errors, tuple(items))


def quote(raw: str) -> str:
    """`raw` stripped and cut to a readable length, for error messages."""
    raw = raw.strip()
    if len(raw) > _MAX_QUOTED_CHARS:
        return raw[:_MAX_QUOTED_CHARS] + "..."
    return raw


def parse_error(
    kind: ParseErrorKind,
    problem: str,
    raw: str,
    index: int,
    name: str | None = None,
    *,
    hint: str = CALL_FORMAT_HINT,
) -> ToolCallParseError:
    """A parse error whose message states the problem, then the exact call format `hint`."""
    message = f"Tool call {index + 1} could not be parsed: {problem}\n{hint}"
    return ToolCallParseError(kind, message, raw, index, name)


def _unclosed(raw: str, index: int) -> ToolCallParseError:
    problem = (
        f"{TOOL_CALL_OPEN} was never closed with {TOOL_CALL_CLOSE} (the turn may have hit "
        f"the token limit; keep calls short). You wrote: {quote(raw)!r}"
    )
    return parse_error(ParseErrorKind.UNCLOSED_TAG, problem, raw, index)


def _parse_block(raw: str, index: int) -> ToolCall | ToolCallParseError:
    body = raw.strip()
    fenced = _CODE_FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        problem = f"the body is not valid JSON ({exc}). You wrote: {quote(raw)!r}"
        return parse_error(ParseErrorKind.INVALID_JSON, problem, raw, index)
    return call_from_object(obj, raw, index)


def call_from_object(
    obj: Any,
    raw: str,
    index: int,
    *,
    arguments_keys: tuple[str, ...] = ("arguments",),
    hint: str = CALL_FORMAT_HINT,
) -> ToolCall | ToolCallParseError:
    """A decoded call object as a `ToolCall`, or the error saying what is wrong with it.

    Args:
        obj: The decoded JSON.
        raw: The call as written (quoted in errors).
        index: Position of the call in its turn.
        arguments_keys: Keys that may hold the arguments object, the documented one first
            (Hermes: "arguments"; Llama 3: "parameters", "arguments" accepted too).
        hint: The exact call format, appended to error messages.
    """
    if not isinstance(obj, dict):
        problem = f"expected a JSON object, got {_json_type(obj)}. You wrote: {quote(raw)!r}"
        return parse_error(ParseErrorKind.NOT_AN_OBJECT, problem, raw, index, hint=hint)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        what = 'has no "name"' if name is None else f'has "name" of type {_json_type(name)}'
        problem = f'the object {what}; "name" must be the tool name as a string.'
        return parse_error(ParseErrorKind.MISSING_NAME, problem, raw, index, hint=hint)
    key = next((k for k in arguments_keys if k in obj), arguments_keys[0])
    arguments = obj.get(key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            problem = f'"{key}" is a string that is not valid JSON ({exc}).'
            return parse_error(
                ParseErrorKind.INVALID_ARGUMENTS, problem, raw, index, name, hint=hint
            )
    if not isinstance(arguments, dict):
        problem = (
            f'"{key}" must be a JSON object mapping argument names to values, '
            f"got {_json_type(arguments)}."
        )
        return parse_error(ParseErrorKind.INVALID_ARGUMENTS, problem, raw, index, name, hint=hint)
    return ToolCall(name=name, arguments=arguments)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
