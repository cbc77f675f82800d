"""The model's own chat template (`template`), accepted only after a start-up check.

Rendering goes through `tokenizer.apply_chat_template`, with each message's content
replaced by a placeholder; the rendered text is then cut at the placeholders, so the
template's own text (headers, special tokens) is tokenized with special tokens parsed while
user, tool and system text still never becomes special tokens, exactly as in the named
families. Assistant turns are given to the template as their text (tool calls as Hermes
``<tool_call>`` blocks, which is also how this family parses them).

The environment's turns after a sampled assistant turn are the template's rendering of a
short stub conversation plus those turns, minus its rendering of the stub alone; they start
at the template's end-of-turn token (dropped when the model sampled it).

The start-up check (`check_template`) refuses, with `ChatFormatError` naming the first
differing token and the texts there, a template that on `PROBE_MESSAGES`:

1. is not append-only: rendering the conversation up to an assistant turn (with the
   generation prompt) is not a prefix of rendering the whole conversation (e.g. templates
   that rewrite earlier turns, like Qwen3's dropping of earlier reasoning);
2. transforms message contents (trims, splits), so that the placeholder rendering differs
   from the real one;
3. is not TITO-consistent: the incremental token list differs from the full render.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from tir_rl.chat.family import ChatFormatName, chat_template_of
from tir_rl.chat.format import ChatFormat, check_render_flags
from tir_rl.chat.probe import (
    PROBE_MESSAGES,
    PROBE_TOOL_SCHEMA,
    apply_template,
    diff_tokens,
    encode_template_text,
    template_messages,
)
from tir_rl.chat.tokens import Piece, Text
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role

if TYPE_CHECKING:
    from tir_rl.chat.tokens import Tokenizer

__all__ = ["TemplateFormat", "check_template"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: never in a template
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_STUB = (Message.user("Hello."), Message.assistant("Hello!"))
_PICK_A_FAMILY = (
    "The template cannot be used as is: pick a named family (chat.format: chatml, qwen or "
    "llama3; docs/bring_your_model.md)."
)


class TemplateFormat(ChatFormat):
    """The tokenizer's own chat template, refused unless append-only and TITO-consistent."""

    name: ClassVar[ChatFormatName] = ChatFormatName.TEMPLATE

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        tool_schemas: Sequence[dict[str, Any]] = (),
        config: ChatFormat.Config | None = None,
    ) -> None:
        super().__init__(tokenizer, tool_schemas=tool_schemas, config=config)
        check_template(self)

    def _prepare(self) -> None:
        if chat_template_of(self.tokenizer) is None:
            raise ChatFormatError(
                "chat.format=template but the tokenizer has no chat_template; pick a named "
                "family (chatml, qwen, llama3) or use the model's own tokenizer folder"
            )
        if self.config.tool_instructions is not None:
            raise ChatFormatError(
                "chat.tool_instructions does not apply to chat.format=template: the template "
                "writes its own tool block. Leave it unset, or pick a named family."
            )
        if self.config.group_tool_results is not None:
            raise ChatFormatError(
                "chat.group_tool_results does not apply to chat.format=template: the template "
                "decides how tool results are grouped. Leave it unset."
            )
        self._special_pattern = _special_pattern(self.tokenizer)

    def _honours_enable_thinking(self) -> bool:
        """Only a template that reads the variable can honour it (Qwen3's does)."""
        return "enable_thinking" in (chat_template_of(self.tokenizer) or "")

    def _end_of_turn_id(self) -> int:
        pieces = self._pieces(list(_STUB), generation_prompt=False)
        cut = self._after_last_content(pieces)
        after = pieces[cut:]
        if not after or not isinstance(after[0], int):
            raise ChatFormatError(
                "the chat template does not close an assistant turn with a special token "
                f"(after the assistant's text it writes {self._text(after)!r}), so the model "
                f"has no token to stop on. {_PICK_A_FAMILY}"
            )
        return after[0]

    # ---------------------------------------------------------------------- rendering
    def _effective(self, messages: Sequence[Message]) -> list[Message]:
        has_system = bool(messages) and messages[0].role == Role.SYSTEM
        if not has_system and self.config.system_prompt is not None:
            return [Message.system(self.config.system_prompt), *messages]
        return list(messages)

    def template_text(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False
    ) -> str:
        """The template's own text for `messages` (real contents, assistant turns as text)."""
        conversation = template_messages(self._as_text(self._effective(messages)))
        return apply_template(
            self.tokenizer,
            conversation,
            self.tool_schemas,
            add_generation_prompt=add_generation_prompt,
            variables=self.template_variables(),
        )

    def _as_text(self, messages: Sequence[Message]) -> list[Message]:
        return [
            Message.assistant(self.assistant_text(m)) if m.role == Role.ASSISTANT else m
            for m in messages
        ]

    def _pieces(self, messages: list[Message], *, generation_prompt: bool) -> list[Piece]:
        """Pieces of the template's rendering, contents put back in at their placeholders."""
        messages = self._as_text(messages)
        placeholders = [
            Message(m.role, f"{_OPEN}{i}{_CLOSE}", name=m.name) for i, m in enumerate(messages)
        ]
        text = apply_template(
            self.tokenizer,
            template_messages(placeholders),
            self.tool_schemas,
            add_generation_prompt=generation_prompt,
            variables=self.template_variables(),
        )
        pieces: list[Piece] = []
        pos = 0
        for match in _PLACEHOLDER.finditer(text):
            pieces += self._format_pieces(text[pos : match.start()])
            message = messages[int(match.group(1))]
            pieces.append(Text(message.content, literal=message.role != Role.ASSISTANT))
            pos = match.end()
        pieces += self._format_pieces(text[pos:])
        _check_runs(pieces)
        return pieces

    def _format_pieces(self, text: str) -> list[Piece]:
        """The template's own text: special-token strings as their ids, the rest as text."""
        pieces: list[Piece] = []
        pos = 0
        if self._special_pattern is not None:
            for match in self._special_pattern.finditer(text):
                if match.start() > pos:
                    pieces.append(Text(text[pos : match.start()]))
                token_id = self.tokenizer.convert_tokens_to_ids(match.group(0))
                assert token_id is not None
                pieces.append(token_id)
                pos = match.end()
        if pos < len(text):
            pieces.append(Text(text[pos:]))
        return pieces

    def _after_last_content(self, pieces: Sequence[Piece]) -> int:
        """Index just after the last message content (an assistant's text) in `pieces`."""
        for i in range(len(pieces) - 1, -1, -1):
            piece = pieces[i]
            if isinstance(piece, Text) and piece.literal is False:
                return i + 1
        raise ChatFormatError(f"the chat template dropped the assistant's text. {_PICK_A_FAMILY}")

    def _text(self, pieces: Sequence[Piece]) -> str:
        return "".join(p.text if isinstance(p, Text) else self.decode([p]) for p in pieces)

    def _conversation_pieces(
        self, messages: Sequence[Message], generation_prompt: bool, continue_final: bool
    ) -> list[Piece]:
        check_render_flags(messages, generation_prompt, continue_final)
        pieces = self._pieces(self._effective(messages), generation_prompt=generation_prompt)
        if continue_final:
            pieces = pieces[: self._after_last_content(pieces)]
        return pieces

    def _env_pieces(self, messages: Sequence[Message], close_turn: bool) -> list[Piece]:
        stub = self._effective(_STUB)
        before = self._pieces(stub, generation_prompt=False)
        before = before[: self._after_last_content(before)]
        after = self._pieces([*stub, *messages], generation_prompt=True)
        if after[: len(before)] != before or not after[len(before) :]:
            raise ChatFormatError(
                "the chat template renders the turns before the environment's answer "
                f"differently once the answer is added. {_PICK_A_FAMILY}"
            )
        pieces = after[len(before) :]
        if pieces[0] != self.end_of_turn_id:
            raise ChatFormatError(
                "the chat template does not close the assistant turn before the "
                f"environment's answer with its end-of-turn token. {_PICK_A_FAMILY}"
            )
        return pieces if close_turn else pieces[1:]


