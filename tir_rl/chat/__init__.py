"""The chat stage: messages ⇄ token ids, in the chat format of the model's family.

`format` is the interface every family implements (`ChatFormat`; `ChatFormat(tokenizer,
config=...)` builds the configured family), `turns` the turn-by-turn rendering the named
families share; `chatml`, `qwen`, `llama3` and `template` are the families, `family` picks
one (`auto`), `probe` diffs a rendering against the tokenizer's own template.
`conversation` grows one episode's token list append-only (`Conversation`), `parse` reads
Hermes tool calls and parse errors, `tokens` tokenizes text runs around special tokens.
"""

from tir_rl.chat.chatml import ChatMLFormat
from tir_rl.chat.conversation import Conversation, RenderDiff, compare_incremental_with_full
from tir_rl.chat.family import ChatFormatName, detect_format
from tir_rl.chat.format import ChatFormat
from tir_rl.chat.llama3 import Llama3Format
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
from tir_rl.chat.probe import PROBE_MESSAGES, TokenDiff, template_diff
from tir_rl.chat.qwen import QwenFormat
from tir_rl.chat.template import TemplateFormat

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "PROBE_MESSAGES",
    "ChatFormat",
    "ChatFormatName",
    "ChatMLFormat",
    "Conversation",
    "Llama3Format",
    "ParseErrorKind",
    "ParsedTurn",
    "QwenFormat",
    "RenderDiff",
    "TemplateFormat",
    "TokenDiff",
    "ToolCallParseError",
    "assistant_message",
    "compare_incremental_with_full",
    "detect_format",
    "parse_assistant_text",
    "template_diff",
    "tool_result_message",
]
