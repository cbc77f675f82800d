"""ToolRegistry: calls, every model mistake as the model sees it, timeouts, sandbox routing."""

import asyncio
import enum
import json
import threading
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import pytest

from tir_rl.errors import ConfigError, SandboxError, ToolDefinitionError
from tir_rl.sandbox.base import ExecResult
from tir_rl.tools import ToolRegistry, ToolSpec, tool
from tir_rl.tools.shipping import FUTURE_LINE
from tir_rl.types import ToolErrorKind


class Unit(enum.Enum):
    CM = "cm"
    INCH = "inch"


@dataclass
class Point:
    x: float
    y: float


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


@tool
def scale(p: Point, factor: float = 2.0, unit: Unit = Unit.CM) -> dict:
    """Scale a point.

    Args:
        p: the point
        factor: multiplier
        unit: length unit
    """
    assert isinstance(p, Point) and isinstance(factor, float) and isinstance(unit, Unit)
    return {"x": p.x * factor, "y": p.y * factor, "unit": unit}


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: numerator
        b: denominator
    """
    return a / b


@tool
async def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: what to echo
    """
    await asyncio.sleep(0)
    return text


@tool
def blob(size: int) -> str:
    """Make a long string.

    Args:
        size: its length
    """
    return "".join(chr(ord("a") + i % 26) for i in range(size))


class Opaque:
    def __repr__(self) -> str:
        return "<opaque thing>"


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@tool
def opaque(printable: bool = True) -> object:
    """Return something without a JSON form.

    Args:
        printable: whether its repr works
    """
    return Opaque() if printable else Unprintable()


def make_registry(**config: Any) -> ToolRegistry:
    return ToolRegistry(
        [add, scale, divide, echo, blob, opaque], config=ToolRegistry.Config(**config)
    )


# ---------------------------------------------------------------------------------- success


def test_call_returns_value_and_json_text():
    reg = make_registry()
    result = reg.call("add", {"a": 1, "b": 2})
    assert result.ok and result.content == "3" and result.value == 3
    assert result.name == "add" and result.error is None


def test_arguments_may_be_a_raw_json_string():
    assert make_registry().call("add", '{"a": 1, "b": 2}').value == 3


def test_arguments_are_converted_to_dataclasses_enums_and_floats():
    result = make_registry().call("scale", {"p": {"x": 1, "y": 2.5}, "factor": 3, "unit": "inch"})
    assert result.ok, result.content
    assert result.value == {"x": 3.0, "y": 7.5, "unit": Unit.INCH}
    assert json.loads(result.content) == {"x": 3.0, "y": 7.5, "unit": "inch"}


def test_integral_float_is_accepted_for_int():
    assert make_registry().call("add", {"a": 2.0, "b": 1}).value == 3


def test_str_result_is_returned_as_is_and_other_values_as_repr():
    reg = make_registry()
    assert reg.call("echo", {"text": "héllo"}).content == "héllo"
    assert reg.call("opaque", None).content == "<opaque thing>"
    assert reg.call("opaque", {"printable": False}).content == "<Unprintable object>"


def test_json_schemas_list_every_tool_in_order():
    reg = make_registry()
    assert [s["function"]["name"] for s in reg.json_schemas] == reg.names
    assert reg.names == ["add", "scale", "divide", "echo", "blob", "opaque"]
    assert reg.json_schemas[0] == add.spec.json_schema
    assert "add" in reg and len(reg) == 6 and reg["add"] is add.spec


def test_plain_functions_and_specs_are_accepted():
    def mul(a: int, b: int) -> int:
        """Multiply.

        Args:
            a: left
            b: right
        """
        return a * b

    reg = ToolRegistry([mul, add.spec])
    assert reg.call("mul", {"a": 3, "b": 4}).value == 12
    assert reg.call("add", {"a": 3, "b": 4}).value == 7


def test_duplicate_names_are_refused():
    with pytest.raises(ToolDefinitionError, match="two tools are named 'add'"):
        ToolRegistry([add, add])


def test_too_small_result_cap_is_refused():
    with pytest.raises(ConfigError, match="max_result_chars"):
        ToolRegistry([add], config=ToolRegistry.Config(max_result_chars=10))


# --------------------------------------------------------------------------- model mistakes


def test_unknown_tool_lists_tools_and_closest_name():
    result = make_registry().call("ad", {"a": 1})
    assert result.error is ToolErrorKind.UNKNOWN_TOOL
    assert result.content == (
        "Error: there is no tool named 'ad'. Did you mean 'add'? "
        "Available tools: add, scale, divide, echo, blob, opaque."
    )


