"""Qwen- and Llama-3-style tokenizers built offline from the bundled SmolLM2 tokenizer.

Each adds its family's special tokens to the bundled tokenizer and sets a chat template
written here from the family's documented wire format (Qwen2.5's tool-calling template;
Llama 3.1's JSON tool calling, with the tool block in the system turn as tir-rl writes it).
The Llama one also gets Llama 3's pre-tokenizer split rule, so that a newline run is one
piece as in the real Llama 3 tokenizer.
"""

from __future__ import annotations

from tir_rl.chat.llama3 import LLAMA3_TOOL_INSTRUCTIONS
from tir_rl.models import prepare_bundled_model

QWEN_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
"""Plain added tokens (not special), as in the Qwen2.5 / Qwen3 tokenizers."""

LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenizer regex (tiktoken cl100k style)."""

_QWEN_TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

QWEN_TEMPLATE = (
    # system turn: the system text, then the tool block
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    + _QWEN_TOOLS_BLOCK
    + "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    # consecutive tool results share one user turn
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-style: tools in the system turn, tool results as user-turn `<tool_response>`s."""

_LLAMA3_TOOLS_BLOCK = LLAMA3_TOOL_INSTRUCTIONS.replace(
    "{tools}",
    "{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}\n{% endif %}{% endfor %}",
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = none %}"
    "{% set rest = messages %}{% endif %}"
    "{% if system is not none or tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if system is not none %}{{ system }}{% if tools %}\n\n{% endif %}{% endif %}"
    "{% if tools %}" + _LLAMA3_TOOLS_BLOCK + "{% endif %}<|eot_id|>{% endif %}"
    "{% for message in rest %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": '
    "{{ call.function.arguments | tojson }}}{% if not loop.last %}\n{% endif %}"
    "{% endfor %}<|eot_id|>"
    "{% elif message.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama-3.1-style: header turns, JSON calls with "parameters", results in `ipython`."""


def _keep_newlines(template: str) -> str:
    """Write newlines that follow a block tag as expressions (HF renders with trim_blocks)."""
    return template.replace("%}\n", "%}{{ '\\n' }}")


def bundled_tokenizer():
    """A fresh copy of the bundled SmolLM2 tokenizer (callers may modify it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_bundled_model())


def qwen_tokenizer(template: str = QWEN_TEMPLATE):
    """The bundled tokenizer with Qwen's added tool/think tokens and a Qwen2.5-style template."""
    tokenizer = bundled_tokenizer()
    tokenizer.add_tokens(list(QWEN_ADDED_TOKENS))
    tokenizer.chat_template = _keep_newlines(template)
    return tokenizer


def llama3_tokenizer(template: str = LLAMA3_TEMPLATE):
    """The bundled tokenizer with Llama 3's special tokens, pre-tokenizer and template."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = bundled_tokenizer()
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": list(LLAMA3_SPECIAL_TOKENS),
        }
    )
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.chat_template = _keep_newlines(template)
    return tokenizer
