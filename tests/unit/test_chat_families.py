"""The chat format families on real tokenizers: exact renders, parsing, TITO, choice, refusal.

The Qwen and Llama 3 tokenizers are the bundled SmolLM2 tokenizer with the family's tokens
and a template written from its documented format (`chat_tokenizers`); nothing is
downloaded.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from chat_tokenizers import QWEN_TEMPLATE, bundled_tokenizer, llama3_tokenizer, qwen_tokenizer

from tir_rl.chat import (
    PROBE_MESSAGES,
    ChatFormat,
    ChatFormatName,
    ChatMLFormat,
    Llama3Format,
    ParseErrorKind,
    QwenFormat,
    TemplateFormat,
    compare_incremental_with_full,
    detect_format,
)
from tir_rl.chat.probe import template_messages
from tir_rl.errors import ChatFormatError
from tir_rl.types import Message, Role, ToolCall

DOCS = Path(__file__).resolve().parents[2] / "docs"
TINY_SCHEMA = {"type": "function", "function": {"name": "add"}}
"""The tool of the documented examples (short, so that the examples are exact)."""
CALCULATOR = [
    Message.system("You are a calculator."),
    Message.user("What is 2+3?"),
    Message.assistant("", [ToolCall("add", {"a": 2, "b": 3})]),
    Message.tool("5", name="add"),
    Message.assistant("The answer is 5."),
]


@pytest.fixture(scope="module")
def smol():
    return bundled_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def llama_tok():
    return llama3_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def documented_example(family: str) -> str:
    """The fenced block after `<!-- example: {family} -->` in docs/chat-format.md."""
    doc = (DOCS / "chat-format.md").read_text()
    match = re.search(rf"<!-- example: {family} -->\n```\n(.*?)\n```", doc, re.DOTALL)
    assert match, f"docs/chat-format.md has no example for {family}"
    return match.group(1)


# ------------------------------------------------------------------------ exact renders
QWEN_EXPECTED = (
    "<|im_start|>system\nYou are a calculator.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TINY_SCHEMA)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 5.<|im_end|>\n"
)

LLAMA3_EXPECTED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "You are a calculator.\n\n# Tools\n\n"
    "You can call the functions listed below. To call one, answer with nothing but a JSON "
    'object {"name": <function-name>, "parameters": <arguments-object>}. The result comes '
    "back in the next turn.\n\n" + json.dumps(TINY_SCHEMA) + "<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is 5.<|eot_id|>"
)


def test_qwen_puts_tool_results_in_a_user_turn_exactly(qwen_tok):
    fmt = QwenFormat(qwen_tok, tool_schemas=[TINY_SCHEMA])
    assert fmt.render_text(CALCULATOR) == QWEN_EXPECTED
    assert fmt.render_messages(CALCULATOR) == encode(qwen_tok, QWEN_EXPECTED)
    assert fmt.decode(fmt.render_messages(CALCULATOR)) == QWEN_EXPECTED


def test_qwen_groups_consecutive_tool_results_in_one_user_turn(qwen_tok):
    fmt = QwenFormat(qwen_tok)
    ids = fmt.render_env_turns([Message.tool("5"), Message.tool("8")], close_turn=False)
    assert fmt.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n8\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    apart = QwenFormat(qwen_tok, config=ChatFormat.Config(group_tool_results=False))
    text = apart.decode(
        apart.render_env_turns([Message.tool("5"), Message.tool("8")], close_turn=True)
    )
    assert text.count("<|im_start|>user\n<tool_response>") == 2


def test_llama3_renders_headers_json_calls_and_ipython_turns_exactly(llama_tok):
    fmt = Llama3Format(llama_tok, tool_schemas=[TINY_SCHEMA])
    assert fmt.render_text(CALCULATOR) == LLAMA3_EXPECTED
    assert fmt.render_messages(CALCULATOR) == encode(llama_tok, LLAMA3_EXPECTED)
    env = fmt.render_env_turns([Message.tool("5"), Message.tool("8")], close_turn=True)
    assert fmt.decode(env) == (
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n8<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("family", ["chatml", "qwen", "llama3"])
def test_documented_examples_are_exact(family, smol, qwen_tok, llama_tok):
    tokenizer = {"chatml": smol, "qwen": qwen_tok, "llama3": llama_tok}[family]
    config = ChatFormat.Config(format=ChatFormatName(family))
    fmt = ChatFormat(tokenizer, tool_schemas=[TINY_SCHEMA], config=config)
    assert fmt.render_text(CALCULATOR) == documented_example(family) + (
        "\n" if family != "llama3" else ""
    )


def test_stop_tokens_per_family(smol, qwen_tok, llama_tok):
    assert ChatMLFormat(smol).stop_token_ids == (2,)  # <|im_end|> is SmolLM2's EOS
    assert QwenFormat(qwen_tok).stop_token_ids == (2,)
    fmt = Llama3Format(llama_tok)
    eot, eom = (llama_tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>"))
    assert fmt.end_of_turn_id == eot
    assert fmt.stop_token_ids == (eot, eom)


# ------------------------------------------------------------------------------ parsing
def test_qwen_parses_hermes_calls(qwen_tok):
    fmt = QwenFormat(qwen_tok)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    text = "<think>\nadd them\n</think>\n\n" + call
    parsed = fmt.parse_assistant(encode(qwen_tok, text) + [fmt.end_of_turn_id])
    assert parsed.tool_calls == (ToolCall("add", {"a": 1}),)
    assert parsed.content == "<think>\nadd them\n</think>"


def test_llama3_parses_json_calls_into_tool_calls(llama_tok):
    fmt = Llama3Format(llama_tok)
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    ids = encode(llama_tok, one) + [fmt.end_of_turn_id]
    assert fmt.parse_assistant(ids).tool_calls == (ToolCall("add", {"a": 1, "b": 2}),)
    two = fmt.parse_assistant(one + '; {"name": "run", "arguments": {"code": "1"}}<|eom_id|>')
    assert two.tool_calls == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("run", {"code": "1"}))
    answer = fmt.parse_assistant("The answer is {5}.")
    assert (answer.has_tool_calls, answer.content) == (False, "The answer is {5}.")
    message = fmt.message_from_text(one)
    assert message.role == Role.ASSISTANT and message.tool_calls == (
        ToolCall("add", {"a": 1, "b": 2}),
    )


def test_llama3_reads_a_call_after_the_python_tag_as_a_call(llama_tok):
    """Llama 3.1 may open a call with <|python_tag|> (vLLM's llama3_json parser accepts it);
    read as prose, the episode would end silently on a final answer."""
    fmt = Llama3Format(llama_tok)
    call = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    ids = fmt.encode_assistant_text(call + "<|eom_id|>")
    assert ids[0] == llama_tok.convert_tokens_to_ids("<|python_tag|>")
    parsed = fmt.parse_assistant(ids)
    assert (parsed.tool_calls, parsed.content) == ((ToolCall("add", {"a": 1, "b": 2}),), "")


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('{"name": "add", "parameters": {"a": 1,}}', ParseErrorKind.INVALID_JSON),
        ('[{"name": "add"}]', ParseErrorKind.NOT_AN_OBJECT),
        ('{"parameters": {"a": 1}}', ParseErrorKind.MISSING_NAME),
        ('{"name": "add", "parameters": [1, 2]}', ParseErrorKind.INVALID_ARGUMENTS),
        ('{"name": "add", "parameters": {"a": "1', ParseErrorKind.UNCLOSED_TAG),
    ],
)
def test_llama3_parse_errors_have_the_hermes_kinds(llama_tok, text, kind):
    parsed = Llama3Format(llama_tok).parse_assistant(text)
    (error,) = parsed.errors
    assert error.kind is kind
    assert '{"name": "<tool name>", "parameters"' in error.message  # the exact format
    assert parsed.items == (error,)


def test_a_llama3_conversation_gives_the_env_its_json_calls(llama_tok):
    fmt = Llama3Format(llama_tok)
    conv = fmt.conversation([Message.user("2+3?")])
    call = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    ids = encode(llama_tok, call) + [fmt.end_of_turn_id]
    conv.append_sampled(ids, [0.0] * len(ids))
    action = conv.messages[-1]  # what env.step gets
    assert action.blocks == (ToolCall("add", {"a": 2, "b": 3}),)
    broken = fmt.conversation([Message.user("2+3?")])
    ids = encode(llama_tok, '{"name": "add", "parameters": 5}')
    broken.append_sampled(ids, [0.0] * len(ids))
    (block,) = broken.messages[-1].blocks
    assert block.error is not None and "parameters" in block.content


def test_llama3_hand_built_call_with_prose_is_refused(llama_tok):
    fmt = Llama3Format(llama_tok)
    with pytest.raises(ChatFormatError, match="JSON only"):
        fmt.assistant_text(Message.assistant("Let me add.", [ToolCall("add", {})]))


# ------------------------------------------------------------------- incremental == full
@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_incremental_equals_full_render(family, qwen_tok, llama_tok):
    tokenizer = qwen_tok if family == "qwen" else llama_tok
    fmt = ChatFormat(tokenizer, tool_schemas=[TINY_SCHEMA])
    assert fmt.name is ChatFormatName(family)
    diff = compare_incremental_with_full(list(PROBE_MESSAGES), chat_format=fmt)
    assert diff.equal, diff.describe()
    diff = compare_incremental_with_full(CALCULATOR, chat_format=fmt)
    assert diff.equal, diff.describe()


def test_qwen_thinking_is_kept_verbatim_and_trained_on(qwen_tok):
    fmt = QwenFormat(qwen_tok)
    conv = fmt.conversation([Message.user("2+3?")])
    thought = '<think>\nI will call add.\n</think>\n\n<tool_call>\n{"name": "add"}\n</tool_call>'
    first = encode(qwen_tok, thought) + [fmt.end_of_turn_id]
    conv.append_sampled(first, [-0.5] * len(first))
    conv.append_messages([Message.tool("5")])
    second = encode(qwen_tok, "<think>\nDone.\n</think>\n\n5") + [fmt.end_of_turn_id]
    conv.append_sampled(second, [-0.5] * len(second))
    traj = conv.to_trajectory()
    # both turns' reasoning tokens stay in the list, with loss mask 1
    model = [t for t, m in zip(traj.completion_ids, traj.loss_mask, strict=True) if m]
    assert model == first + second
    assert conv.messages[1].content.startswith("<think>\nI will call add.")
    assert compare_incremental_with_full(conv).equal


# --------------------------------------------------------------------- choosing a family
def test_auto_detects_each_family_and_logs_it(smol, qwen_tok, llama_tok, caplog):
    with caplog.at_level(logging.INFO, logger="tir_rl.chat.family"):
        assert type(ChatFormat(smol)) is ChatMLFormat
        assert type(ChatFormat(qwen_tok)) is QwenFormat
        assert type(ChatFormat(llama_tok)) is Llama3Format
    assert "using the 'llama3' chat format" in caplog.text
    assert (
        detect_format(qwen_tokenizer(template="{{ messages }}")) is ChatFormatName.QWEN
    )  # <tool_call>


class FakeTemplateOnlyTokenizer:
    """No ChatML or Llama 3 tokens; only a chat template."""

    eos_token_id = 0
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def convert_tokens_to_ids(self, token):
        return None

    def __call__(self, text, **kwargs):
        return {"input_ids": [5, 6]}


def test_auto_falls_back_to_the_template():
    assert detect_format(FakeTemplateOnlyTokenizer()) is ChatFormatName.TEMPLATE


@pytest.mark.parametrize(
    ("family", "missing"),
    [("llama3", "<|begin_of_text|>"), ("chatml", "<|im_start|>"), ("qwen", "<|im_start|>")],
)
def test_an_explicit_family_the_tokenizer_lacks_is_refused_not_replaced(smol, family, missing):
    tokenizer = smol if family == "llama3" else FakeTemplateOnlyTokenizer()
    config = ChatFormat.Config(format=ChatFormatName(family))
    with pytest.raises(ChatFormatError, match=re.escape(missing)):
        ChatFormat(tokenizer, config=config)


def test_settings_a_family_cannot_honour_are_refused(smol, llama_tok):
    with pytest.raises(ChatFormatError, match="is not one of"):
        ChatFormat(smol, config=ChatFormat.Config(format="chatlm"))  # type: ignore[arg-type]  (a typo on purpose)
    with pytest.raises(ChatFormatError, match="own ipython turn"):
        ChatFormat(llama_tok, config=ChatFormat.Config(group_tool_results=True))
    template = ChatFormat.Config(format=ChatFormatName.TEMPLATE, tool_instructions="{tools}")
    with pytest.raises(ChatFormatError, match="writes its own tool block"):
        ChatFormat(smol, config=template)
    with pytest.raises(ChatFormatError, match="is the 'chatml' family"):
        ChatMLFormat(smol, config=ChatFormat.Config(format=ChatFormatName.QWEN))


# ------------------------------------------------------------------- the generic family
def test_template_family_renders_as_the_template_and_stays_tito(qwen_tok):
    config = ChatFormat.Config(format=ChatFormatName.TEMPLATE)
    fmt = ChatFormat(qwen_tok, tool_schemas=[TINY_SCHEMA], config=config)
    assert type(fmt) is TemplateFormat
    assert fmt.end_of_turn_id == qwen_tok.convert_tokens_to_ids("<|im_end|>")
    messages = [Message(m.role, fmt.assistant_text(m)) for m in PROBE_MESSAGES]
    template_ids = qwen_tok.apply_chat_template(
        [{"role": m.role.value, "content": m.content} for m in messages],
        tools=[TINY_SCHEMA],
        tokenize=False,
    )
    assert fmt.render_messages(messages) == encode(qwen_tok, template_ids)
    # the same tokens as the named family for the same texts
    assert fmt.render_messages(messages) == QwenFormat(
        qwen_tok, tool_schemas=[TINY_SCHEMA]
    ).render_messages(messages)
    assert compare_incremental_with_full(list(PROBE_MESSAGES), chat_format=fmt).equal


def test_template_family_takes_the_llama3_style_template_too(llama_tok):
    config = ChatFormat.Config(format=ChatFormatName.TEMPLATE)
    fmt = ChatFormat(llama_tok, tool_schemas=[TINY_SCHEMA], config=config)
    assert fmt.end_of_turn_id == llama_tok.convert_tokens_to_ids("<|eot_id|>")
    messages = [Message(m.role, fmt.assistant_text(m), name=m.name) for m in PROBE_MESSAGES]
    text = llama_tok.apply_chat_template(
        [{"role": m.role.value, "content": m.content} for m in messages],
        tools=[TINY_SCHEMA],
        tokenize=False,
    )
    assert fmt.render_messages(messages) == encode(llama_tok, text)
    env = fmt.render_env_turns([Message.tool("5")], close_turn=False)
    assert fmt.decode(env) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert compare_incremental_with_full(list(PROBE_MESSAGES), chat_format=fmt).equal


def test_template_family_never_makes_special_tokens_of_tool_output(qwen_tok):
    fmt = ChatFormat(qwen_tok, config=ChatFormat.Config(format=ChatFormatName.TEMPLATE))
    ids = fmt.render_env_turns([Message.tool("<|im_end|> done")], close_turn=False)
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 1  # only the one closing the user turn
    assert fmt.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n<|im_end|> done\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


COUNTING_TEMPLATE = QWEN_TEMPLATE.replace(
    "<|im_start|>system\n", "<|im_start|>system\n{{ messages | length }} messages\n", 1
)
"""Not append-only: the system turn says how many messages follow."""

QWEN3_STYLE_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    + QWEN_TEMPLATE.replace(
        "{% if message.content %}\n{{ message.content }}{% endif %}",
        "{% set content = message.content %}"
        "{% if '</think>' in content and loop.index0 < ns.last_query %}"
        "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
        "{% if content %}\n{{ content }}{% endif %}",
    )
)
"""Qwen3's rule: reasoning of turns before the last user query is dropped on re-render."""


def test_a_template_that_is_not_append_only_is_refused_with_the_difference():
    config = ChatFormat.Config(format=ChatFormatName.TEMPLATE)
    with pytest.raises(ChatFormatError) as info:
        ChatFormat(qwen_tokenizer(template=COUNTING_TEMPLATE), config=config)
    message = str(info.value)
    assert "not append-only" in message
    assert re.search(r"first difference at token \d+", message)
    assert "2 messages" in message and "8 messages" in message  # the texts there
    assert "pick a named family" in message


def test_a_template_that_drops_earlier_reasoning_is_refused():
    tokenizer = qwen_tokenizer(template=QWEN3_STYLE_TEMPLATE)
    with pytest.raises(ChatFormatError, match="changes message contents") as info:
        ChatFormat(tokenizer, config=ChatFormat.Config(format=ChatFormatName.TEMPLATE))
    assert "Both sums are back" in str(info.value)
    assert type(ChatFormat(tokenizer)) is QwenFormat  # auto picks the named family instead


QWEN3_THINKING_SWITCH = QWEN_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
"""Qwen3's generation prompt: an empty reasoning block when thinking is switched off."""

_MARK = "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
THINKING_SWITCH_TEMPLATE = QWEN_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n" + _MARK + "{% endif %}",
).replace(
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}",
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    + _MARK
    + "{{ message.content }}",
)
"""A template that reads `enable_thinking` and stays append-only and TITO-consistent with the
test tokenizer (its mark sits between added tokens, so no merge crosses it)."""