def test_unknown_tool_without_close_name_or_tools():
    assert "Did you mean" not in make_registry().call("weather", {}).content
    empty = ToolRegistry().call("weather", {})
    assert "no tools are available" in empty.content


def test_missing_argument_names_it_with_type_and_description():
    result = make_registry().call("add", {"a": 1})
    assert result.error is ToolErrorKind.INVALID_ARGUMENTS
    assert result.content == (
        "Error: invalid arguments for tool 'add':\n"
        "- missing required argument 'b' (integer): second addend\n"
        "Fix these and call 'add' again."
    )


def test_extra_argument_lists_valid_ones_and_suggests_a_fix():
    result = make_registry().call("add", {"a": 1, "bb": 2})
    assert result.error is ToolErrorKind.INVALID_ARGUMENTS
    assert "- unexpected argument 'bb'; valid arguments are: a, b (did you mean 'b'?)" in (
        result.content
    )
    assert "- missing required argument 'b'" in result.content


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (
            {"a": "3", "b": 1},
            "'a': expected integer, got string \"3\" (write the number without quotes: 3)",
        ),
        ({"a": True, "b": 1}, "'a': expected integer, got boolean true"),
        ({"a": 1.5, "b": 1}, "'a': expected integer, got number 1.5"),
        ({"a": None, "b": 1}, "'a': expected integer, got null"),
        ({"a": [1], "b": 1}, "'a': expected integer, got array of length 1"),
    ],
)
def test_wrong_type_names_parameter_expected_type_and_given_value(arguments, line):
    result = make_registry().call("add", arguments)
    assert result.error is ToolErrorKind.INVALID_ARGUMENTS
    assert f"- {line}\n" in result.content


def test_nested_problems_are_all_listed_with_paths():
    result = make_registry().call("scale", {"p": {"x": "1", "z": 0}, "unit": "mm"})
    assert result.error is ToolErrorKind.INVALID_ARGUMENTS
    lines = result.content.splitlines()[1:-1]
    assert lines == [
        "- 'p': unexpected key 'z'; valid keys are: x, y",
        "- 'p.x': expected number, got string \"1\" (write the number without quotes: 1)",
        "- 'p': missing required key 'y' (number)",
        '- \'unit\': expected one of "cm", "inch", got string "mm"',
    ]


def test_json_inside_a_string_gets_a_hint():
    result = make_registry().call("scale", {"p": '{"x": 1, "y": 2}'})
    assert "not a string containing it" in result.content


def test_malformed_json_string_shows_the_expected_shape():
    result = make_registry().call("add", '{"a": 1, "b": ')
    assert result.error is ToolErrorKind.MALFORMED_CALL
    assert result.content.startswith("Error: the arguments of tool 'add' are not valid JSON (")
    assert result.content.endswith(
        'Send the arguments as one JSON object, for example {"a": <integer>, "b": <integer>}.'
    )


def test_arguments_that_are_not_an_object():
    result = make_registry().call("add", "[1, 2]")
    assert result.error is ToolErrorKind.INVALID_ARGUMENTS
    assert result.content == (
        "Error: the arguments of tool 'add' must be a JSON object, got array of length 2. "
        'Send them as {"a": <integer>, "b": <integer>}.'
    )


def test_tool_exception_gives_type_and_message_only():
    result = make_registry().call("divide", {"a": 1, "b": 0})
    assert result.error is ToolErrorKind.TOOL_RAISED
    assert result.content == "Error: tool 'divide' raised ZeroDivisionError: float division by zero"
    assert "Traceback" not in result.content


def test_tool_calling_exit_does_not_end_the_trainer():
    @tool
    def quit_now() -> None:
        """Exit."""
        raise SystemExit(3)

    result = ToolRegistry([quit_now]).call("quit_now", {})
    assert result.error is ToolErrorKind.TOOL_RAISED and "SystemExit: 3" in result.content


# ------------------------------------------------------------------------ async and timeouts


def test_acall_awaits_async_tools_and_threads_sync_ones():
    caller = threading.get_ident()

    @tool
    def where() -> bool:
        """Tell whether this runs in the caller's thread."""
        return threading.get_ident() == caller

    reg = ToolRegistry([where, echo])

    async def main():
        return await asyncio.gather(reg.acall("where", {}), reg.acall("echo", {"text": "hi"}))

    in_caller, echoed = asyncio.run(main())
    assert in_caller.value is False
    assert echoed.content == "hi"
    assert reg.call("where", {}).value is True  # call runs sync tools in the calling thread


