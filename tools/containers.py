"""Container type nodes: arrays, tuples, maps, and objects with known keys."""

from __future__ import annotations

import collections.abc
import json
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from tir_rl.errors import closest
from tir_rl.tools.nodes import INVALID, TypeNode


@dataclass(frozen=True)
class ArrayNode(TypeNode):
    """`list[X]`, `Sequence[X]` or `tuple[X, ...]`: an array whose items all have one type."""

    item: TypeNode
    as_tuple: bool = False

    @override
    def schema(self) -> dict[str, Any]:
        item = self.item.schema()
        return {"type": "array", "items": item} if item else {"type": "array"}

    @override
    def describe(self) -> str:
        return f"array of {self.item.describe()}"

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        if not isinstance(value, list):
            return _reject_with_json_hint(self, value, path, problems)
        items = [self.item.convert(v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        if any(item is INVALID for item in items):
            return INVALID
        return tuple(items) if self.as_tuple else items

    @override
    def non_json_part(self) -> str | None:
        return self.item.non_json_part()


@dataclass(frozen=True)
class TupleNode(TypeNode):
    """`tuple[X, Y]`: an array of fixed length whose items have one type each."""

    items: tuple[TypeNode, ...]

    @override
    def schema(self) -> dict[str, Any]:
        n = len(self.items)
        prefix = [item.schema() for item in self.items]
        return {"type": "array", "prefixItems": prefix, "minItems": n, "maxItems": n}

    @override
    def describe(self) -> str:
        return "array [" + ", ".join(item.describe() for item in self.items) + "]"

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        if not isinstance(value, list) or len(value) != len(self.items):
            return _reject_with_json_hint(self, value, path, problems)
        out = tuple(
            node.convert(v, f"{path}[{i}]", problems)
            for i, (node, v) in enumerate(zip(self.items, value, strict=True))
        )
        return INVALID if any(v is INVALID for v in out) else out

    @override
    def non_json_part(self) -> str | None:
        return next((p for p in (n.non_json_part() for n in self.items) if p), None)


@dataclass(frozen=True)
class MapNode(TypeNode):
    """`dict[str, X]`: an object with any keys whose values all have one type."""

    value: TypeNode

    @override
    def schema(self) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": self.value.schema() or True}

    @override
    def describe(self) -> str:
        return f"object of {self.value.describe()}"

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        if not isinstance(value, dict):
            return _reject_with_json_hint(self, value, path, problems)
        out = {
            k: self.value.convert(v, f"{path}[{json.dumps(k)}]", problems) for k, v in value.items()
        }
        return INVALID if any(v is INVALID for v in out.values()) else out

    @override
    def non_json_part(self) -> str | None:
        return self.value.non_json_part()


@dataclass(frozen=True)
class Field:
    """One property of an object: a function parameter, a dataclass field or a TypedDict key."""

    name: str
    node: TypeNode
    description: str = ""
    required: bool = True
    default: Any = None
    """JSON form of the default (only meaningful when `has_default`)."""
    has_default: bool = False

    @override
    def schema(self) -> dict[str, Any]:
        """The property's schema: the type's, plus description and default."""
        out = self.node.schema()
        if self.description:
            out["description"] = self.description
        if self.has_default:
            out["default"] = self.default
        return out


@dataclass(frozen=True)
class ObjectNode(TypeNode):
    """An object with known keys: the arguments of a tool, a dataclass or a TypedDict."""

    name: str
    fields: tuple[Field, ...]
    description: str = ""
    factory: collections.abc.Callable[..., Any] | None = None
    """Builds the Python value from the converted keys (a dataclass); None keeps the dict."""
    noun: str = "key"
    """What a property is called in messages: "argument" for a tool's parameters."""

    @override
    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "object"}
        if self.description:
            out["description"] = self.description
        out["properties"] = {f.name: f.schema() for f in self.fields}
        out["required"] = [f.name for f in self.fields if f.required]
        out["additionalProperties"] = False
        return out

    @override
    def describe(self) -> str:
        return f"object {self.name} with keys " + ", ".join(f.name for f in self.fields)

    @override
    def convert(self, value: Any, path: str, problems: list[str]) -> Any:
        if not isinstance(value, dict):
            return _reject_with_json_hint(self, value, path, problems)
        where = f"'{path}': " if path else ""
        names = [f.name for f in self.fields]
        num_before = len(problems)
        for key in value:
            if key not in names:
                line = f"{where}unexpected {self.noun} '{key}'; "
                line += f"valid {self.noun}s are: {', '.join(names)}" if names else "it takes none"
                close = closest(str(key), names)
                problems.append(line + (f" (did you mean '{close}'?)" if close else ""))
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name in value:
                out[f.name] = f.node.convert(value[f.name], _join(path, f.name), problems)
            elif f.required:
                about = f": {f.description}" if f.description else ""
                problems.append(
                    f"{where}missing required {self.noun} '{f.name}' ({f.node.describe()}){about}"
                )
        if len(problems) > num_before or self.factory is None:
            return INVALID if len(problems) > num_before else out
        try:
            return self.factory(**out)
        except Exception as exc:  # a dataclass __post_init__ rejecting the values
            problems.append(f"{where}{type(exc).__name__}: {exc}")
            return INVALID

    @override
    def non_json_part(self) -> str | None:
        if self.factory is not None:
            return f"dataclass {self.name} (use a TypedDict instead)"
        return next((p for p in (f.node.non_json_part() for f in self.fields) if p), None)


def _reject_with_json_hint(node: TypeNode, value: Any, path: str, problems: list[str]) -> Any:
    node.reject(value, path, problems)
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        problems[-1] += " (pass the JSON value itself, not a string containing it)"
    return INVALID


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
