"""Chat format: ChatML with Hermes-style tool calls, rendered to token ids.

The exact wire format, the TITO rules and the loss-mask/turn semantics are specified in
docs/chat-format.md.

Special tokens are only ever produced by the format itself or sampled by the model: text
written by users, tools and system prompts is tokenized with `split_special_tokens`, so a
tool that prints ``<|im_end|>`` cannot end a turn. Text is tokenized in runs that start and
end at special tokens, which is what makes incremental rendering (`Conversation`) stable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tir_rl.chat.conversation import Conversation
from tir_rl.chat.parse import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedTurn,
    parse_assistant_text,
)
from tir_rl.chat.tokens import Piece, Text, Tokenizer, tokenize_pieces
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role

__all__ = ["ChatFormat"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

DEFAULT_TOOL_INSTRUCTIONS = (
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


class ChatFormat:
    """Renders messages to token ids and parses assistant turns.

    Args:
        tokenizer: A Hugging Face tokenizer with `<|im_start|>` and `<|im_end|>` tokens.
        tool_schemas: OpenAI-style tool JSON schemas (`ToolRegistry.json_schemas`), shown in
            the system turn. Empty: no tool block.
        config: Rendering options.

    Raises:
        ChatFormatError: The tokenizer lacks the ChatML special tokens.
    """

    @dataclass(kw_only=True)
    class Config:
        """Options of the chat format."""

        system_prompt: str | None = None
        """System text used when the messages do not start with a system message. None: no
        system turn, except the tool block when tools are given."""
        tool_instructions: str = DEFAULT_TOOL_INSTRUCTIONS
        """Tool block appended to the system text; `{tools}` is replaced by the schemas, one
        JSON object per line."""
        group_tool_results: bool = True
        """Consecutive tool messages share one `tool` turn (one `<tool_response>` block each);
        False gives each its own turn."""
        extra_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
        """Token ids that also end a turn when sampled, besides `<|im_end|>` and EOS."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        tool_schemas: Sequence[dict[str, Any]] = (),
        config: ChatFormat.Config | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config or ChatFormat.Config()
        self.tool_schemas = tuple(tool_schemas)
        self.im_start_id = self._special_id(IM_START)
        self.end_of_turn_id = self._special_id(IM_END)
        """`<|im_end|>`: closes every turn; sampled by the model to end its turn."""
        stops = [self.end_of_turn_id]
        if tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        stops.extend(self.config.extra_stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        """Token ids that end an assistant turn (`<|im_end|>` first, then EOS and extras)."""

    def _special_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        ids = self.tokenizer(token, add_special_tokens=False)["input_ids"]
        if token_id is None or ids != [token_id]:
            raise ChatFormatError(
                f"the tokenizer has no special token {token!r}; the chat format is ChatML and "
                "needs <|im_start|> and <|im_end|> as single special tokens (SmolLM2, Qwen2 "
                "and most instruct tokenizers have them)"
            )
        return token_id

    # ----------------------------------------------------------------------------- text
    def system_text(self, content: str | None) -> str | None:
        """Text of the system turn: `content` plus the tool block; None when both are empty."""
        if not self.tool_schemas:
            return content
        tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in self.tool_schemas)
        block = self.config.tool_instructions.replace("{tools}", tools)
        return f"{content}\n\n{block}" if content else block

    def assistant_text(self, message: Message) -> str:
        """Text of an assistant turn as the model sees it.

        The content, plus its `tool_calls` as blocks when the content has none (hand-built
        messages); content that already holds blocks (sampled turns) is used verbatim.
        """
        if not message.tool_calls or TOOL_CALL_OPEN in message.content:
            return message.content
        blocks = [
            f"{TOOL_CALL_OPEN}\n"
            + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
            + f"\n{TOOL_CALL_CLOSE}"
            for c in message.tool_calls
        ]
        return "\n".join([message.content, *blocks] if message.content else blocks)

    def render_text(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as one string (for reading; token ids come from `render_messages`)."""
        pieces = self._conversation_pieces(messages, add_generation_prompt, continue_final_message)
        decode = self.tokenizer.decode
        return "".join(p.text if isinstance(p, Text) else decode([p]) for p in pieces)

    # --------------------------------------------------------------------------- tokens
    def render_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the prompt, ending with the assistant header (`<|im_start|>assistant`)."""
        return self.render_messages(messages, add_generation_prompt=True)

    def render_messages(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Render a whole conversation in one go (the "full render").

        Args:
            messages: The conversation. A default system turn is added as configured.
            add_generation_prompt: End with the assistant header.
            continue_final_message: Leave the final (assistant) message open: no
                `<|im_end|>` and newline after it.
        """
        pieces = self._conversation_pieces(messages, add_generation_prompt, continue_final_message)
        return self._tokenize(pieces)

    def render_env_turns(self, messages: Sequence[Message], *, close_turn: bool) -> list[int]:
        """Tokens appended after an assistant turn: closing, env turns, next assistant header.

        Args:
            messages: Tool, user or system messages answering the assistant turn.
            close_turn: Prepend `<|im_end|>` (the sampled turn did not end with it).
        """
        for message in messages:
            if message.role == Role.ASSISTANT:
                raise ChatFormatError(
                    "assistant turns are sampled, not appended: pass only tool, user or system "
                    "messages to Conversation.append_messages"
                )
        pieces: list[Piece] = [self.end_of_turn_id] if close_turn else []
        pieces.append(Text("\n"))
        pieces.extend(self._messages_pieces(messages))
        pieces.extend(self._header("assistant"))
        return self._tokenize(pieces)

    def encode_assistant_text(self, text: str) -> list[int]:
        """Token ids of assistant text as the tokenizer writes it.

        Special-token strings become special tokens. Used to replay given assistant messages
        as if they had been sampled.
        """
        return self._tokenize([Text(text, literal=False)])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Exact text of token ids: special tokens kept, no clean-up of spaces."""
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    # -------------------------------------------------------------------------- parsing
    def parse_assistant(self, turn: str | Sequence[int]) -> ParsedTurn:
        """Parse an assistant turn given as text or sampled token ids; never raises.

        Trailing stop tokens (`<|im_end|>`, EOS) are dropped before parsing.
        """
        if isinstance(turn, str):
            text = turn
            stop_texts = [self.decode([t]) for t in self.stop_token_ids]
            while stripped := next((s for s in stop_texts if text.endswith(s)), None):
                text = text[: -len(stripped)]
        else:
            ids = list(turn)
            while ids and ids[-1] in self.stop_token_ids:
                ids.pop()
            text = self.decode(ids)
        return parse_assistant_text(text)

    def conversation(self, messages: Sequence[Message]) -> Conversation:
        """Start an episode: the prompt rendered from `messages`, ready for sampling."""
        return Conversation(self, messages)

    # -------------------------------------------------------------------------- helpers
    def _header(self, role: str) -> list[Piece]:
        return [self.im_start_id, Text(f"{role}\n")]

    def _conversation_pieces(
        self, messages: Sequence[Message], generation_prompt: bool, continue_final: bool
    ) -> list[Piece]:
        if continue_final and (not messages or messages[-1].role != Role.ASSISTANT):
            raise ChatFormatError("continue_final_message needs a final assistant message")
        if generation_prompt and continue_final:
            raise ChatFormatError(
                "add_generation_prompt and continue_final_message exclude each other"
            )
        pieces: list[Piece] = []
        has_system = bool(messages) and messages[0].role == Role.SYSTEM
        if not has_system and (text := self.system_text(self.config.system_prompt)):
            pieces += [
                *self._header("system"),
                Text(text, literal=True),
                self.end_of_turn_id,
                Text("\n"),
            ]
        pieces.extend(self._messages_pieces(messages, system_index=0 if has_system else -1))
        if continue_final:
            del pieces[-2:]  # the final `<|im_end|>` and "\n"
        if generation_prompt:
            pieces.extend(self._header("assistant"))
        return pieces

    def _messages_pieces(self, messages: Sequence[Message], system_index: int = -1) -> list[Piece]:
        pieces: list[Piece] = []
        i = 0
        while i < len(messages):
            message = messages[i]
            if message.role == Role.TOOL:
                j = i + 1
                if self.config.group_tool_results:
                    while j < len(messages) and messages[j].role == Role.TOOL:
                        j += 1
                body = "\n".join(
                    f"{TOOL_RESPONSE_OPEN}\n{m.content}\n{TOOL_RESPONSE_CLOSE}"
                    for m in messages[i:j]
                )
                pieces += [*self._header("tool"), Text(body, literal=True)]
                i = j
            elif message.role == Role.ASSISTANT:
                pieces += [*self._header("assistant"), Text(self.assistant_text(message), False)]
                i += 1
            else:
                text = message.content
                if i == system_index:
                    text = self.system_text(text) or ""
                pieces += [*self._header(message.role.value), Text(text, literal=True)]
                i += 1
            pieces += [self.end_of_turn_id, Text("\n")]
        return pieces

    def _tokenize(self, pieces: Sequence[Piece]) -> list[int]:
        return tokenize_pieces(self.tokenizer, pieces)
