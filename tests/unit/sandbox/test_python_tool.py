import pytest

from tir_rl.sandbox.base import ExecResult
from tir_rl.sandbox.bwrap import BwrapBackend
from tir_rl.sandbox.pool import EpisodeSandbox
from tir_rl.tools import ToolRegistry
from tir_rl.tools.python import NO_OUTPUT, format_result, python, use_sandbox


def test_format_shows_output_then_value():
    assert format_result(ExecResult(stdout="hi\n", result="42")) == "hi\n42"


def test_format_shows_stderr_and_error_but_not_a_stale_value():
    text = format_result(ExecResult(stderr="warn\n", result="1", error="ValueError: bad\n"))
    assert text == "[stderr]\nwarn\nValueError: bad"


def test_format_says_when_there_is_nothing_to_show():
    assert format_result(ExecResult()) == NO_OUTPUT


def test_tool_schema_is_derived():
    schema = python.spec.json_schema["function"]
    assert schema["name"] == "python"
    assert schema["parameters"]["required"] == ["code"]


def test_tool_without_a_bound_sandbox_is_an_error_result():
    result = ToolRegistry([python]).call("python", {"code": "1"})
    assert result.error is not None and "use_sandbox" in result.content


@pytest.fixture()
def local_pool():
    pool = BwrapBackend(config=BwrapBackend.Config(pool_size=1), isolated=False).make_pool()
    yield pool
    pool.close()


def test_tool_runs_in_the_bound_sandbox_with_persistent_state(local_pool):
    registry = ToolRegistry([python])
    with EpisodeSandbox(local_pool) as sb, use_sandbox(sb):
        assert registry.call("python", {"code": "x = 6 * 7"}).content == NO_OUTPUT
        assert registry.call("python", {"code": "print('x is', x)\nx + 1"}).content == "x is 42\n43"
