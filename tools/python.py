"""The Python tool: run model-written code in the episode's sandbox and show what matters.

The model sees what a person at a Python prompt would: printed output, the value of the last
expression, a traceback trimmed to its own code on error, or a plain timeout / memory /
crash message. Variables persist between calls of one episode (the sandbox keeps one
interpreter per episode) and never leak into another episode.

Two ways to use it:

```python
from tir_rl.tools.python import python, use_sandbox, run_python

registry = ToolRegistry([python])
with open_episode() as sb, use_sandbox(sb):      # the rollout binds the episode's sandbox
    registry.call("python", {"code": "x = 6 * 7"})
    registry.call("python", {"code": "x + 1"})   # -> "43"

run_python("print(1 + 1)", sb)                     # the core, without the registry: "2"
```

The binding is a context variable, so concurrent episodes (threads or asyncio tasks, and the
registry's worker threads, which copy the caller's context) each see their own sandbox.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from tir_rl.errors import SandboxError
from tir_rl.sandbox.base import ExecResult, Sandbox
from tir_rl.tools.spec import tool

DEFAULT_TIMEOUT_S = 10.0
"""Per-call limit of the code; the sandbox enforces it (softly, then by a hard kill)."""

NO_OUTPUT = "(no output)"

_current: contextvars.ContextVar[Sandbox | None] = contextvars.ContextVar(
    "tir_rl_python_sandbox", default=None
)


@contextlib.contextmanager
def use_sandbox(sandbox: Sandbox) -> Iterator[Sandbox]:
    """Bind `sandbox` as the one the `python` tool runs in, for the current context."""
    token = _current.set(sandbox)
    try:
        yield sandbox
    finally:
        _current.reset(token)


def format_result(result: ExecResult) -> str:
    """The text the model sees for one executed cell."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.result is not None and result.error is None:
        parts.append(result.result)
    if result.error is not None:
        parts.append(result.error.rstrip("\n"))
    return "\n".join(parts) if parts else NO_OUTPUT


def run_python(code: str, sandbox: Sandbox, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Run `code` in `sandbox` and return the formatted result (never raises for bad code).

    Args:
        code: Python source; the value of a final expression is shown, as at a prompt.
        sandbox: the episode's sandbox.
        timeout_s: time limit of the cell in seconds.

    Returns:
        Output, value, trimmed traceback or a timeout / memory / crash message.
    """
    return format_result(sandbox.run(code, timeout_s=timeout_s))


@tool(timeout_s=DEFAULT_TIMEOUT_S + 30.0)
def python(code: str) -> str:
    """Run Python code in a persistent interpreter and return its output.

    Variables, functions and imports stay defined for later calls. The value of the last
    line is shown if it is an expression, as in an interactive session; use print() for
    anything else. numpy and sympy are installed. There is no network, and only /tmp is
    writable. Each call may run for at most 10 seconds.

    Args:
        code: the Python code to run.

    Returns:
        Printed output, the last expression's value, or the error with its traceback.
    """
    sandbox = _current.get()
    if sandbox is None:
        raise SandboxError(
            "the python tool has no sandbox: run the call inside "
            "`with open_episode() as sb, use_sandbox(sb): ...`"
        )
    return run_python(code, sandbox)
