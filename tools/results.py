"""The text a model sees after a tool call: formatted values and error explanations.

Every failure builder returns a `ToolResult` whose `content` says what was wrong and how to
fix it, in words a model can act on. Nothing here raises.
"""

from __future__ import annotations

import json
from typing import Any

from tir_rl.tools.nodes import describe_value
from tir_rl.tools.schema import json_default
from tir_rl.tools.spec import ToolSpec
from tir_rl.types import ToolErrorKind, ToolResult


def format_value(value: Any) -> str:
    """Text of a tool's return value: a str as is, JSON where possible, else `repr`."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=json_default)
    except Exception:  # no JSON form (or a broken __eq__/asdict): fall back to repr
        pass
    try:
        return repr(value)
    except Exception:  # a broken __repr__ must not break the call
        return f"<{type(value).__name__} object>"


def truncate(text: str, max_chars: int) -> str:
    """Cut `text` to at most `max_chars` characters, keeping its start and end.

    The middle is replaced by a visible marker saying how many characters were left out.
    """
    if len(text) <= max_chars:
        return text
    width = len(str(len(text)))
    marker_len = len(_marker(0)) - 1 + width
    keep = max(max_chars - marker_len, 0)
    head = keep * 2 // 3
    tail = keep - head
    marker = _marker(len(text) - head - tail)
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def _marker(num_omitted: int) -> str:
    return f"\n[... {num_omitted} characters truncated ...]\n"


def unknown_tool(name: str, available: list[str], closest: str | None) -> ToolResult:
    """The model called a tool that does not exist."""
    if not available:
        text = f"Error: there is no tool named {name!r}; no tools are available in this task."
    else:
        hint = f" Did you mean '{closest}'?" if closest else ""
        text = (
            f"Error: there is no tool named {name!r}.{hint} "
            f"Available tools: {', '.join(available)}."
        )
    return ToolResult(name=name, content=text, error=ToolErrorKind.UNKNOWN_TOOL)


def malformed_json(name: str, spec: ToolSpec, error: json.JSONDecodeError) -> ToolResult:
    """The arguments string is not valid JSON."""
    text = (
        f"Error: the arguments of tool '{name}' are not valid JSON ({error.msg} at character "
        f"{error.pos}). Send the arguments as one JSON object, for example {_example(spec)}."
    )
    return ToolResult(name=name, content=text, error=ToolErrorKind.MALFORMED_CALL)


def not_an_object(name: str, spec: ToolSpec, arguments: Any) -> ToolResult:
    """The arguments decoded to something other than a JSON object."""
    text = (
        f"Error: the arguments of tool '{name}' must be a JSON object, got "
        f"{describe_value(arguments)}. Send them as {_example(spec)}."
    )
    return ToolResult(name=name, content=text, error=ToolErrorKind.INVALID_ARGUMENTS)


def invalid_arguments(name: str, problems: list[str]) -> ToolResult:
    """The arguments object does not match the tool's schema."""
    lines = "\n".join(f"- {problem}" for problem in problems)
    text = (
        f"Error: invalid arguments for tool '{name}':\n{lines}\nFix these and call '{name}' again."
    )
    return ToolResult(name=name, content=text, error=ToolErrorKind.INVALID_ARGUMENTS)


def tool_raised(name: str, exc: BaseException) -> ToolResult:
    """The tool function raised: its exception type and message, no traceback."""
    message = str(exc)
    text = f"Error: tool '{name}' raised {type(exc).__name__}" + (f": {message}" if message else "")
    return ToolResult(name=name, content=text, error=ToolErrorKind.TOOL_RAISED)


def timed_out(name: str, timeout_s: float, *, in_sandbox: bool = False) -> ToolResult:
    """The tool did not finish within its time limit."""
    where = " in the sandbox and was stopped" if in_sandbox else "; its result was discarded"
    text = (
        f"Error: tool '{name}' did not finish within {timeout_s:g} s{where}. "
        "Try a smaller input or a cheaper approach."
    )
    return ToolResult(name=name, content=text, error=ToolErrorKind.TIMEOUT)


def sandbox_failed(name: str, message: str) -> ToolResult:
    """The sandbox is missing or broke (not the tool's fault, nor the model's)."""
    return ToolResult(name=name, content=f"Error: {message}", error=ToolErrorKind.SANDBOX)


def sandbox_error(name: str, error: str) -> ToolResult:
    """The tool's code failed inside the sandbox; `error` is the sandbox's trimmed traceback."""
    text = f"Error: tool '{name}' failed in the sandbox:\n{error.strip()}"
    return ToolResult(name=name, content=text, error=ToolErrorKind.TOOL_RAISED)


def _example(spec: ToolSpec) -> str:
    """`{"a": <integer>, "b": <integer>}`: the shape of a valid arguments object."""
    parts = [f'"{f.name}": <{f.node.describe()}>' for f in spec.arguments.fields]
    return "{" + ", ".join(parts) + "}"
