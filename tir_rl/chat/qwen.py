"""Qwen2.5 / Qwen3 (`qwen`): ChatML whose tool results go back in a `user` turn.

The published Qwen templates render consecutive tool messages as ``<tool_response>`` blocks
inside one ``<|im_start|>user`` turn, and put the tool block (``# Tools`` ... ``<tools>`` ...
``<tool_call>``) at the end of the system turn; tool calls are Hermes ``<tool_call>``
blocks. Qwen3's ``<think>...</think>`` reasoning is part of the sampled assistant text and is
kept verbatim in every later turn (the token list is append-only, and training sees what
was sampled), whereas Qwen3's template drops earlier turns' reasoning when it re-renders a
whole conversation: `tir-rl doctor` reports that difference (docs/chat-format.md). With
`chat.enable_thinking: false` every sampled turn opens with Qwen3's empty reasoning block.
"""

from __future__ import annotations

from typing import ClassVar

from tir_rl.chat.chatml import ChatMLFormat
from tir_rl.chat.family import ChatFormatName
from tir_rl.chat.tokens import Piece, Text

__all__ = ["EMPTY_THINKING", "QwenFormat"]

EMPTY_THINKING = "<think>\n\n</think>\n\n"
"""What Qwen3's template puts after the assistant header with `enable_thinking=False`."""


class QwenFormat(ChatMLFormat):
    """ChatML turns and Hermes calls; tool results as `<tool_response>` blocks in `user`."""

    name: ClassVar[ChatFormatName] = ChatFormatName.QWEN
    tool_role: ClassVar[str] = "user"

    def _honours_enable_thinking(self) -> bool:
        return True

    def _generation_header(self) -> list[Piece]:
        """With `enable_thinking: false`, Qwen3's empty reasoning block after the header."""
        header = self._header("assistant")
        if self.config.enable_thinking is False:
            header.append(Text(EMPTY_THINKING, literal=False))
        return header
