"""The turn-by-turn rendering the named families share (chatml, qwen, llama3).

A conversation is an optional opening piece, then one turn per message, each a header (a
special token and the role), the body, and the end-of-turn token (plus a separator in
ChatML). Consecutive tool results share one turn when the family groups them. A family
gives its tokens, header, separator, tool-result role and body, and its call syntax; the
generic `template` family renders through the tokenizer's own template instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import ClassVar

from tir_rl.chat.family import special_token_id
from tir_rl.chat.format import ChatFormat, check_render_flags
from tir_rl.chat.tokens import Piece, Text
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role

__all__ = ["HERMES_TOOL_INSTRUCTIONS", "TurnFormat"]

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

HERMES_TOOL_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
"""The tool block of the ChatML and Qwen families (Qwen's documented system-turn block)."""


class TurnFormat(ChatFormat):
    """A family rendered turn by turn around its special tokens (see the module docstring)."""

    required_tokens: ClassVar[tuple[str, ...]] = ()
    """Special tokens the family needs as single tokens."""
    default_tool_instructions: ClassVar[str] = HERMES_TOOL_INSTRUCTIONS
    tool_role: ClassVar[str] = "tool"
    """Role of the turn that carries tool results."""
    groups_tool_results: ClassVar[bool] = True
    """The family's rule when `Config.group_tool_results` is None."""
    turn_separator: ClassVar[str] = ""
    """Text after each end-of-turn token (ChatML: a newline)."""

    def _prepare(self) -> None:
        self.special_ids = {token: self._special_id(token) for token in self.required_tokens}
        """The family's special tokens, by text."""
        self.group_tool_results = self._resolve_grouping()
        """Whether consecutive tool results share one turn."""

    # ------------------------------------------------------------------- family hooks
    def _begin_pieces(self) -> list[Piece]:
        """Pieces that open every conversation (Llama 3: `<|begin_of_text|>`)."""
        return []

    def _header(self, role: str) -> list[Piece]:
        raise NotImplementedError

    def _generation_header(self) -> list[Piece]:
        """What opens the assistant turn the model samples (the assistant header)."""
        return self._header("assistant")

    def _tool_results_body(self, results: Sequence[Message]) -> str:
        return "\n".join(
            f"{TOOL_RESPONSE_OPEN}\n{m.content}\n{TOOL_RESPONSE_CLOSE}" for m in results
        )

    def system_text(self, content: str | None) -> str | None:
        """Text of the system turn: `content` plus the tool block; None when both are empty."""
        if not self.tool_schemas:
            return content
        tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in self.tool_schemas)
        template = self.config.tool_instructions or self.default_tool_instructions
        block = template.replace("{tools}", tools)
        return f"{content}\n\n{block}" if content else block

    # -------------------------------------------------------------------------- helpers
    def _special_id(self, token: str) -> int:
        token_id = special_token_id(self.tokenizer, token)
        if token_id is None:
            needed = " and ".join(self.required_tokens)
            raise ChatFormatError(
                f"the tokenizer has no special token {token!r}; the {self.name.value!r} chat "
                f"format needs {needed} as single special tokens. Set chat.format to auto "
                "(or the family the model was trained with: chatml, qwen, llama3, template); "
                "docs/bring_your_model.md"
            )
        return token_id

    def _resolve_grouping(self) -> bool:
        given = self.config.group_tool_results
        return self.groups_tool_results if given is None else given

    def _end(self) -> list[Piece]:
        """Pieces that close a turn: the end-of-turn token, then the separator if any."""
        separator: list[Piece] = [Text(self.turn_separator)] if self.turn_separator else []
        return [self.end_of_turn_id, *separator]

    def _conversation_pieces(
        self, messages: Sequence[Message], generation_prompt: bool, continue_final: bool
    ) -> list[Piece]:
        check_render_flags(messages, generation_prompt, continue_final)
        pieces: list[Piece] = self._begin_pieces()
        has_system = bool(messages) and messages[0].role == Role.SYSTEM
        if not has_system and (text := self.system_text(self.config.system_prompt)):
            pieces += [*self._header("system"), Text(text, literal=True), *self._end()]
        first = 1 if has_system else 0
        user_index = first if first < len(messages) else -1
        pieces.extend(
            self._messages_pieces(
                messages, system_index=0 if has_system else -1, user_index=user_index
            )
        )
        if continue_final:
            del pieces[-len(self._end()) :]  # the final end of turn (and separator)
        if generation_prompt:
            pieces.extend(self._generation_header())
        return pieces

    def _env_pieces(self, messages: Sequence[Message], close_turn: bool) -> list[Piece]:
        pieces: list[Piece] = [self.end_of_turn_id] if close_turn else []
        if self.turn_separator:
            pieces.append(Text(self.turn_separator))
        pieces.extend(self._messages_pieces(messages))
        pieces.extend(self._generation_header())
        return pieces

    def first_message_text(self, message: Message) -> str:
        """Text of the conversation's first message after the system turn (a family hook)."""
        return message.content

    def _messages_pieces(
        self, messages: Sequence[Message], system_index: int = -1, user_index: int = -1
    ) -> list[Piece]:
        pieces: list[Piece] = []
        i = 0
        while i < len(messages):
            message = messages[i]
            if message.role == Role.TOOL:
                j = i + 1
                if self.group_tool_results:
                    while j < len(messages) and messages[j].role == Role.TOOL:
                        j += 1
                body = self._tool_results_body(messages[i:j])
                pieces += [*self._header(self.tool_role), Text(body, literal=True)]
                i = j
            elif message.role == Role.ASSISTANT:
                pieces += [*self._header("assistant"), Text(self.assistant_text(message), False)]
                i += 1
            else:
                text = message.content
                if i == system_index:
                    text = self.system_text(text) or ""
                elif i == user_index:
                    text = self.first_message_text(message)
                pieces += [*self._header(message.role.value), Text(text, literal=True)]
                i += 1
            pieces += self._end()
        return pieces
