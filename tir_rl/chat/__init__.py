"""The chat stage: messages ⇄ token ids, for one model family's chat format.

`format` renders ChatML with Hermes tool calls (`ChatFormat`), `conversation` grows one
episode's token list append-only (`Conversation`), `parse` reads an assistant turn into tool
calls and parse errors, `tokens` tokenizes text runs around special tokens.
"""

from tir_rl.chat.conversation import Conversation, RenderDiff, compare_incremental_with_full
from tir_rl.chat.format import ChatFormat
from tir_rl.chat.parse import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedTurn,
    ParseErrorKind,
    ToolCallParseError,
    assistant_message,
    parse_assistant_text,
    tool_result_message,
)

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ChatFormat",
    "Conversation",
    "ParseErrorKind",
    "ParsedTurn",
    "RenderDiff",
    "ToolCallParseError",
    "assistant_message",
    "compare_incremental_with_full",
    "parse_assistant_text",
    "tool_result_message",
]
