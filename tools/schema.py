"""JSON schema from Python type hints: `build_node(tp)` turns a hint into a `TypeNode`.

The node writes the JSON schema the model reads and checks (and converts) the JSON value the
model sends back; see `tir_rl.tools.nodes`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect
import json
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

from tir_rl.config.field_docs import field_docs
from tir_rl.tools.containers import ArrayNode, Field, MapNode, ObjectNode, TupleNode
from tir_rl.tools.docstring import parse_docstring
from tir_rl.tools.nodes import INVALID, AnyNode, ChoiceNode, PrimitiveNode, TypeNode, UnionNode

SUPPORTED_TYPES = (
    "int, float, bool, str, None, list[X], tuple[X, ...], tuple[X, Y], dict[str, X], "
    "X | None, X | Y, Literal[...], Enum, dataclasses, TypedDicts, Any"
)


class UnsupportedTypeError(Exception):
    """A type hint has no JSON schema; the message says which part and why."""


def build_node(tp: Any, *, seen: frozenset[type] = frozenset()) -> TypeNode:
    """The `TypeNode` of a type hint.

    Args:
        tp: a resolved type hint (as returned by `typing.get_type_hints`).
        seen: classes being described further up (recursive types are refused).

    Returns:
        The node.

    Raises:
        UnsupportedTypeError: the hint has no JSON schema; the message names the part.
    """
    if tp is Any:
        return AnyNode()
    if tp is None or tp is type(None):
        return PrimitiveNode("null")
    primitive = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in primitive:
        return PrimitiveNode(primitive[tp])  # type: ignore[arg-type] # the dict's values are kinds
    bare = {list: ArrayNode(AnyNode()), tuple: ArrayNode(AnyNode(), as_tuple=True),
            dict: MapNode(AnyNode())}  # fmt: skip
    if tp in bare:
        return bare[tp]
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return UnionNode(tuple(build_node(a, seen=seen) for a in args))
    if origin is Literal:
        return _choice(args, repr(tp).replace("typing.", ""))
    if origin in (list, collections.abc.Sequence):
        return ArrayNode(build_node(args[0], seen=seen) if args else AnyNode())
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return ArrayNode(build_node(args[0], seen=seen), as_tuple=True)
        return TupleNode(tuple(build_node(a, seen=seen) for a in args))
    if origin in (dict, collections.abc.Mapping):
        if args and args[0] not in (str, Any):
            raise UnsupportedTypeError(
                f"{_type_name(tp)}: JSON object keys are strings, use dict[str, ...]"
            )
        return MapNode(build_node(args[1], seen=seen) if args else AnyNode())
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _choice(tuple(tp), tp.__name__, enum_name=tp.__name__)
    if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or is_typeddict(tp)):
        if tp in seen:
            raise UnsupportedTypeError(
                f"{tp.__name__} refers to itself; recursive types are not supported"
            )
        return _object_node(tp, seen | {tp})
    raise UnsupportedTypeError(
        f"{_type_name(tp)} has no JSON schema; supported types are: {SUPPORTED_TYPES}"
    )


def json_form(value: Any) -> Any:
    """Plain-JSON form of a Python value (Enum -> value, dataclass -> dict, tuple -> list).

    Raises:
        TypeError: the value has no JSON form.
    """
    return json.loads(json.dumps(value, default=json_default))


def json_default(value: Any) -> Any:
    """`json.dumps` hook for the Python values tools take and return."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _object_node(cls: type, seen: frozenset[type]) -> ObjectNode:
    try:
        hints = get_type_hints(cls)
    except Exception as exc:  # unresolvable forward reference
        raise UnsupportedTypeError(
            f"cannot resolve the type hints of {cls.__name__}: {exc}"
        ) from exc
    doc = parse_docstring(cls.__doc__)
    attributes = {k: " ".join(v.split()) for k, v in field_docs(cls).items()}
    described = {**doc.args, **attributes}
    summary = doc.summary if not doc.summary.startswith(f"{cls.__name__}(") else ""
    fields: list[Field] = []
    if is_typeddict(cls):
        required_keys = getattr(cls, "__required_keys__", frozenset(hints))
        items = [(name, name in required_keys, dataclasses.MISSING) for name in hints]
    else:
        items = [
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
             f.default)
            for f in dataclasses.fields(cls)
            if f.init
        ]  # fmt: skip
    for name, required, default in items:
        try:
            node = build_node(hints[name], seen=seen)
        except UnsupportedTypeError as exc:
            raise UnsupportedTypeError(f"field '{name}' of {cls.__name__}: {exc}") from exc
        fields.append(_field(name, node, described.get(name, ""), required, default))
    factory = cls if dataclasses.is_dataclass(cls) else None
    return ObjectNode(cls.__name__, tuple(fields), description=summary, factory=factory)


def make_field(name: str, node: TypeNode, description: str, default: Any) -> Field:
    """A tool parameter's `Field`; `default` is `inspect.Parameter.empty` when there is none."""
    missing = default is inspect.Parameter.empty
    return _field(name, node, description, missing, dataclasses.MISSING if missing else default)


def _field(name: str, node: TypeNode, description: str, required: bool, default: Any) -> Field:
    if required or default is dataclasses.MISSING:
        return Field(name, node, description, required=required)
    if default is None and node.convert(None, "", []) is INVALID:
        node = UnionNode((node, PrimitiveNode("null")))  # `x: int = None` means int | None
    try:
        return Field(name, node, description, False, json_form(default), has_default=True)
    except (TypeError, ValueError):  # a default with no JSON form is simply not shown
        return Field(name, node, description, required=False)


def _choice(values: tuple[Any, ...], name: str, enum_name: str | None = None) -> ChoiceNode:
    json_values = tuple(v.value if isinstance(v, enum.Enum) else v for v in values)
    for v in json_values:
        if v is not None and not isinstance(v, str | int | float | bool):
            raise UnsupportedTypeError(f"{name} has the value {v!r}, which is not a JSON scalar")
    return ChoiceNode(json_values, tuple(values), enum_name)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and get_origin(tp) is None:
        return tp.__name__
    return repr(tp).replace("typing.", "")
