"""The chat format families, and which one a tokenizer carries (`chat.format: auto`).

Detection, first match wins (the choice is logged):

1. `llama3`: the tokenizer has ``<|start_header_id|>``, ``<|end_header_id|>`` and
   ``<|eot_id|>`` as single tokens.
2. `qwen`: it has ``<|im_start|>`` and ``<|im_end|>``, and Qwen's tool markers: its chat
   template mentions ``<tool_response>``, or ``<tool_call>`` is a single token.
3. `chatml`: it has ``<|im_start|>`` and ``<|im_end|>``.
4. `template`: it has a ``chat_template`` (checked at start-up by `TemplateFormat`).

Otherwise `ChatFormatError`. An explicit family is used as given: building it refuses a
tokenizer that lacks its tokens, it is never replaced by another family.
"""

from __future__ import annotations

import logging
from enum import StrEnum

from tir_rl.chat.tokens import Tokenizer
from tir_rl.errors import ChatFormatError

__all__ = ["ChatFormatName", "chat_template_of", "detect_format", "resolve_format"]

logger = logging.getLogger(__name__)

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
LLAMA3_MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


class ChatFormatName(StrEnum):
    """The chat format families (`chat.format` in a run config)."""

    AUTO = "auto"
    """Detect from the tokenizer (special tokens, template markers); the choice is logged."""
    CHATML = "chatml"
    """ChatML with Hermes tool calls in a `tool` role turn (SmolLM2, the lab model)."""
    QWEN = "qwen"
    """Qwen2.5 / Qwen3: ChatML, tool results as `<tool_response>` blocks in a `user` turn."""
    LLAMA3 = "llama3"
    """Llama 3.x: header tokens, JSON tool calls, tool results in `ipython` turns."""
    TEMPLATE = "template"
    """The tokenizer's own `chat_template`, after a start-up append-only check."""


class Llama3Layout(StrEnum):
    """Where the `llama3` family puts its tool block (`chat.llama3_layout`)."""

    COMPACT = "compact"
    """tir-rl's: the system text, then a short `# Tools` block, one schema per line."""
    META_USER = "meta_user"
    """Meta's Llama 3.1 template with its defaults: the system turn opens with its preamble
    (`Environment: ipython` when there are tools, the knowledge cutoff, the date), and the
    tools, with Meta's instructions and one indented schema each, open the first user turn."""
    META_SYSTEM = "meta_system"
    """Meta's template with `tools_in_user_message=False`: the same preamble, then the tools
    with Meta's system-turn instructions, then the system text."""


def special_token_id(tokenizer: Tokenizer, token: str) -> int | None:
    """Id of `token` when the tokenizer encodes it as that one token, else None."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None:
        return None
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    return token_id if ids == [token_id] else None


def chat_template_of(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's chat template text (the default one when it has several), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _has_tokens(tokenizer: Tokenizer, tokens: tuple[str, ...]) -> bool:
    return all(special_token_id(tokenizer, t) is not None for t in tokens)


def detect_format(tokenizer: Tokenizer) -> ChatFormatName:
    """The family `auto` picks for this tokenizer (see the module docstring).

    Raises:
        ChatFormatError: No family fits and the tokenizer has no chat template.
    """
    template = chat_template_of(tokenizer) or ""
    if _has_tokens(tokenizer, LLAMA3_MARKERS):
        return ChatFormatName.LLAMA3
    if _has_tokens(tokenizer, CHATML_TOKENS):
        if "<tool_response>" in template or special_token_id(tokenizer, "<tool_call>") is not None:
            return ChatFormatName.QWEN
        return ChatFormatName.CHATML
    if template:
        return ChatFormatName.TEMPLATE
    raise ChatFormatError(
        "chat.format=auto found no chat format for this tokenizer: the chatml and qwen formats "
        "each needs <|im_start|> and <|im_end|> as single special tokens, llama3 needs "
        "<|start_header_id|>, <|end_header_id|> and <|eot_id|>, and the tokenizer has no "
        "chat_template to fall back on. Use the model's own tokenizer, or add its template "
        "(docs/bring_your_model.md)."
    )


def resolve_format(tokenizer: Tokenizer, name: ChatFormatName | str) -> ChatFormatName:
    """The family to build: `name` as given, or for `auto` the detected one (logged).

    Raises:
        ChatFormatError: `name` is no family, or `auto` found none.
    """
    try:
        name = ChatFormatName(name)
    except ValueError:
        choices = ", ".join(n.value for n in ChatFormatName)
        raise ChatFormatError(f"chat.format={name!r} is not one of: {choices}") from None
    if name is ChatFormatName.AUTO:
        name = detect_format(tokenizer)
        logger.info("chat.format=auto: using the %r chat format for this tokenizer", name.value)
    return name
