r"""Llama 3.x (`llama3`): header tokens, JSON tool calls, tool results in `ipython` turns.

Every turn is ``<|start_header_id|>{role}<|end_header_id|>\n\n{body}<|eot_id|>`` after one
``<|begin_of_text|>``. A tool-calling assistant turn is JSON only, in Llama 3.1's JSON
tool-calling style: ``{"name": "add", "parameters": {"a": 2, "b": 3}}`` (several calls: one
object after another, separated by whitespace or ``;``), optionally after Llama's
``<|python_tag|>`` (as vLLM's ``llama3_json`` parser accepts). A turn whose text does not
start with ``{`` or ``[`` (after that tag) is a final answer. Each tool result is its own
``ipython`` turn. The turn ends with ``<|eot_id|>``; ``<|eom_id|>`` (end of message, used by
Llama's built-in tools) also stops sampling when the tokenizer has it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from tir_rl.chat.family import ChatFormatName, Llama3Layout, special_token_id
from tir_rl.chat.parse import (
    ParsedTurn,
    ParseErrorKind,
    ToolCallParseError,
    call_from_object,
    parse_error,
    quote,
)
from tir_rl.chat.tokens import Piece, Text
from tir_rl.chat.turns import TurnFormat
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role, ToolCall

__all__ = ["Llama3Format", "parse_json_calls"]

BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
PYTHON_TAG = "<|python_tag|>"

LLAMA3_TOOL_INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call the functions listed below. To call one, answer with nothing but a JSON "
    'object {"name": <function-name>, "parameters": <arguments-object>}. The result comes '
    "back in the next turn.\n\n"
    "{tools}"
)
"""The tool block of the `llama3` family (Llama 3.1's JSON tool-calling style)."""

META_CALL_FORMAT = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.Do not use variables.\n\n"
)
META_SYSTEM_TOOLS = (
    "You have access to the following functions. To call a function, please respond with JSON "
    "for a function call." + META_CALL_FORMAT
)
"""Meta's tool instructions in the system turn (`llama3_layout: meta_system`)."""
META_USER_TOOLS = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n" + META_CALL_FORMAT
)
"""Meta's tool instructions in the first user turn (`llama3_layout: meta_user`)."""
META_KNOWLEDGE_CUTOFF = "Cutting Knowledge Date: December 2023\n"

JSON_CALL_HINT = (
    "Answer with only the call, as one JSON object:\n"
    '{"name": "<tool name>", "parameters": {"<argument name>": <value>, ...}}'
)
"""The exact call format, appended to every `llama3` parse error message."""


