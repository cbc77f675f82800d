"""Type nodes: the JSON schema of one type hint and the validator of the values a model sends.

This module holds the base class and the scalar nodes; `containers` holds arrays and objects.

Coercion is only done where it loses nothing: an int where a float is expected, an integral
float such as `3.0` where an int is expected (JSON Schema counts it as an integer too). A string
is never turned into a number, and a bool is never an int. Problems are collected, not raised,
so that one error message can list everything the model got wrong.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from typing_extensions import override


class _Invalid:
    """Marker returned by `TypeNode.convert` when the value was rejected."""


INVALID: Any = _Invalid()


class TypeNode(ABC):
    """One type hint: its JSON schema, its name in error messages, and its validator."""

    @abstractmethod
    def schema(self) -> dict[str, Any]:
        """The JSON schema of this type."""

    @abstractmethod
    def describe(self) -> str:
        """Short name of the expected JSON value, for error messages ("array of integer")."""

    @abstractmethod
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        """Check a decoded JSON value and convert it to the Python value the function gets.

        Args:
            value: the decoded JSON value the model sent.
            path: where the value sits, for messages (`p.x`, `xs[2]`; empty for the root).
            problems: list that each problem found is appended to, as one line.

        Returns:
            The converted value, or `INVALID` when a problem was appended.
        """

    def non_json_part(self) -> str | None:
        """Name of a part whose Python value is not plain JSON (Enum, dataclass), if any."""
        return None

    def reject(self, value: Any, path: str, problems: list[str]) -> Any:
        """Append "expected X, got Y" for `value` to `problems`; return `INVALID`."""
        problems.append(f"'{path}': expected {self.describe()}, got {describe_value(value)}")
        return INVALID


@dataclass(frozen=True)
class PrimitiveNode(TypeNode):
    """integer, number, boolean, string or null."""

    kind: Literal["integer", "number", "boolean", "string", "null"]

    @override
    def schema(self) -> dict[str, Any]:
        return {"type": self.kind}

    @override
    def describe(self) -> str:
        return self.kind

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        kind = self.kind
        if kind == "null" and value is None:
            return None
        if kind == "boolean" and isinstance(value, bool):
            return value
        if kind == "string" and isinstance(value, str):
            return value
        if kind in ("integer", "number") and isinstance(value, int | float):
            if isinstance(value, bool):
                return self.reject(value, path, problems)
            if kind == "integer" and isinstance(value, int):
                return value
            if kind == "integer" and value.is_integer():
                return int(value)
            if kind == "number" and isinstance(value, float):
                return value
            if kind == "number" and _exact_float(value):
                return float(value)
        self.reject(value, path, problems)
        hint = _quoted_hint(kind, value)
        if hint:
            problems[-1] += hint
        return INVALID


@dataclass(frozen=True)
class AnyNode(TypeNode):
    """Any JSON value, passed through unchanged."""

    @override
    def schema(self) -> dict[str, Any]:
        return {}

    @override
    def describe(self) -> str:
        return "any JSON value"

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        return value


@dataclass(frozen=True)
class ChoiceNode(TypeNode):
    """`Literal[...]` or an `Enum`: one of a fixed set of JSON values."""

    json_values: tuple[Any, ...]
    python_values: tuple[Any, ...]
    enum_name: str | None = None

    @override
    def schema(self) -> dict[str, Any]:
        kinds = {_json_kind(v) for v in self.json_values}
        out: dict[str, Any] = {"type": kinds.pop()} if len(kinds) == 1 else {}
        out["enum"] = list(self.json_values)
        return out

    @override
    def describe(self) -> str:
        return "one of " + ", ".join(json.dumps(v) for v in self.json_values)

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        for json_value, python_value in zip(self.json_values, self.python_values, strict=True):
            if _same_json(value, json_value):
                return python_value
        return self.reject(value, path, problems)

    @override
    def non_json_part(self) -> str | None:
        return f"Enum {self.enum_name} (use Literal[...] instead)" if self.enum_name else None


@dataclass(frozen=True)
class UnionNode(TypeNode):
    """`X | Y` (and `Optional[X]`): the first option that accepts the value wins."""

    options: tuple[TypeNode, ...]

    @override
    def schema(self) -> dict[str, Any]:
        return {"anyOf": [option.schema() for option in self.options]}

    @override
    def describe(self) -> str:
        return " or ".join(option.describe() for option in self.options)

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        for option in self.options:
            scratch: list[str] = []
            out = option.convert(value, path, scratch)
            if out is not INVALID:
                return out
        non_null = [o for o in self.options if o != PrimitiveNode("null")]
        if value is not None and len(non_null) == 1:
            return non_null[0].convert(value, path, problems)  # its detailed problems
        return self.reject(value, path, problems)

    @override
    def non_json_part(self) -> str | None:
        return next((p for p in (n.non_json_part() for n in self.options) if p), None)


def describe_value(value: Any) -> str:
    """How a value the model sent is named in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, int | float):
        return f"number {json.dumps(value)}"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"string {json.dumps(text, ensure_ascii=False)}"
    if isinstance(value, list):
        return f"array of length {len(value)}"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int | float):
        return type(a) is type(b) and a == b
    return isinstance(b, int | float) and a == b


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string"}.get(type(value), "string")


def _exact_float(value: int) -> bool:
    try:
        return float(value) == value
    except OverflowError:
        return False


def _quoted_hint(kind: str, value: Any) -> str:
    if not isinstance(value, str):
        return ""
    if kind in ("integer", "number"):
        try:
            float(value)
        except ValueError:
            return ""
        return f" (write the number without quotes: {value.strip()})"
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return f" (write {value.strip().lower()} without quotes)"
    return ""
