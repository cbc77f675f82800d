r"""ChatML with Hermes tool calls (`chatml`): SmolLM2, the lab model, the default.

Every turn is ``<|im_start|>{role}\n{body}<|im_end|>\n``; tool results are
``<tool_response>`` blocks in a `tool` turn (docs/chat-format.md).
"""

from __future__ import annotations

from typing import ClassVar

from tir_rl.chat.family import ChatFormatName
from tir_rl.chat.tokens import Piece, Text
from tir_rl.chat.turns import TurnFormat

__all__ = ["IM_END", "IM_START", "ChatMLFormat"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class ChatMLFormat(TurnFormat):
    """ChatML turns, Hermes `<tool_call>` blocks, tool results in a `tool` turn."""

    name: ClassVar[ChatFormatName] = ChatFormatName.CHATML
    required_tokens: ClassVar[tuple[str, ...]] = (IM_START, IM_END)
    turn_separator: ClassVar[str] = "\n"

    def _end_of_turn_id(self) -> int:
        return self.special_ids[IM_END]

    def _header(self, role: str) -> list[Piece]:
        return [self.special_ids[IM_START], Text(f"{role}\n")]