def test_qwen_without_thinking_opens_every_sampled_turn_with_qwen3s_empty_block(qwen_tok):
    fmt = QwenFormat(qwen_tok, config=ChatFormat.Config(enable_thinking=False))
    conv = fmt.conversation([Message.user("2+3?")])
    assert fmt.decode(conv.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = fmt.encode_assistant_text(call) + [fmt.end_of_turn_id]
    conv.append_sampled(ids, [0.0] * len(ids))
    conv.append_messages([Message.tool("5", name="add")])
    assert fmt.decode(conv.token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the same text as Qwen3's template renders with enable_thinking=False
    qwen3 = qwen_tokenizer(QWEN3_THINKING_SWITCH)
    messages = [Message.user("2+3?")]
    expected = qwen3.apply_chat_template(
        template_messages(messages), tokenize=False, add_generation_prompt=True,
        enable_thinking=False,
    )  # fmt: skip
    assert fmt.decode(QwenFormat(qwen3, config=fmt.config).render_prompt(messages)) == expected
    thinking = QwenFormat(qwen_tok, config=ChatFormat.Config(enable_thinking=True))
    assert fmt.decode(thinking.render_prompt(messages)).endswith("<|im_start|>assistant\n")


def test_a_template_that_reads_enable_thinking_gets_it_and_others_refuse_it(smol, llama_tok):
    switch = qwen_tokenizer(THINKING_SWITCH_TEMPLATE)
    off = ChatFormat.Config(format=ChatFormatName.TEMPLATE, enable_thinking=False)
    rendered = TemplateFormat(switch, config=off).render_prompt([Message.user("2+3?")])
    assert switch.decode(rendered).endswith("<|im_start|>assistant\n<think></think>")
    for tokenizer, family in (
        (smol, "chatml"),
        (llama_tok, "llama3"),
        (qwen_tokenizer(), "template"),
    ):
        config = ChatFormat.Config(format=ChatFormatName(family), enable_thinking=False)
        with pytest.raises(ChatFormatError, match="has no thinking switch"):
            ChatFormat(tokenizer, config=config)


@pytest.mark.parametrize("rewrite", ["trim", "e", "tojson"])
def test_a_template_that_trims_escapes_or_quotes_tool_output_is_refused(rewrite):
    """The probe's tool output has spaces, a newline, `<`, `&` and quotes to lose."""
    raw = "<tool_response>\n{{ message.content }}\n</tool_response>"
    assert raw in QWEN_TEMPLATE
    rewriting = QWEN_TEMPLATE.replace(
        raw, f"<tool_response>\n{{{{ message.content | {rewrite} }}}}\n</tool_response>"
    )
    config = ChatFormat.Config(format=ChatFormatName.TEMPLATE)
    with pytest.raises(ChatFormatError, match="changes message contents"):
        ChatFormat(qwen_tokenizer(rewriting), config=config)


# ------------------------------------------------------------- llama3: Meta's layouts
META_PREAMBLE = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
)
META_TOOL = '{\n    "type": "function",\n    "function": {\n        "name": "add"\n    }\n}\n\n'
META_FORMAT = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}.Do not use variables.\n\n"
)
META_REST = (
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is 5.<|eot_id|>"
)