class Llama3Format(TurnFormat):
    """Llama 3.x header turns, JSON tool calls, one `ipython` turn per tool result."""

    name: ClassVar[ChatFormatName] = ChatFormatName.LLAMA3
    required_tokens: ClassVar[tuple[str, ...]] = (BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT)
    default_tool_instructions: ClassVar[str] = LLAMA3_TOOL_INSTRUCTIONS
    tool_role: ClassVar[str] = "ipython"
    groups_tool_results: ClassVar[bool] = False

    def _resolve_grouping(self) -> bool:
        if self.config.group_tool_results:
            raise ChatFormatError(
                "chat.group_tool_results=true does not apply to chat.format=llama3: Llama 3 "
                "gives each tool result its own ipython turn. Leave it unset (or false)."
            )
        return False

    def _end_of_turn_id(self) -> int:
        return self.special_ids[EOT]

    def _other_stop_ids(self) -> list[int]:
        eom = special_token_id(self.tokenizer, EOM)
        return [] if eom is None else [eom]

    def _begin_pieces(self) -> list[Piece]:
        return [self.special_ids[BEGIN_OF_TEXT]]

    def _header(self, role: str) -> list[Piece]:
        ids = self.special_ids
        return [ids[START_HEADER], Text(role), ids[END_HEADER], Text("\n\n")]

    @property
    def meta_layout(self) -> bool:
        """Whether the conversation is laid out as Meta's Llama 3.1 template lays it out."""
        return self.config.llama3_layout in (Llama3Layout.META_USER, Llama3Layout.META_SYSTEM)

    def system_text(self, content: str | None) -> str | None:
        """The system turn; in a Meta layout, its preamble first (the turn is always there)."""
        if not self.meta_layout:
            return super().system_text(content)
        text = "Environment: ipython\n" if self.tool_schemas else ""
        text += META_KNOWLEDGE_CUTOFF + f"Today Date: {self.config.llama3_date}\n\n"
        if self.tool_schemas and self.config.llama3_layout == Llama3Layout.META_SYSTEM:
            text += META_SYSTEM_TOOLS + self._indented_tools()
        return text + (content or "").strip()

    @property
    def tools_in_first_user_turn(self) -> bool:
        """Whether the tools open the first user turn (`meta_user`, with tools)."""
        return self.config.llama3_layout == Llama3Layout.META_USER and bool(self.tool_schemas)

    def first_message_text(self, message: Message) -> str:
        """In the `meta_user` layout with tools, the tools open the first user turn."""
        if not self.tools_in_first_user_turn:
            return message.content
        return META_USER_TOOLS + self._indented_tools() + message.content.strip()

    def _conversation_pieces(
        self, messages: Sequence[Message], generation_prompt: bool, continue_final: bool
    ) -> list[Piece]:
        first = next((m for m in messages if m.role != Role.SYSTEM), None)
        if self.tools_in_first_user_turn and first is not None and first.role != Role.USER:
            raise ChatFormatError(
                "chat.llama3_layout=meta_user puts the tools in the first user turn, but the "
                f"conversation's first message after the system turn is {first.role.value!r}: "
                "start it with a user message, or use llama3_layout meta_system"
            )
        return super()._conversation_pieces(messages, generation_prompt, continue_final)

    def _indented_tools(self) -> str:
        return "".join(
            json.dumps(s, ensure_ascii=False, indent=4) + "\n\n" for s in self.tool_schemas
        )

    def _tool_results_body(self, results: Any) -> str:
        (result,) = results  # never grouped
        return result.content

    def assistant_text(self, message: Message) -> str:
        """The content, or for a hand-built call turn its calls as JSON objects, one a line.

        Raises:
            ChatFormatError: A hand-built message has both prose and calls (a Llama 3 call
                turn is JSON only).
        """
        if not message.tool_calls or message.content.lstrip().startswith(("{", "[")):
            return message.content
        if message.content.strip():
            raise ChatFormatError(
                "a llama3 tool-call turn is JSON only: build the assistant message with "
                f"content '' and its tool_calls (got content {message.content[:60]!r})"
            )
        return "\n".join(_call_json(call) for call in message.tool_calls)

    def parse_text(self, text: str) -> ParsedTurn:
        """JSON calls if the turn starts with `{`/`[` (after `<|python_tag|>`); else an answer."""
        return parse_json_calls(text)


def _call_json(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


def parse_json_calls(text: str) -> ParsedTurn:
    """Split a Llama 3 assistant turn into calls, errors and prose; never raises.

    A turn that starts (after whitespace) with ``{`` or ``[`` is read as JSON values one after
    another (separated by whitespace or ``;``); each becomes a `ToolCall` or a
    `ToolCallParseError` of the same kinds as Hermes blocks: `INVALID_JSON`, `NOT_AN_OBJECT`,
    `MISSING_NAME`, `INVALID_ARGUMENTS`, and `UNCLOSED_TAG` for a value cut off before its
    closing bracket (the turn hit the token limit). Text after the last value is prose. A
    leading ``<|python_tag|>`` (Llama 3.1 starts tool calls with it) is not part of the calls.
    """
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s.removeprefix(PYTHON_TAG).lstrip()
    items: list[ToolCall | ToolCallParseError] = []
    pos = 0
    decoder = json.JSONDecoder()
    while pos < len(s) and s[pos] in "{[":
        index = len(items)
        try:
            obj, end = decoder.raw_decode(s, pos)
        except json.JSONDecodeError as exc:
            raw = s[pos:]
            if _is_cut_off(raw):
                problem = (
                    "the JSON was never closed (the turn may have hit the token limit; keep "
                    f"calls short). You wrote: {quote(raw)!r}"
                )
                kind = ParseErrorKind.UNCLOSED_TAG
                items.append(parse_error(kind, problem, raw, index, hint=JSON_CALL_HINT))
            else:
                problem = f"the call is not valid JSON ({exc}). You wrote: {quote(raw)!r}"
                kind = ParseErrorKind.INVALID_JSON
                items.append(parse_error(kind, problem, raw, index, hint=JSON_CALL_HINT))
            pos = len(s)
            break
        items.append(
            call_from_object(
                obj,
                s[pos:end],
                index,
                arguments_keys=("parameters", "arguments"),
                hint=JSON_CALL_HINT,
            )
        )
        pos = end
        while pos < len(s) and (s[pos].isspace() or s[pos] == ";"):
            pos += 1
    calls = tuple(item for item in items if isinstance(item, ToolCall))
    errors = tuple(item for item in items if isinstance(item, ToolCallParseError))
    return ParsedTurn(s[pos:].strip(), calls, errors, tuple(items))


def _is_cut_off(raw: str) -> bool:
    """Whether JSON text ends inside a string or with brackets still open."""
    depth, in_string, escaped = 0, False, False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return False
    return in_string or depth > 0
