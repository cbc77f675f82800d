"""Schema derivation from type hints and docstrings, and every decoration-time failure."""

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, TypedDict

import pytest

from tir_rl.errors import ToolDefinitionError
from tir_rl.tools import ToolSpec, tool
from tir_rl.tools.docstring import parse_docstring


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclass
class Point:
    """A point in the plane."""

    x: float
    """horizontal coordinate"""
    y: float = 0.0
    """vertical coordinate"""


@dataclass
class Box:
    corners: list[Point]
    label: str = "box"
    tags: list[str] = field(default_factory=list)


class Options(TypedDict, total=False):
    verbose: bool
    depth: int


class Person(TypedDict):
    """Somebody."""

    name: str
    age: int | None


def schema_of(annotation: Any, **default: Any) -> dict[str, Any]:
    """The property schema of a one-parameter tool whose parameter has `annotation`."""

    def f(x):  # annotated below so that each test can pass any hint
        """Do it.

        Args:
            x: the value
        """

    f.__annotations__ = {"x": annotation}
    if default:
        f.__defaults__ = (default["default"],)
    spec = ToolSpec.from_function(f)
    prop = dict(spec.parameters["properties"]["x"])
    assert prop.pop("description") == "the value"
    return prop


def test_add_example_gives_the_whole_openai_schema():
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first addend
            b: second addend
        """
        return a + b

    assert add(1, 2) == 3
    assert add.spec.json_schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "first addend"},
                    "b": {"type": "integer", "description": "second addend"},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
    assert not add.spec.is_async and not add.spec.sandbox and add.spec.source is None


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (str, {"type": "string"}),
        (Any, {}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (Sequence[str], {"type": "array", "items": {"type": "string"}}),
        (list, {"type": "array"}),
        (
            list[list[float]],
            {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        ),
        (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
        (
            tuple[int, str],
            {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "minItems": 2,
                "maxItems": 2,
            },
        ),
        (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
        (dict, {"type": "object", "additionalProperties": True}),
        (Optional[int], {"anyOf": [{"type": "integer"}, {"type": "null"}]}),  # noqa: UP045 - the old spelling is what is tested
        (str | None, {"anyOf": [{"type": "string"}, {"type": "null"}]}),
        (int | str, {"anyOf": [{"type": "integer"}, {"type": "string"}]}),
        (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
        (Literal[1, "x"], {"enum": [1, "x"]}),
        (Color, {"type": "string", "enum": ["red", "green"]}),
        (Level, {"type": "integer", "enum": [1, 2]}),
        (
            Point,
            {
                "type": "object",
                "properties": {
                    "x": {"type": "number", "description": "horizontal coordinate"},
                    "y": {"type": "number", "description": "vertical coordinate", "default": 0.0},
                },
                "required": ["x"],
                "additionalProperties": False,
            },
        ),
        (
            Options,
            {
                "type": "object",
                "properties": {"verbose": {"type": "boolean"}, "depth": {"type": "integer"}},
                "required": [],
                "additionalProperties": False,
            },
        ),
        (
            Person,
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        ),
    ],
)
def test_schema_of_each_supported_type(annotation, expected):
    assert schema_of(annotation) == expected


def test_nested_dataclass_schema_with_defaults_and_factories():
    point = {"description": "A point in the plane.", **schema_of(Point)}
    assert schema_of(Box) == {
        "type": "object",
        "properties": {
            "corners": {"type": "array", "items": point},
            "label": {"type": "string", "default": "box"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["corners"],
        "additionalProperties": False,
    }


def test_class_summary_describes_an_object_unless_the_parameter_does():
    assert schema_of(list[Person])["items"]["description"] == "Somebody."
    assert "description" not in schema_of(list[Options])["items"]  # no docstring


def test_defaults_are_recorded_and_make_parameters_optional():
    @tool
    def search(query: str, limit: int = 5, color: Color = Color.RED, exact: bool | None = None):
        """Search the index.

        A longer explanation.

        Args:
            query: what to look for
            limit: how many hits
            color: hit color
            exact (bool): exact matching,
                spanning two lines

        Returns:
            The hits, best first.
        """

    params = search.spec.parameters
    assert params["required"] == ["query"]
    assert params["properties"]["limit"] == {
        "type": "integer",
        "description": "how many hits",
        "default": 5,
    }
    assert params["properties"]["color"]["default"] == "red"
    assert params["properties"]["exact"] == {
        "anyOf": [{"type": "boolean"}, {"type": "null"}],
        "description": "exact matching, spanning two lines",
        "default": None,
    }
    assert search.spec.description == (
        "Search the index.\n\nA longer explanation.\n\nReturns: The hits, best first."
    )


def test_none_default_on_a_plain_type_makes_it_optional():
    assert schema_of(int, default=None) == {
        "anyOf": [{"type": "integer"}, {"type": "null"}],
        "default": None,
    }


def test_tool_options_name_timeout_and_no_parameters():
    @tool(name="clock-now", timeout_s=2)
    def now() -> str:
        """Tell the time."""
        return "noon"

    assert now() == "noon"
    assert now.spec.name == "clock-now" and now.spec.timeout_s == 2.0
    assert now.spec.parameters == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": False,
    }


def test_async_function_is_marked_async_and_stays_awaitable():
    @tool
    async def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: the address
        """
        return url

    assert fetch.spec.is_async
    import asyncio

    assert asyncio.run(fetch("u")) == "u"