def test_call_runs_async_tools_outside_a_loop():
    assert make_registry().call("echo", {"text": "x"}).content == "x"


def test_call_refuses_async_tools_inside_a_running_loop():
    reg = make_registry()

    async def main():
        return reg.call("echo", {"text": "x"})

    with pytest.raises(RuntimeError, match="acall"):
        asyncio.run(main())


def test_async_tool_timeout_cancels_it():
    cancelled = []

    @tool(timeout_s=0.01)
    async def hang() -> None:
        """Never finish."""
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    reg = ToolRegistry([hang])
    result = asyncio.run(reg.acall("hang", {}))
    assert result.error is ToolErrorKind.TIMEOUT
    assert result.content == (
        "Error: tool 'hang' did not finish within 0.01 s; its result was discarded. "
        "Try a smaller input or a cheaper approach."
    )
    assert cancelled == [True]
    assert reg.stats.errors_by_kind[ToolErrorKind.TIMEOUT] == 1


def test_sync_tool_timeout_returns_while_the_thread_runs_on():
    release = threading.Event()

    @tool(timeout_s=0.01)
    def stuck() -> str:
        """Wait for release."""
        release.wait(30)
        return "done"

    result = asyncio.run(ToolRegistry([stuck]).acall("stuck", {}))
    release.set()
    assert result.error is ToolErrorKind.TIMEOUT


def test_a_tool_raising_timeout_error_is_not_a_timeout():
    @tool
    async def fails() -> None:
        """Raise a timeout of its own."""
        raise TimeoutError("upstream slow")

    result = asyncio.run(ToolRegistry([fails]).acall("fails", {}))
    assert result.error is ToolErrorKind.TOOL_RAISED
    assert result.content == "Error: tool 'fails' raised TimeoutError: upstream slow"


# ------------------------------------------------------------------------ truncation, stats


def test_long_results_are_cut_with_a_visible_marker():
    reg = make_registry(max_result_chars=200)
    result = reg.call("blob", {"size": 1000})
    full = blob(1000)
    assert len(result.content) <= 200
    head, marker, tail = result.content.split("\n")
    assert marker.startswith("[... ") and marker.endswith(" characters truncated ...]")
    omitted = int(marker.split()[1])
    assert full.startswith(head) and full.endswith(tail)
    assert len(head) + omitted + len(tail) == 1000
    assert result.value == full  # the value itself is untouched
    assert reg.call("blob", {"size": 200}).content == blob(200)


def test_stats_count_calls_and_failures_by_kind_and_tool():
    reg = make_registry()
    reg.call("add", {"a": 1, "b": 2})
    reg.call("add", {"a": "1", "b": 2})
    reg.call("divide", {"a": 1, "b": 0})
    reg.call("nope", {})
    reg.call("nope2", {})
    reg.call("add", "{")
    stats = reg.stats
    assert stats.num_calls == 6 and stats.num_errors == 5
    assert stats.errors_by_kind == {
        ToolErrorKind.MALFORMED_CALL: 1,
        ToolErrorKind.UNKNOWN_TOOL: 2,
        ToolErrorKind.INVALID_ARGUMENTS: 1,
        ToolErrorKind.TOOL_RAISED: 1,
        ToolErrorKind.TIMEOUT: 0,
        ToolErrorKind.SANDBOX: 0,
    }
    assert stats.calls_by_tool == {"add": 3, "divide": 1, "<unknown>": 2}
    assert stats.errors_by_tool == {"add": 2, "divide": 1, "<unknown>": 2}
    metrics = stats.as_metrics()
    assert metrics["tools/calls"] == 6.0 and metrics["tools/error_rate"] == pytest.approx(5 / 6)
    assert metrics["tools/errors/unknown_tool"] == 2.0 and metrics["tools/calls/add"] == 3.0
    stats.reset()
    assert stats.num_calls == 0 and stats.calls_by_tool == {}
    assert set(stats.errors_by_kind.values()) == {0}


# ----------------------------------------------------------------------------------- sandbox


