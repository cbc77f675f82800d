"""A probe conversation, and where two renderings of it first differ.

`PROBE_MESSAGES` has a tool call, two tool results (the first with spaces, a newline, `<`,
`&` and quotes, for templates that trim, escape or quote), a Qwen3-style reasoning block in an
earlier turn and a second user query: enough to show how a template places tools and tool
results, whether it re-renders earlier turns, and whether it keeps reasoning.
`template_diff` compares a chat format's rendering of it with the tokenizer's own
`apply_chat_template` (`tir-rl doctor`); `TemplateFormat` checks a template on it at
start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tir_rl.chat.family import ChatFormatName, chat_template_of
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role, ToolCall

if TYPE_CHECKING:
    from tir_rl.chat.format import ChatFormat
    from tir_rl.chat.tokens import Tokenizer

__all__ = [
    "PROBE_MESSAGES",
    "PROBE_TOOL_SCHEMA",
    "TokenDiff",
    "probe_conversations",
    "template_diff",
]

PROBE_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
"""The tool of the probe, used when the run's environment has none."""

PROBE_MESSAGES: tuple[Message, ...] = (
    Message.system("You are a calculator."),
    Message.user("What is 2+3 and 4+4?"),
    Message.assistant("", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 4, "b": 4})]),
    # Tool output as tools write it: a template that trims, escapes or quotes contents shows.
    Message.tool('  5 <int> & "ok"\n', name="add"),
    Message.tool("8", name="add"),
    Message.assistant("<think>\nBoth sums are back.\n</think>\n\n2+3 is 5 and 4+4 is 8."),
    Message.user("Thanks. And 1+1?"),
    Message.assistant("1+1 is 2."),
)


PROBE_MESSAGES_ONE_CALL_PER_TURN: tuple[Message, ...] = (
    *PROBE_MESSAGES[:2],
    Message.assistant("", [ToolCall("add", {"a": 2, "b": 3})]),
    PROBE_MESSAGES[3],
    Message.assistant("", [ToolCall("add", {"a": 4, "b": 4})]),
    *PROBE_MESSAGES[4:],
)
"""The probe with one call per assistant turn: Meta's Llama 3.x templates refuse several."""


def probe_conversations(chat_format: ChatFormat) -> dict[str, tuple[Message, ...]]:
    """The conversations `tir-rl doctor` compares with the template, by a readable label.

    The probe (one call per turn for `llama3`, whose templates refuse several), and the same
    without its system message: a template that writes a default system prompt (Qwen2.5's
    "You are Qwen, created by Alibaba Cloud...") shows only there.
    """
    llama3 = chat_format.name is ChatFormatName.LLAMA3
    probe = PROBE_MESSAGES_ONE_CALL_PER_TURN if llama3 else PROBE_MESSAGES
    return {"probe conversation": probe, "probe without a system message": probe[1:]}


@dataclass(frozen=True)
class TokenDiff:
    """Where two token lists of one conversation first differ.

    Attributes:
        position: First differing index (the shorter length when one is a prefix).
        ours_len: Length of the first list (the chat format's).
        theirs_len: Length of the second list (the template's).
        ours_text: Decoded first-list tokens around `position`.
        theirs_text: Decoded second-list tokens around `position`.
    """

    position: int
    ours_len: int
    theirs_len: int
    ours_text: str
    theirs_text: str

    def describe(self, ours: str = "ours", theirs: str = "template") -> str:
        """One readable paragraph for errors and reports."""
        width = max(len(ours), len(theirs))
        return (
            f"first difference at token {self.position} (lengths {self.ours_len} vs "
            f"{self.theirs_len}):\n  {ours.ljust(width)} {self.ours_text!r}\n"
            f"  {theirs.ljust(width)} {self.theirs_text!r}"
        )


def diff_tokens(
    ours: Sequence[int],
    theirs: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    *,
    window: int = 8,
) -> TokenDiff | None:
    """The first difference of two token lists, or None when they are equal."""
    if list(ours) == list(theirs):
        return None
    pos = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    lo = max(0, pos - window)
    return TokenDiff(
        pos,
        len(ours),
        len(theirs),
        decode(list(ours[lo : pos + window])),
        decode(list(theirs[lo : pos + window])),
    )


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as `apply_chat_template` takes them; calls of hand-built turns as `tool_calls`."""
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role.value, "content": m.content}
        if m.role == Role.ASSISTANT and m.tool_calls:
            entry["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.role == Role.TOOL and m.name:
            entry["name"] = m.name
        out.append(entry)
    return out


def apply_template(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    tool_schemas: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """`tokenizer.apply_chat_template` as text (`variables`: extra template variables).

    Raises:
        ChatFormatError: The template failed on the conversation.
    """
    try:
        return tokenizer.apply_chat_template(  # type: ignore[attr-defined]  (a HF tokenizer)
            conversation,
            tools=list(tool_schemas) or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(variables or {}),
        )
    except Exception as exc:  # noqa: BLE001 (jinja errors of a user template, re-raised typed)
        raise ChatFormatError(
            f"the tokenizer's chat_template failed on the probe conversation "
            f"({type(exc).__name__}: {exc}); pick a named family (chat.format: chatml, qwen "
            "or llama3), docs/bring_your_model.md"
        ) from exc


def encode_template_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered template text, as `apply_chat_template(tokenize=True)` gives."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_diff(
    chat_format: ChatFormat, messages: Sequence[Message] = PROBE_MESSAGES
) -> TokenDiff | None:
    """Our rendering of `messages` against the tokenizer's chat template; None when equal.

    Both render the chat format's tool schemas. Hand-built assistant calls are given to
    the template as `tool_calls`, so it writes them in its own syntax.

    Raises:
        ChatFormatError: The tokenizer has no chat template, or the template failed.
    """
    tokenizer = chat_format.tokenizer
    if chat_template_of(tokenizer) is None:
        raise ChatFormatError("the tokenizer has no chat_template to compare with")
    ours = chat_format.render_messages(messages)
    text = apply_template(
        tokenizer,
        template_messages(messages),
        chat_format.tool_schemas,
        variables=chat_format.template_variables(),
    )
    return diff_tokens(ours, encode_template_text(tokenizer, text), chat_format.decode)
