"""Parsing of Hermes-style tool calls out of assistant text: every failure is a typed error."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tir_rl.chat.parse import (
    CALL_FORMAT_HINT,
    ParseErrorKind,
    ToolCallParseError,
    parse_assistant_text,
    tool_result_message,
)
from tir_rl.types import Role, ToolCall, ToolErrorKind, ToolResult


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_text_without_calls_is_all_content():
    parsed = parse_assistant_text("  The answer is 42.\n")
    assert parsed.content == "The answer is 42."
    assert parsed.tool_calls == () and parsed.errors == () and parsed.items == ()
    assert not parsed.has_tool_calls


def test_one_call_with_prose_around():
    text = "Let me add.\n" + block('{"name": "add", "arguments": {"a": 1, "b": 2}}') + "\nDone?"
    parsed = parse_assistant_text(text)
    assert parsed.tool_calls == (ToolCall("add", {"a": 1, "b": 2}),)
    assert parsed.errors == ()
    assert parsed.content == "Let me add.\n\nDone?"


def test_several_calls_keep_order_and_interleave_with_errors():
    text = (
        "First "
        + block('{"name": "a", "arguments": {}}')
        + " then "
        + block("{broken")
        + block('{"name": "b", "arguments": {"x": [1, {"y": null}]}}')
    )
    parsed = parse_assistant_text(text)
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert parsed.tool_calls[1].arguments == {"x": [1, {"y": None}]}
    assert [e.kind for e in parsed.errors] == [ParseErrorKind.INVALID_JSON]
    kinds = [type(i).__name__ for i in parsed.items]
    assert kinds == ["ToolCall", "ToolCallParseError", "ToolCall"]
    assert parsed.errors[0].index == 1
    assert parsed.content == "First  then"


def test_malformed_json_error_tells_the_model_what_and_how():
    parsed = parse_assistant_text(block('{"name": "add", "arguments": {"a": 1,}}'))
    (error,) = parsed.errors
    assert error.kind is ParseErrorKind.INVALID_JSON
    assert error.message.startswith("Tool call 1 could not be parsed: the body is not valid JSON")
    assert "Expecting property name enclosed in double quotes" in error.message
    assert """You wrote: '{"name": "add", "arguments": {"a": 1,}}'""" in error.message
    assert error.message.endswith(CALL_FORMAT_HINT)
    assert CALL_FORMAT_HINT == (
        "Write each call on its own as:\n<tool_call>\n"
        '{"name": "<tool name>", "arguments": {"<argument name>": <value>, ...}}\n</tool_call>'
    )
    assert parsed.tool_calls == ()


def test_empty_block_is_invalid_json():
    (error,) = parse_assistant_text("<tool_call></tool_call>").errors
    assert error.kind is ParseErrorKind.INVALID_JSON


@pytest.mark.parametrize(
    ("body", "got"),
    [("[1, 2]", "an array"), ('"add"', "a string"), ("3", "a number"), ("null", "null")],
)
def test_json_that_is_not_an_object(body, got):
    (error,) = parse_assistant_text(block(body)).errors
    assert error.kind is ParseErrorKind.NOT_AN_OBJECT
    assert f"expected a JSON object, got {got}" in error.message


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('{"arguments": {"a": 1}}', 'the object has no "name"'),
        ('{"name": 5, "arguments": {}}', 'the object has "name" of type a number'),
        ('{"name": "  ", "arguments": {}}', 'the object has "name" of type a string'),
    ],
)
def test_missing_or_bad_name(body, problem):
    (error,) = parse_assistant_text(block(body)).errors
    assert error.kind is ParseErrorKind.MISSING_NAME
    assert problem + '; "name" must be the tool name as a string.' in error.message
    assert error.name is None


@pytest.mark.parametrize("arguments", ["[1, 2]", "7", "true", '"[1]"'])
def test_arguments_not_an_object(arguments):
    (error,) = parse_assistant_text(block(f'{{"name": "add", "arguments": {arguments}}}')).errors
    assert error.kind is ParseErrorKind.INVALID_ARGUMENTS
    assert '"arguments" must be a JSON object mapping argument names to values' in error.message
    assert error.name == "add"


def test_arguments_as_a_json_string_are_decoded():
    body = json.dumps({"name": "add", "arguments": json.dumps({"a": 1, "b": "é"})})
    assert parse_assistant_text(block(body)).tool_calls == (ToolCall("add", {"a": 1, "b": "é"}),)


def test_arguments_as_a_string_that_is_not_json():
    (error,) = parse_assistant_text(block('{"name": "add", "arguments": "a=1"}')).errors
    assert error.kind is ParseErrorKind.INVALID_ARGUMENTS
    assert '"arguments" is a string that is not valid JSON' in error.message


def test_missing_arguments_mean_no_arguments():
    assert parse_assistant_text(block('{"name": "now"}')).tool_calls == (ToolCall("now", {}),)


def test_code_fence_inside_the_block_is_tolerated():
    text = block('```json\n{"name": "add", "arguments": {"a": 1}}\n```')
    assert parse_assistant_text(text).tool_calls == (ToolCall("add", {"a": 1}),)


def test_unclosed_tag_at_the_end_of_a_cut_off_turn():
    text = 'Computing.\n<tool_call>\n{"name": "add", "argu'
    parsed = parse_assistant_text(text)
    (error,) = parsed.errors
    assert error.kind is ParseErrorKind.UNCLOSED_TAG
    assert error.raw == '\n{"name": "add", "argu'
    assert "<tool_call> was never closed with </tool_call>" in error.message
    assert parsed.content == "Computing."


def test_unclosed_tag_followed_by_a_good_call():
    text = "<tool_call>{oops " + block('{"name": "add", "arguments": {}}')
    parsed = parse_assistant_text(text)
    assert [type(i).__name__ for i in parsed.items] == ["ToolCallParseError", "ToolCall"]
    assert parsed.errors[0].kind is ParseErrorKind.UNCLOSED_TAG
    assert parsed.errors[0].raw == "{oops "


def test_stray_closing_tag_stays_in_content():
    parsed = parse_assistant_text("no call </tool_call> here")
    assert parsed.items == () and parsed.content == "no call </tool_call> here"


def test_long_bodies_are_quoted_shortened():
    (error,) = parse_assistant_text(block("{" + "x" * 5000)).errors
    assert len(error.message) < 1000 and error.raw.strip() == "{" + "x" * 5000


def test_error_becomes_a_malformed_call_tool_result_and_message():
    (error,) = parse_assistant_text(block('{"name": "add", "arguments": [1]}')).errors
    result = error.to_tool_result()
    expected = ToolResult(name="add", content=error.message, error=ToolErrorKind.MALFORMED_CALL)
    assert result == expected
    assert not result.ok
    message = error.to_message()
    assert message.role is Role.TOOL and message.content == error.message and message.name == "add"
    unnamed = ToolCallParseError(ParseErrorKind.INVALID_JSON, "bad", "x", 0)
    assert unnamed.to_tool_result().name == "" and unnamed.to_message().name is None
    assert tool_result_message(ToolResult("add", "3")).content == "3"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    prose=st.lists(
        st.text(max_size=20).filter(lambda s: "<tool_call>" not in s), min_size=1, max_size=4
    ),
    args=st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3), max_size=3),
    garbage=st.text(max_size=30),
)
def test_random_turns_never_raise_and_find_every_good_call(prose, args, garbage):
    calls = [ToolCall(f"tool_{i}", a) for i, a in enumerate(args)]
    parts = [prose[0]]
    for i, call in enumerate(calls):
        parts.append(block(json.dumps({"name": call.name, "arguments": call.arguments})))
        parts.append(prose[(i + 1) % len(prose)])
    text = "".join(parts) + garbage
    parsed = parse_assistant_text(text)
    assert parsed.tool_calls[: len(calls)] == tuple(calls)
    for error in parsed.errors:
        assert isinstance(error.kind, ParseErrorKind) and error.message.endswith(CALL_FORMAT_HINT)