class FakeSandbox:
    """Runs shipped functions in a fresh namespace in this process (unit tests only)."""

    def __init__(self, *, timed_out: bool = False, broken: bool = False) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], float]] = []
        self.timed_out = timed_out
        self.broken = broken

    def run(self, code: str, *, timeout_s: float) -> ExecResult:
        raise NotImplementedError

    def call_function(
        self, source: str, function_name: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> ExecResult:
        self.calls.append((source, function_name, arguments, timeout_s))
        if self.broken:
            raise SandboxError("container died")
        if self.timed_out:
            return ExecResult(timed_out=True)
        namespace: dict[str, Any] = {}
        exec(compile(source, "<shipped>", "exec"), namespace)
        try:
            value = namespace[function_name](**json.loads(json.dumps(arguments)))
        except Exception as exc:
            return ExecResult(error=f"{type(exc).__name__}: {exc}")
        return ExecResult(value=json.loads(json.dumps(value)))

    def close(self) -> None:
        pass


class Summary(TypedDict):
    mean: float
    count: int


@tool(sandbox=True, timeout_s=5)
def run_stats(xs: list[float], mode: Literal["mean", "max"] = "mean") -> Summary:
    """Summarise numbers.

    Args:
        xs: the numbers
        mode: which statistic
    """
    import statistics

    value = statistics.fmean(xs) if mode == "mean" else max(xs)
    return {"mean": value, "count": len(xs)}


def test_sandbox_tool_source_is_shipped_without_the_decorator():
    source = run_stats.spec.source
    assert source.startswith(FUTURE_LINE + "def run_stats(xs: list[float]")
    assert "@tool" not in source and source.rstrip().endswith(
        'return {"mean": value, "count": len(xs)}'
    )


def test_sandbox_tool_runs_in_the_sandbox_with_validated_arguments():
    sandbox = FakeSandbox()
    reg = ToolRegistry([run_stats])
    result = reg.call("run_stats", {"xs": [1, 2, 6]}, sandbox=sandbox)
    assert result.ok, result.content
    assert result.value == {"mean": 3.0, "count": 3}
    assert json.loads(result.content) == {"mean": 3.0, "count": 3}
    ((source, function_name, arguments, timeout_s),) = sandbox.calls
    assert source == run_stats.spec.source and function_name == "run_stats"
    assert arguments == {"xs": [1.0, 2.0, 6.0]} and timeout_s == 5.0


def test_sandbox_tool_via_acall_and_invalid_arguments_never_reach_the_sandbox():
    sandbox = FakeSandbox()
    reg = ToolRegistry([run_stats])
    result = asyncio.run(reg.acall("run_stats", {"xs": [4], "mode": "max"}, sandbox=sandbox))
    assert result.value == {"mean": 4, "count": 1}
    bad = asyncio.run(reg.acall("run_stats", {"xs": ["4"]}, sandbox=sandbox))
    assert bad.error is ToolErrorKind.INVALID_ARGUMENTS and "'xs[0]'" in bad.content
    assert len(sandbox.calls) == 1


def test_sandbox_tool_without_a_sandbox():
    result = ToolRegistry([run_stats]).call("run_stats", {"xs": [1]})
    assert result.error is ToolErrorKind.SANDBOX
    assert "runs inside a sandbox" in result.content and "configure a sandbox" in result.content


@pytest.mark.parametrize(
    ("sandbox", "kind", "fragment"),
    [
        (FakeSandbox(timed_out=True), ToolErrorKind.TIMEOUT, "within 5 s in the sandbox"),
        (FakeSandbox(broken=True), ToolErrorKind.SANDBOX, "container died"),
    ],
)
def test_sandbox_failures_map_to_kinds(sandbox, kind, fragment):
    result = ToolRegistry([run_stats]).call("run_stats", {"xs": [1]}, sandbox=sandbox)
    assert result.error is kind and fragment in result.content


def test_error_inside_the_sandbox_is_a_tool_error():
    result = ToolRegistry([run_stats]).call("run_stats", {"xs": []}, sandbox=FakeSandbox())
    assert result.error is ToolErrorKind.TOOL_RAISED
    assert result.content.startswith("Error: tool 'run_stats' failed in the sandbox:\n")
    assert "StatisticsError" in result.content


def test_renamed_sandbox_tool_calls_its_def_name():
    @tool(name="double-it", sandbox=True)
    def double(x: int) -> int:
        """Double x.

        Args:
            x: number
        """
        return 2 * x

    sandbox = FakeSandbox()
    assert ToolRegistry([double]).call("double-it", {"x": 4}, sandbox=sandbox).value == 8
    assert sandbox.calls[0][1] == "double"
    assert isinstance(double.spec, ToolSpec)