def test_bound_method_becomes_a_tool_without_self():
    class Counter:
        def bump(self, by: int) -> int:
            """Increase the counter.

            Args:
                by: the step
            """
            return by + 1

    bump = tool(Counter().bump)
    assert list(bump.spec.parameters["properties"]) == ["by"]
    assert bump(2) == 3


def test_json_schema_is_a_copy():
    @tool
    def f(a: int) -> None:
        """Do.

        Args:
            a: a
        """

    f.spec.json_schema["function"]["parameters"]["properties"].clear()
    assert f.spec.json_schema["function"]["parameters"]["properties"] != {}


def test_docstring_parsing_keeps_sections_apart():
    doc = parse_docstring(
        """Summary line
        continues here.

        Body text.

        Args:
            a (int): first
                more about a
            *rest: ignored name form

        Raises:
            ValueError: never

        Returns:
            A thing.
        """
    )
    assert doc.summary == "Summary line continues here."
    assert doc.body == "Body text."
    assert doc.args == {"a": "first more about a", "rest": "ignored name form"}
    assert doc.returns == "A thing."


# ----------------------------------------------------------------- decoration-time failures


def _untyped(a):
    """Do.

    Args:
        a: thing
    """


def _star_args(*nums: int):
    """Do.

    Args:
        nums: numbers
    """


def _star_kwargs(**options: int):
    """Do.

    Args:
        options: options
    """


def _undocumented(a: int, b: int):
    """Do.

    Args:
        a: thing
    """


def _no_summary(a: int):
    pass


def _unsupported(blob: bytes):
    """Do.

    Args:
        blob: bytes
    """


def _unsupported_nested(items: list[set[int]]):
    """Do.

    Args:
        items: sets
    """


def _int_keys(table: dict[int, str]):
    """Do.

    Args:
        table: table
    """


def _positional_only(a: int, /):
    """Do.

    Args:
        a: thing
    """


def _stale_doc(a: int):
    """Do.

    Args:
        a: thing
        b: gone
    """


@dataclass
class Node:
    child: "Node | None"


@dataclass
class HasBytes:
    raw: bytes


def _recursive(node: Node):
    """Do.

    Args:
        node: a tree
    """


def _bad_field(h: HasBytes):
    """Do.

    Args:
        h: thing
    """


@pytest.mark.parametrize(
    ("fn", "fragments"),
    [
        (_untyped, ["parameter 'a'", "no type annotation"]),
        (_star_args, ["*nums", "use a list parameter"]),
        (_star_kwargs, ["**options"]),
        (_undocumented, ["parameter 'b'", "not documented", "Args:"]),
        (_no_summary, ["'_no_summary'", "no docstring summary"]),
        (_unsupported, ["parameter 'blob'", "bytes has no JSON schema", "supported types"]),
        (_unsupported_nested, ["parameter 'items'", "set[int]"]),
        (_int_keys, ["parameter 'table'", "dict[str, ...]"]),
        (_positional_only, ["parameter 'a'", "positional-only"]),
        (_stale_doc, ["'b'", "not a parameter"]),
        (_recursive, ["parameter 'node'", "Node refers to itself"]),
        (_bad_field, ["parameter 'h'", "field 'raw' of HasBytes", "bytes"]),
    ],
)
def test_undescribable_function_fails_at_decoration(fn, fragments):
    with pytest.raises(ToolDefinitionError) as info:
        tool(fn)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_invalid_name_and_timeout_are_refused():
    def f() -> None:
        """Do."""

    with pytest.raises(ToolDefinitionError, match="tool name 'has space'"):
        tool(name="has space")(f)
    with pytest.raises(ToolDefinitionError, match="timeout_s must be > 0"):
        tool(timeout_s=0)(f)


def test_decorating_twice_keeps_both_specs():
    def f() -> None:
        """Do."""

    first = tool(name="one")(f)
    second = tool(name="two")(f)
    assert first.spec.name == "one" and second.spec.name == "two"
    assert first() is None and second() is None
    assert first is f and second is not f and second.__wrapped__ is f


def test_callable_object_with_async_call_is_an_async_tool():
    class Lookup:
        """Look a key up."""

        async def __call__(self, key: str) -> str:
            """Unused: the class docstring describes the tool.

            Args:
                key: what to look up
            """
            return key.upper()

    spec = ToolSpec.from_function(Lookup(), name="lookup")
    assert spec.is_async and spec.description == "Look a key up."
    assert list(spec.parameters["properties"]) == ["key"]
