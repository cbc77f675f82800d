"""`@tool` and `ToolSpec`: a typed, documented Python function described for a model."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

from tir_rl.errors import ToolDefinitionError
from tir_rl.tools.containers import Field, ObjectNode
from tir_rl.tools.docstring import Docstring, parse_docstring
from tir_rl.tools.nodes import INVALID
from tir_rl.tools.schema import UnsupportedTypeError, build_node, make_field
from tir_rl.tools.shipping import shipped_source

P = ParamSpec("P")
R = TypeVar("R", covariant=True)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """Everything known about one tool: what the model reads and how to call it."""

    name: str
    """Name the model calls the tool by (`[A-Za-z0-9_-]{1,64}`)."""
    description: str
    """Docstring summary, extended description and `Returns:` text."""
    parameters: dict[str, Any]
    """JSON schema of the arguments object (derived from the signature and docstring)."""
    fn: Callable[..., Any]
    """The Python function (for sandbox tools: kept for reference, never called here)."""
    is_async: bool = False
    sandbox: bool = False
    """Whether the body runs inside the episode's sandbox instead of the trainer."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Per-call time limit, enforced by `ToolRegistry.acall` and by the sandbox."""
    source: str | None = None
    """For sandbox tools: the source text shipped to the sandbox."""
    function_name: str = ""
    """Name of the `def` in `source` (differs from `name` when `@tool(name=...)` renames it)."""
    arguments: ObjectNode = field(repr=False, compare=False)
    """Validator of the arguments object; `parameters` is its schema."""

    @property
    def json_schema(self) -> dict[str, Any]:
        """OpenAI function-calling schema: `{"type": "function", "function": {...}}`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def check_arguments(self, arguments: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Validate decoded JSON arguments and convert them to the function's keyword arguments.

        Args:
            arguments: the arguments object the model sent.

        Returns:
            The keyword arguments (dataclasses and Enum members built) and the problems found,
            one line each; the keyword arguments are only meaningful when there are none.
        """
        problems: list[str] = []
        converted = self.arguments.convert(dict(arguments), "", problems)
        return ({} if converted is INVALID else converted), problems

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        sandbox: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ToolSpec:
        """Describe a typed function with a Google-style docstring.

        Args:
            fn: the function (sync or async; a bound method works too).
            name: the tool's name; defaults to the function's name.
            sandbox: run the body inside the episode's sandbox (see `tir_rl.tools.shipping`).
            timeout_s: per-call time limit in seconds.

        Returns:
            The spec.

        Raises:
            ToolDefinitionError: the function cannot be described; the message names the
                parameter or the part at fault and how to fix it.
        """
        if not callable(fn):
            raise ToolDefinitionError(f"not a function: {fn!r}")
        name = name if name is not None else getattr(fn, "__name__", "")
        if not _NAME.match(name):
            raise ToolDefinitionError(
                f"tool name {name!r} is invalid: use 1-64 letters, digits, '_' or '-' "
                "(pass @tool(name=...))"
            )
        if not timeout_s > 0:
            raise ToolDefinitionError(f"tool '{name}': timeout_s must be > 0, got {timeout_s}")
        doc = _docstring(fn)
        if not doc.summary:
            raise ToolDefinitionError(
                f"tool '{name}' has no docstring summary: the first docstring line tells the "
                "model what the tool does"
            )
        try:
            hints = _type_hints(fn)
        except Exception as exc:  # NameError and friends from unresolvable annotations
            raise ToolDefinitionError(
                f"tool '{name}': cannot resolve its type hints: {exc}"
            ) from exc
        fields = [
            _parameter_field(p, hints, doc.args, name)
            for p in _signature(fn, name).parameters.values()
        ]
        stale = sorted(set(doc.args) - {f.name for f in fields})
        if stale:
            raise ToolDefinitionError(
                f"the docstring of tool '{name}' documents {', '.join(map(repr, stale))} under "
                "Args:, which is not a parameter; remove or rename it"
            )
        arguments = ObjectNode(name, tuple(fields), noun="argument")
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        source = None
        if sandbox:
            source = shipped_source(fn, name=name, arguments=arguments, hints=hints)
        return cls(
            name=name,
            description=doc.description,
            parameters=arguments.schema(),
            fn=fn,
            is_async=is_async,
            sandbox=sandbox,
            timeout_s=float(timeout_s),
            source=source,
            function_name=getattr(fn, "__name__", name),
            arguments=arguments,
        )


