"""Property tests: argument validation agrees with the derived JSON schema, and round-trips."""

import enum
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tir_rl.tools.nodes import INVALID
from tir_rl.tools.schema import build_node, json_form

jsonschema = pytest.importorskip("jsonschema")


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass
class Point:
    x: float
    y: float = 0.0


class Person(TypedDict):
    name: str
    age: int | None


TYPES = [
    int,
    float,
    bool,
    str,
    type(None),
    Any,
    list[int],
    tuple[int, str],
    tuple[float, ...],
    dict[str, float | None],
    Literal["x", 1],
    Color,
    Point,
    Person,
    list[Point] | None,
    int | str,
]

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4)
    | st.sampled_from(["x", "red", "green", "name"])
)
KEYS = st.sampled_from(["x", "y", "name", "age", "z"]) | st.text(max_size=3)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(KEYS, children, max_size=3),
    max_leaves=8,
)


@pytest.mark.parametrize("tp", TYPES, ids=repr)
@settings(max_examples=60, deadline=None)
@given(value=JSON_VALUES)
def test_validator_accepts_exactly_what_the_schema_accepts(tp, value):
    node = build_node(tp)
    validator = jsonschema.Draft202012Validator(node.schema())
    problems: list[str] = []
    converted = node.convert(value, "v", problems)
    assert (converted is not INVALID) == validator.is_valid(value), (value, problems)
    assert bool(problems) == (converted is INVALID)
    if converted is not INVALID:
        assert _contains(json_form(converted), value)  # lossless, plus defaults filled in


def _contains(full: Any, given: Any) -> bool:
    """Whether `full` equals `given` except for dict keys that only `full` has (defaults)."""
    if isinstance(given, dict):
        return isinstance(full, dict) and all(
            k in full and _contains(full[k], v) for k, v in given.items()
        )
    if isinstance(given, list):
        return (
            isinstance(full, list) and len(full) == len(given) and all(map(_contains, full, given))
        )
    return full == given


@st.composite
def python_values(draw, tp):
    """A valid Python value of type `tp` (what a tool could receive)."""
    strategies = {
        int: st.integers(),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: st.text(),
        bool: st.booleans(),
    }
    if tp in strategies:
        return draw(strategies[tp])
    if tp == list[Point]:
        return draw(st.lists(python_values(Point), max_size=3))
    if tp is Point:
        return Point(draw(python_values(float)), draw(python_values(float)))
    if tp is Color:
        return draw(st.sampled_from(list(Color)))
    if tp == dict[str, tuple[int, bool]]:
        pairs = st.tuples(python_values(int), python_values(bool))
        return draw(st.dictionaries(st.text(max_size=5), pairs, max_size=3))
    raise AssertionError(tp)


@pytest.mark.parametrize(
    "tp", [int, float, str, bool, list[Point], Color, dict[str, tuple[int, bool]]]
)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_python_values_round_trip_through_json(tp, data):
    value = data.draw(python_values(tp))
    problems: list[str] = []
    assert build_node(tp).convert(json_form(value), "v", problems) == value
    assert problems == []


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_strings_are_never_numbers_or_booleans(text):
    for tp in (int, float, bool):
        problems: list[str] = []
        assert build_node(tp).convert(text, "v", problems) is INVALID
        assert problems[0].startswith("'v': expected ")