def meta(llama_tok, layout, **config):
    return ChatFormat(
        llama_tok,
        tool_schemas=[TINY_SCHEMA],
        config=ChatFormat.Config(format="llama3", llama3_layout=layout, **config),
    )


def test_llama3_meta_user_layout_puts_the_preamble_and_the_tools_where_meta_does(llama_tok):
    text = meta(llama_tok, "meta_user").render_text(CALCULATOR)
    assert text == (
        META_PREAMBLE + "You are a calculator.<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nGiven the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\n"
        + META_FORMAT
        + META_TOOL
        + "What is 2+3?<|eot_id|>"
        + META_REST
    )


def test_llama3_meta_system_layout_puts_the_tools_in_the_system_turn(llama_tok):
    text = meta(llama_tok, "meta_system", llama3_date="01 Jan 2025").render_text(CALCULATOR)
    assert text == (
        META_PREAMBLE.replace("26 Jul 2024", "01 Jan 2025")
        + "You have access to the following functions. To call a function, please respond with "
        "JSON for a function call." + META_FORMAT + META_TOOL + "You are a calculator.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>" + META_REST
    )


@pytest.mark.parametrize("layout", ["meta_user", "meta_system"])
def test_llama3_meta_layouts_stay_append_only(llama_tok, layout):
    fmt = meta(llama_tok, layout)
    for conversation in (CALCULATOR, CALCULATOR[1:], list(PROBE_MESSAGES)):
        diff = compare_incremental_with_full(conversation, chat_format=fmt)
        assert diff.equal, diff.describe()
    no_tools = ChatFormat(llama_tok, config=ChatFormat.Config(llama3_layout="meta_user"))
    assert no_tools.render_text([Message.user("Hi.")]).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
    )


def test_llama3_layout_refusals(smol, llama_tok):
    with pytest.raises(ChatFormatError, match="first message after the system turn is 'assistant'"):
        meta(llama_tok, "meta_user").render_text([Message.system("s"), Message.assistant("Hello.")])
    with pytest.raises(ChatFormatError, match="applies to chat.format=llama3"):
        ChatFormat(smol, config=ChatFormat.Config(llama3_layout="meta_user"))