class ToolFunction(Protocol, Generic[P, R]):
    """What `@tool` returns: the function itself, still callable, with its `spec` attached."""

    spec: ToolSpec

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function directly (no validation, no sandbox)."""
        ...


@overload
def tool(fn: Callable[P, R], /) -> ToolFunction[P, R]: ...


@overload
def tool(
    *, name: str | None = None, sandbox: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Callable[[Callable[P, R]], ToolFunction[P, R]]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    sandbox: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Turn a typed function with a Google-style docstring into a tool.

    Use bare (`@tool`) or with options (`@tool(name="add", sandbox=True, timeout_s=5)`).
    The function stays callable as before; its description is in `fn.spec` (a `ToolSpec`).

    Args:
        fn: the function, when used as a bare decorator.
        name: the tool's name; defaults to the function's name.
        sandbox: ship the function's source to the episode's sandbox and run it there.
        timeout_s: per-call time limit in seconds.

    Returns:
        The function with `spec` set, or a decorator when called with options only.

    Raises:
        ToolDefinitionError: the function cannot be described (see `ToolSpec.from_function`).
    """

    def decorate(f: Callable[..., Any]) -> Any:
        spec = ToolSpec.from_function(f, name=name, sandbox=sandbox, timeout_s=timeout_s)
        return _attach(f, spec)

    return decorate(fn) if fn is not None else decorate


def _attach(fn: Callable[..., Any], spec: ToolSpec) -> Any:
    """Set `spec` on the function, or on a thin wrapper where the function takes no attributes."""
    if not hasattr(fn, "spec"):
        try:
            fn.spec = spec  # type: ignore[attr-defined] # the point of @tool
            return fn
        except AttributeError:  # bound methods, builtins
            pass
    if spec.is_async:

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await fn(*args, **kwargs)
    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    functools.update_wrapper(wrapper, fn)
    wrapper.spec = spec  # type: ignore[attr-defined] # the point of @tool
    return wrapper


def _docstring(fn: Callable[..., Any]) -> Docstring:
    """The function's docstring; for a callable object, its class's plus its `__call__`'s."""
    doc = parse_docstring(inspect.getdoc(fn))
    if inspect.isfunction(fn) or inspect.ismethod(fn) or not callable(fn):
        return doc
    call_doc = parse_docstring(inspect.getdoc(type(fn).__call__))
    return dataclasses.replace(doc if doc.summary else call_doc, args={**call_doc.args, **doc.args})


def _signature(fn: Callable[..., Any], name: str) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"tool '{name}': cannot read its signature: {exc}") from exc


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    target = fn if hasattr(fn, "__annotations__") else type(fn).__call__  # callable objects
    return typing.get_type_hints(target)


def _parameter_field(
    param: inspect.Parameter, hints: dict[str, Any], documented: dict[str, str], tool_name: str
) -> Field:
    where = f"parameter '{param.name}' of tool '{tool_name}'"
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        raise ToolDefinitionError(
            f"tool '{tool_name}' takes *{param.name}; a tool's arguments are a JSON object, so "
            "every parameter needs a name: use a list parameter instead"
        )
    if param.kind is inspect.Parameter.VAR_KEYWORD:
        raise ToolDefinitionError(
            f"tool '{tool_name}' takes **{param.name}; list each parameter explicitly (or take "
            "a dict[str, ...] parameter)"
        )
    if param.kind is inspect.Parameter.POSITIONAL_ONLY:
        raise ToolDefinitionError(
            f"{where} is positional-only; tools are called with keyword arguments, remove the `/`"
        )
    if param.name not in hints:
        raise ToolDefinitionError(f"{where} has no type annotation; annotate it, e.g. `x: int`")
    try:
        node = build_node(hints[param.name])
    except UnsupportedTypeError as exc:
        raise ToolDefinitionError(f"{where}: {exc}") from exc
    description = documented.get(param.name, "")
    if not description:
        raise ToolDefinitionError(
            f"{where} is not documented: add `{param.name}: <what it means>` under `Args:` in "
            "the docstring (the model reads it)"
        )
    return make_field(param.name, node, description, param.default)
