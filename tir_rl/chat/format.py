"""The chat format: one interface, several model families (docs/chat-format.md).

`ChatFormat` renders messages to token ids, appends the environment's turns after a sampled
assistant turn (TITO, `Conversation`) and parses assistant turns into tool calls. The
families implement it:

- `chatml` (`ChatMLFormat`): ChatML with Hermes tool calls and a `tool` role (SmolLM2, the
  lab model);
- `qwen` (`QwenFormat`): Qwen2.5 / Qwen3: ChatML whose tool results are `<tool_response>`
  blocks inside a `user` turn;
- `llama3` (`Llama3Format`): Llama 3.x headers, JSON tool calls, results in `ipython` turns;
- `template` (`TemplateFormat`): the tokenizer's own `chat_template`, accepted only after a
  start-up check that it is append-only and TITO-consistent.

`ChatFormat(tokenizer, ...)` builds the family `Config.format` names (`auto`: detected from
the tokenizer, see `tir_rl.chat.family`). This module holds what every family shares
(tokenizing, decoding, stop tokens, parsing, the default Hermes call text); the named
families' turn-by-turn rendering is `tir_rl.chat.turns`.

Special tokens are only ever produced by the format itself or sampled by the model: text
written by users, tools and system prompts is tokenized with `split_special_tokens`, so a
tool that prints ``<|im_end|>`` cannot end a turn. Text is tokenized in runs that start and
end at special tokens, which is what makes incremental rendering (`Conversation`) stable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tir_rl.chat.conversation import Conversation
from tir_rl.chat.family import ChatFormatName, Llama3Layout, resolve_format
from tir_rl.chat.parse import ParsedTurn, assistant_message, parse_assistant_text
from tir_rl.chat.tokens import Piece, Text, Tokenizer, tokenize_pieces
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role

__all__ = ["ChatFormat", "check_render_flags"]


class ChatFormat:
    """Renders messages to token ids and parses assistant turns; one subclass per family.

    `ChatFormat(tokenizer, ...)` builds the family named by `config.format` (`auto`:
    detected); a family class can also be built directly.

    Args:
        tokenizer: A Hugging Face tokenizer with the family's special tokens.
        tool_schemas: OpenAI-style tool JSON schemas (`ToolRegistry.json_schemas`), shown in
            the system turn. Empty: no tool block.
        config: Rendering options.

    Raises:
        ChatFormatError: The tokenizer cannot carry the family (its special tokens are
            missing, or its template failed the start-up check), or a setting does not apply.
    """

    @dataclass(kw_only=True)
    class Config:
        """Options of the chat format (the run config's `chat` section)."""

        format: ChatFormatName = ChatFormatName.AUTO
        """Family: `auto` (detected from the tokenizer and logged), `chatml`, `qwen`,
        `llama3`, or `template` (the tokenizer's own chat_template, checked at start-up). A
        family the tokenizer cannot carry is refused, never replaced."""
        system_prompt: str | None = None
        """System text used when the messages do not start with a system message. None: no
        system turn, except the tool block when tools are given."""
        tool_instructions: str | None = None
        """Tool block appended to the system text; `{tools}` is replaced by the schemas, one
        JSON object per line. None: the family's own block (`template`: refused, the
        template writes its own)."""
        group_tool_results: bool | None = None
        """Consecutive tool messages share one turn (one `<tool_response>` block each);
        False gives each its own turn. None: the family's rule (chatml, qwen: shared;
        llama3: one `ipython` turn each, and True is refused; template: the template's)."""
        extra_stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
        """Token ids that also end a turn when sampled, besides the end-of-turn token and
        EOS."""
        enable_thinking: bool | None = None
        """Qwen3's thinking switch. False: every assistant turn opens with an empty
        `<think>\n\n</think>\n\n` block, rendered (not sampled), as Qwen3's template does with
        `enable_thinking=False`, so the model answers without reasoning. True: the model
        decides, as the template's default. None: not set. Honoured by `qwen` and by a
        `template` whose text reads `enable_thinking`; refused by the other families."""
        llama3_layout: Llama3Layout | None = None
        """Where `llama3` puts its tools: `compact` (None: tir-rl's tool block at the end of
        the system turn), `meta_user` (Meta's Llama 3.1 template: its system preamble, the
        tools in the first user turn) or `meta_system` (Meta's with
        `tools_in_user_message=False`). Refused by the other families."""
        llama3_date: str = "26 Jul 2024"
        """The `Today Date:` of the Meta layouts. Meta's template writes this date when it
        cannot read the clock; rendered through transformers it writes the day of rendering
        (`strftime_now`), so set it to match a conversation rendered that way."""

    name: ClassVar[ChatFormatName]
    """The family."""
    _families: ClassVar[dict[ChatFormatName, type[ChatFormat]]] = {}
    """Every family class, by name (filled as the family modules are imported)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a family, not a shared base like `TurnFormat`
            ChatFormat._families[cls.name] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> ChatFormat:  # noqa: D102 (dispatch, see the class docstring)
        if cls is not ChatFormat:  # a family class, built directly (or copied)
            return super().__new__(cls)
        tokenizer = args[0] if args else kwargs["tokenizer"]
        config = kwargs.get("config") or ChatFormat.Config()
        return super().__new__(ChatFormat._families[resolve_format(tokenizer, config.format)])

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
        given = self.config.format
        if given not in (ChatFormatName.AUTO, self.name):
            raise ChatFormatError(
                f"chat.format={given.value!r} but {type(self).__name__} is the "
                f"{self.name.value!r} family: build ChatFormat(tokenizer, config=...) to get "
                "the family the config names"
            )
        self._prepare()
        if self.config.enable_thinking is not None and not self._honours_enable_thinking():
            raise ChatFormatError(
                f"chat.enable_thinking={self.config.enable_thinking} but the {self.name.value!r} "
                "chat format has no thinking switch (Qwen3's): use chat.format=qwen, or "
                "template with a chat_template that reads enable_thinking, or leave it unset."
            )
        if self.config.llama3_layout is not None and self.name is not ChatFormatName.LLAMA3:
            raise ChatFormatError(
                f"chat.llama3_layout={self.config.llama3_layout} applies to chat.format="
                f"llama3, not {self.name.value!r}: leave it unset."
            )
        self.end_of_turn_id: int = self._end_of_turn_id()
        """Closes every turn; sampled by the model to end its turn."""
        stops = [self.end_of_turn_id, *self._other_stop_ids()]
        if tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        stops.extend(self.config.extra_stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        """Token ids that end an assistant turn (the end-of-turn token first, then the
        family's others, EOS and extras)."""

    def template_variables(self) -> dict[str, Any]:
        """Variables a chat template is rendered with to match this format (doctor, template)."""
        thinking = self.config.enable_thinking
        return {} if thinking is None else {"enable_thinking": thinking}

    # ------------------------------------------------------------------- family hooks
    def _prepare(self) -> None:
        """Check the tokenizer and config, and set what the other hooks need."""

    def _end_of_turn_id(self) -> int:
        raise NotImplementedError

    def _honours_enable_thinking(self) -> bool:
        """Whether the family renders `Config.enable_thinking` (the others refuse it)."""
        return False

    def _conversation_pieces(
        self, messages: Sequence[Message], generation_prompt: bool, continue_final: bool
    ) -> list[Piece]:
        raise NotImplementedError

    def _env_pieces(self, messages: Sequence[Message], close_turn: bool) -> list[Piece]:
        raise NotImplementedError

    def _other_stop_ids(self) -> list[int]:
        return []

    def parse_text(self, text: str) -> ParsedTurn:
        """Split assistant text (no end-of-turn token) into prose, calls and parse errors."""
        return parse_assistant_text(text)

    def assistant_text(self, message: Message) -> str:
        """Text of an assistant turn as the model sees it.

        The content, plus its `tool_calls` as blocks when the content has none (hand-built
        messages); content that already holds blocks (sampled turns) is used verbatim.
        """
        from tir_rl.chat.parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

        if not message.tool_calls or TOOL_CALL_OPEN in message.content:
            return message.content
        blocks = [
            f"{TOOL_CALL_OPEN}\n"
            + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
            + f"\n{TOOL_CALL_CLOSE}"
            for c in message.tool_calls
        ]
        return "\n".join([message.content, *blocks] if message.content else blocks)

    # ----------------------------------------------------------------------------- text
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
        """Token ids of the prompt, ending with the assistant turn's header."""
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
            continue_final_message: Leave the final (assistant) message open: no end-of-turn
                token (and separator) after it.
        """
        pieces = self._conversation_pieces(messages, add_generation_prompt, continue_final_message)
        return tokenize_pieces(self.tokenizer, pieces)

    def render_env_turns(self, messages: Sequence[Message], *, close_turn: bool) -> list[int]:
        """Tokens appended after an assistant turn: closing, env turns, next assistant header.

        Args:
            messages: Tool, user or system messages answering the assistant turn.
            close_turn: Prepend the end-of-turn token (the sampled turn did not end with it).
        """
        _check_env_messages(messages)
        return tokenize_pieces(self.tokenizer, self._env_pieces(messages, close_turn))

    def encode_assistant_text(self, text: str) -> list[int]:
        """Token ids of assistant text as the tokenizer writes it.

        Special-token strings become special tokens. Used to replay given assistant messages
        as if they had been sampled.
        """
        return tokenize_pieces(self.tokenizer, [Text(text, literal=False)])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Exact text of token ids: special tokens kept, no clean-up of spaces."""
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    # -------------------------------------------------------------------------- parsing
    def parse_assistant(self, turn: str | Sequence[int]) -> ParsedTurn:
        """Parse an assistant turn given as text or sampled token ids; never raises.

        Trailing stop tokens (end of turn, EOS) are dropped before parsing.
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
        return self.parse_text(text)

    def message_from_text(self, text: str) -> Message:
        """The assistant message of sampled text: its calls and malformed blocks, in order."""
        return assistant_message(text, parsed=self.parse_text(text))

    def conversation(self, messages: Sequence[Message]) -> Conversation:
        """Start an episode: the prompt rendered from `messages`, ready for sampling."""
        return Conversation(self, messages)

    # -------------------------------------------------------------------------- helpers


def check_render_flags(
    messages: Sequence[Message], generation_prompt: bool, continue_final: bool
) -> None:
    """Refuse contradictory rendering flags."""
    if continue_final and (not messages or messages[-1].role != Role.ASSISTANT):
        raise ChatFormatError("continue_final_message needs a final assistant message")
    if generation_prompt and continue_final:
        raise ChatFormatError("add_generation_prompt and continue_final_message exclude each other")


def _check_env_messages(messages: Sequence[Message]) -> None:
    for message in messages:
        if message.role == Role.ASSISTANT:
            raise ChatFormatError(
                "assistant turns are sampled, not appended: pass only tool, user or system "
                "messages to Conversation.append_messages"
            )


class ChatFormats:
    """One tokenizer's chat formats, one per distinct tool set, each built once.

    The agent loop and the chat endpoint it serves share one, so both render a tool set's
    prompt with the same format object.
    """

    def __init__(self, tokenizer: Tokenizer, config: ChatFormat.Config) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._built: dict[str, ChatFormat] = {}

    def for_tools(self, tool_schemas: Sequence[dict[str, Any]]) -> ChatFormat:
        """The chat format showing `tool_schemas`."""
        key = json.dumps(list(tool_schemas), sort_keys=True, default=str)
        fmt = self._built.get(key)
        if fmt is None:
            fmt = ChatFormat(self.tokenizer, tool_schemas=tool_schemas, config=self.config)
            self._built[key] = fmt
        return fmt
