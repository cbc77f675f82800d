"""Decoration-time checks that a sandbox tool's source can run alone in the sandbox."""

import enum
import functools
import math
from dataclasses import dataclass

import pytest

from tir_rl.errors import ToolDefinitionError
from tir_rl.tools import tool


class Mode(enum.Enum):
    A = "a"


@dataclass
class Pair:
    a: int
    b: int


def _make_closure():
    offset = 3

    def shifted(x: int) -> int:
        """Shift x.

        Args:
            x: number
        """
        return x + offset

    return shifted


def _uses_module_global(x: float) -> float:
    """Root of x.

    Args:
        x: number
    """
    return math.sqrt(x)


def _uses_global_in_comprehension(xs: list[float]) -> list[float]:
    """Roots.

    Args:
        xs: numbers
    """
    return [math.sqrt(x) for x in xs]


@functools.lru_cache  # noqa: B019 - the decorator under test
def _other_decorator(x: int) -> int:
    """Cached.

    Args:
        x: number
    """
    return x


async def _is_async(x: int) -> int:
    """Async.

    Args:
        x: number
    """
    return x


LIMIT = 10


def _non_literal_default(x: int = LIMIT) -> int:
    """Default from a constant.

    Args:
        x: number
    """
    return x


def _enum_param(mode: Mode) -> str:
    """Enum in.

    Args:
        mode: the mode
    """
    return "x"


def _dataclass_param(p: Pair) -> int:
    """Dataclass in.

    Args:
        p: the pair
    """
    return 0


def _no_return_annotation(x: int):
    """No return type.

    Args:
        x: number
    """
    return x


def _dataclass_return(x: int) -> Pair:
    """Dataclass out.

    Args:
        x: number
    """
    return None


def _bytes_return(x: int) -> bytes:
    """Bytes out.

    Args:
        x: number
    """
    return b""


@pytest.mark.parametrize(
    ("fn", "fragments"),
    [
        (_make_closure(), ["sandbox tool 'shifted'", "enclosing function (offset)"]),
        (_uses_module_global, ["global name(s) math", "import modules"]),
        (_uses_global_in_comprehension, ["global name(s) math"]),
        (_other_decorator, ["must be a plain `def` function"]),
        (_is_async, ["not `async def`"]),
        (_non_literal_default, ["parameter 'x'", "default `LIMIT`", "not a literal"]),
        (_enum_param, ["parameter 'mode'", "Enum Mode", "Literal"]),
        (_dataclass_param, ["parameter 'p'", "dataclass Pair", "TypedDict"]),
        (_no_return_annotation, ["needs a return annotation"]),
        (_dataclass_return, ["return type", "dataclass Pair"]),
        (_bytes_return, ["return type", "bytes has no JSON schema"]),
    ],
)
def test_unshippable_sandbox_tool_fails_at_decoration(fn, fragments):
    with pytest.raises(ToolDefinitionError) as info:
        tool(sandbox=True)(fn)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_decorator_other_than_tool_in_the_source_is_refused():
    def keep(f):
        return f

    with pytest.raises(ToolDefinitionError, match="has the decorator @keep; only @tool"):

        @tool(sandbox=True)
        @keep
        def f(x: int) -> int:
            """Do.

            Args:
                x: number
            """
            return x


def test_source_must_be_available():
    namespace: dict = {}
    exec(
        'def made(x: int) -> int:\n    """Made by exec.\n\n    Args:\n        x: n\n    """\n'
        "    return x\n",
        namespace,
    )
    with pytest.raises(ToolDefinitionError, match="source is not available"):
        tool(sandbox=True)(namespace["made"])


def test_nested_sandbox_tool_is_dedented_and_may_recurse_and_use_builtins():
    @tool(sandbox=True)
    def fact(n: int = 3) -> int:
        """Factorial.

        Args:
            n: number
        """
        return 1 if n <= 1 else n * fact(n - 1) + 0 * len(str(abs(n)))

    namespace: dict = {}
    exec(fact.spec.source, namespace)
    assert namespace["fact"](5) == 120
    assert fact.spec.source.splitlines()[1].startswith("def fact(")