def _special_pattern(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """Matches the tokenizer's added tokens (longest first), which the template writes."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = sorted({str(t) for t in decoder.values()}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None


def _check_runs(pieces: Sequence[Piece]) -> None:
    run: set[bool] = set()
    for piece in [*pieces, -1]:
        if isinstance(piece, Text):
            if piece.literal is not None:
                run.add(piece.literal)
            continue
        if len(run) > 1:
            raise ChatFormatError(
                "the chat template writes an assistant's text and the environment's text "
                "without a special token between them, so they cannot be told apart. "
                + _PICK_A_FAMILY
            )
        run = set()


def check_template(fmt: TemplateFormat, messages: Sequence[Message] = PROBE_MESSAGES) -> None:
    """Refuse a template that is not append-only or not TITO-consistent on `messages`.

    Raises:
        ChatFormatError: What differed (first differing token, the texts there) and what to
            do.
    """
    from tir_rl.chat.conversation import compare_incremental_with_full

    tokenizer = fmt.tokenizer
    if not fmt.tool_schemas:  # check the template's tool block too
        fmt = copy.copy(fmt)
        fmt.tool_schemas = (PROBE_TOOL_SCHEMA,)
    encode = lambda text: encode_template_text(tokenizer, text)  # noqa: E731 (local alias)
    full_text = fmt.template_text(messages)
    full = encode(full_text)
    for k, message in enumerate(messages):
        if message.role != Role.ASSISTANT:
            continue
        prompt_text = fmt.template_text(messages[:k], add_generation_prompt=True)
        if not full_text.startswith(prompt_text):
            diff = diff_tokens(encode(prompt_text), full, fmt.decode)
            assert diff is not None
            raise ChatFormatError(
                f"the chat template is not append-only: rendering the probe conversation up "
                f"to assistant turn {k} is not a prefix of rendering all of it, "
                f"{diff.describe('prefix', 'full')}\n{_PICK_A_FAMILY}"
            )
    diff = diff_tokens(fmt.render_messages(messages), full, fmt.decode)
    if diff is not None:
        raise ChatFormatError(
            "the chat template changes message contents (trims or rewrites them), so its "
            f"rendering cannot be rebuilt around the sampled tokens, {diff.describe()}\n"
            f"{_PICK_A_FAMILY}"
        )
    tito = compare_incremental_with_full(messages, chat_format=fmt)
    if not tito.equal:
        raise ChatFormatError(
            "the chat template is not TITO-consistent: appending the environment's turns "
            f"gives other tokens than rendering the conversation at once; {tito.describe()}\n"
            f"{_PICK_A_FAMILY}"
        )
