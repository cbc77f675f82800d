"""Checks that a sandbox tool's source can run alone inside the sandbox, and its shipped text.

A `@tool(sandbox=True)` function is not called in the trainer: its source text is sent to the
episode's sandbox, defined there in a fresh namespace and called with the validated JSON
arguments. So everything the body needs must be in the body: no closures, no module globals
(imports go inside the function), no decorators besides `@tool`, literal defaults, and JSON
types in and out.
"""

from __future__ import annotations

import ast
import builtins
import dis
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

from tir_rl.errors import ToolDefinitionError
from tir_rl.tools.containers import ObjectNode
from tir_rl.tools.schema import UnsupportedTypeError, build_node

FUTURE_LINE = "from __future__ import annotations\n"
"""Prepended to the shipped source, so that annotations (`Literal[...]`, TypedDicts) are never
evaluated inside the sandbox, where their names do not exist."""


def shipped_source(
    fn: Callable[..., Any], *, name: str, arguments: ObjectNode, hints: dict[str, Any]
) -> str:
    """Check that `fn` can run alone in a sandbox and return the source text to ship.

    Args:
        fn: the function decorated with `@tool(sandbox=True)`.
        name: the tool's name, for messages.
        arguments: the node of its parameters (checked for non-JSON types).
        hints: its resolved type hints, including `return`.

    Returns:
        The dedented `def` with the `@tool` decorator lines removed, after `FUTURE_LINE`.

    Raises:
        ToolDefinitionError: something in the function cannot be shipped; the message says what.
    """
    where = f"sandbox tool '{name}'"
    if not isinstance(fn, types.FunctionType):
        raise ToolDefinitionError(
            f"{where} must be a plain `def` function with no decorator but @tool, got {fn!r}"
        )
    if inspect.iscoroutinefunction(fn):
        raise ToolDefinitionError(f"{where} must be a plain `def`, not `async def`")
    free = [v for v in fn.__code__.co_freevars if v != fn.__name__]  # recursion is fine
    if free:
        raise ToolDefinitionError(
            f"{where} uses variables of an enclosing function "
            f"({', '.join(free)}); only its own source is shipped, "
            "so pass these values as arguments or define them inside the function"
        )
    func_def, lines = _parse(fn, where)
    _check_decorators(func_def, where)
    _check_defaults(func_def, where)
    _check_globals(fn, where)
    for field in arguments.fields:
        part = field.node.non_json_part()
        if part:
            raise ToolDefinitionError(
                f"parameter '{field.name}' of {where} has {part}: a sandbox tool receives plain "
                "JSON values"
            )
    _check_return(hints, where)
    first = func_def.lineno - 1
    assert func_def.end_lineno is not None
    return FUTURE_LINE + "\n".join(lines[first : func_def.end_lineno]) + "\n"


def _parse(fn: types.FunctionType, where: str) -> tuple[ast.FunctionDef, list[str]]:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise ToolDefinitionError(
            f"{where}: its source is not available ({exc}); define it in a .py file"
        ) from exc
    tree = ast.parse(source)
    func_def = tree.body[0] if tree.body else None
    if not isinstance(func_def, ast.FunctionDef) or func_def.name != fn.__name__:
        raise ToolDefinitionError(f"{where}: its source does not start with `def {fn.__name__}`")
    return func_def, source.splitlines()


def _is_tool_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Name):
        return target.id == "tool"
    return isinstance(target, ast.Attribute) and target.attr == "tool"


def _check_decorators(func_def: ast.FunctionDef, where: str) -> None:
    for decorator in func_def.decorator_list:
        if not _is_tool_decorator(decorator):
            raise ToolDefinitionError(
                f"{where} has the decorator @{ast.unparse(decorator)}; only @tool is allowed, "
                "because the function's source is shipped to the sandbox without it"
            )


def _check_defaults(func_def: ast.FunctionDef, where: str) -> None:
    args = func_def.args
    positional = [*args.posonlyargs, *args.args]
    pairs = list(
        zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
    )
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d]
    for arg, default in pairs:
        try:
            ast.literal_eval(default)
        except ValueError:
            raise ToolDefinitionError(
                f"parameter '{arg.arg}' of {where} has the default `{ast.unparse(default)}`, "
                "which is not a literal; the sandbox cannot evaluate it, write the value itself"
            ) from None


def _check_globals(fn: types.FunctionType, where: str) -> None:
    loaded: set[str] = set()
    stored: set[str] = set()
    for code in _code_objects(fn.__code__):
        for instruction in dis.get_instructions(code):
            if instruction.opname == "LOAD_GLOBAL":
                loaded.add(instruction.argval)
            elif instruction.opname == "STORE_GLOBAL":
                stored.add(instruction.argval)
    missing = sorted(loaded - stored - set(dir(builtins)) - {fn.__name__})
    if missing:
        raise ToolDefinitionError(
            f"{where} uses the global name(s) {', '.join(missing)}, which do not exist inside "
            "the sandbox; import modules and define helpers inside the function body"
        )


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _check_return(hints: dict[str, Any], where: str) -> None:
    if "return" not in hints:
        raise ToolDefinitionError(
            f"{where} needs a return annotation: its value comes back from the sandbox as JSON"
        )
    try:
        part = build_node(hints["return"]).non_json_part()
    except UnsupportedTypeError as exc:
        raise ToolDefinitionError(f"the return type of {where}: {exc}") from exc
    if part:
        raise ToolDefinitionError(
            f"the return type of {where} has {part}: the value comes back as plain JSON"
        )
