"""`ToolRegistry`: the tools of an environment, called by name with a model's arguments.

A call goes: look the tool up, decode the arguments (a dict, or a raw JSON string), validate
and convert them against the derived schema, run the tool (in the trainer, in a worker thread,
or in the episode's sandbox), format the value and cap its length. A model's mistake at any
step becomes an error `ToolResult` whose text says how to fix the call; the registry never
raises for it, and counts every failure by kind in `stats`.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tir_rl.errors import ConfigError, SandboxError, ToolDefinitionError, closest
from tir_rl.tools import results
from tir_rl.tools.spec import ToolSpec
from tir_rl.tools.stats import UNKNOWN_TOOL_KEY, ToolStats
from tir_rl.types import ToolResult

if TYPE_CHECKING:  # the sandbox package (and its backends) is not imported at run time
    from tir_rl.sandbox.base import ExecResult, Sandbox


class ToolRegistry:
    """The tools one environment offers, by name."""

    @dataclass(kw_only=True)
    class Config:
        """Options of a tool registry."""

        max_result_chars: int = 8000
        """Result text longer than this is cut in the middle, with a visible marker."""
        sandbox_grace_s: float = 10.0
        """Seconds a sandbox may overrun a tool's timeout before the call counts as a sandbox
        failure (the sandbox enforces the timeout itself; this only guards against a hang)."""

    def __init__(self, tools: Iterable[Any] = (), *, config: Config | None = None) -> None:
        """Collect tools.

        Args:
            tools: `@tool` functions, `ToolSpec`s, or plain typed functions with Google
                docstrings (described on the spot, as by `@tool`).
            config: options; defaults to `ToolRegistry.Config()`.

        Raises:
            ToolDefinitionError: two tools share a name, or a plain function cannot be described.
            ConfigError: `config.max_result_chars` is too small to hold the truncation marker.
        """
        self.config = config or ToolRegistry.Config()
        if self.config.max_result_chars < 100:
            raise ConfigError(
                f"max_result_chars must be at least 100, got {self.config.max_result_chars}"
            )
        self._specs: dict[str, ToolSpec] = {}
        for item in tools:
            spec = _as_spec(item)
            if spec.name in self._specs:
                raise ToolDefinitionError(
                    f"two tools are named '{spec.name}'; pass @tool(name=...) to rename one"
                )
            self._specs[spec.name] = spec
        self.stats = ToolStats()
        """Calls and failures by kind and by tool since the last `stats.reset()`."""

    @property
    def names(self) -> list[str]:
        """Names of the tools, in registration order."""
        return list(self._specs)

    @property
    def json_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function-calling schemas of all tools (for the chat format's system turn)."""
        return [spec.json_schema for spec in self._specs.values()]

    @property
    def needs_sandbox(self) -> bool:
        """Whether any tool runs inside the episode's sandbox."""
        return any(spec.sandbox for spec in self._specs.values())

    def __getitem__(self, name: str) -> ToolSpec:
        return self._specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def call(self, name: str, arguments: Any, *, sandbox: Sandbox | None = None) -> ToolResult:
        """Call a tool synchronously; never raises for a model's mistake.

        Sync tools run in the calling thread, without a time limit (use `acall` for one).
        Async tools run to completion under `asyncio.run`, with their time limit, so `call`
        must not be used for them from inside a running event loop.

        Args:
            name: the tool's name, as the model wrote it.
            arguments: a dict, or the raw JSON string of one; None or "" mean no arguments.
            sandbox: the episode's sandbox, required by `@tool(sandbox=True)` tools.

        Returns:
            The result: the value's text, or an error explaining how to fix the call.
        """
        prepared = self._prepare(name, arguments)
        if isinstance(prepared, ToolResult):
            return self._finish(prepared, UNKNOWN_TOOL_KEY if name not in self else name)
        spec, kwargs = prepared
        if spec.sandbox:
            result = self._sandbox_call(name, spec, kwargs, sandbox)
        elif spec.is_async:
            _refuse_running_loop(name)
            result = asyncio.run(self._run_async(name, spec, kwargs))
        else:
            try:
                value = spec.fn(**kwargs)
            except (Exception, SystemExit) as exc:
                result = results.tool_raised(name, exc)
            else:
                result = self._success(name, value)
        return self._finish(result, spec.name)

    async def acall(
        self, name: str, arguments: Any, *, sandbox: Sandbox | None = None
    ) -> ToolResult:
        """Call a tool without blocking the event loop; never raises for a model's mistake.

        Async tools are awaited; sync tools and sandbox calls run in a worker thread, so a
        slow tool of one episode never stalls the others. The tool's `timeout_s` is enforced:
        an async tool is cancelled, but a thread cannot be killed in Python, so a sync tool
        that overruns keeps running in its (daemon) thread until it returns on its own, and
        its result is discarded. Tools that may hang belong in the sandbox, which kills them.

        Args:
            name: the tool's name, as the model wrote it.
            arguments: a dict, or the raw JSON string of one; None or "" mean no arguments.
            sandbox: the episode's sandbox, required by `@tool(sandbox=True)` tools.

        Returns:
            The result: the value's text, or an error explaining how to fix the call.
        """
        prepared = self._prepare(name, arguments)
        if isinstance(prepared, ToolResult):
            return self._finish(prepared, UNKNOWN_TOOL_KEY if name not in self else name)
        spec, kwargs = prepared
        if spec.sandbox:
            deadline = asyncio.timeout(spec.timeout_s + self.config.sandbox_grace_s)
            try:
                async with deadline:
                    result = await _in_thread(self._sandbox_call, name, spec, kwargs, sandbox)
            except TimeoutError:
                if not deadline.expired():
                    raise
                result = results.sandbox_failed(
                    name, f"the sandbox did not answer within {spec.timeout_s:g} s + grace"
                )
        else:
            result = await self._run_async(name, spec, kwargs)
        return self._finish(result, spec.name)

    def _prepare(self, name: str, arguments: Any) -> tuple[ToolSpec, dict[str, Any]] | ToolResult:
        spec = self._specs.get(name)
        if spec is None:
            return results.unknown_tool(name, self.names, closest(str(name), self.names))
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            arguments = {}
        if isinstance(arguments, str | bytes):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return results.malformed_json(name, spec, exc)
        if not isinstance(arguments, dict):
            return results.not_an_object(name, spec, arguments)
        kwargs, problems = spec.check_arguments(arguments)
        if problems:
            return results.invalid_arguments(name, problems)
        return spec, kwargs

    async def _run_async(self, name: str, spec: ToolSpec, kwargs: dict[str, Any]) -> ToolResult:
        deadline = asyncio.timeout(spec.timeout_s)
        try:
            async with deadline:
                if spec.is_async:
                    value = await spec.fn(**kwargs)
                else:
                    value = await _in_thread(spec.fn, **kwargs)
                if inspect.isawaitable(value):  # a sync callable that returned a coroutine
                    value = await value
        except TimeoutError as exc:
            if deadline.expired():
                return results.timed_out(name, spec.timeout_s)
            return results.tool_raised(name, exc)
        except (Exception, SystemExit) as exc:
            return results.tool_raised(name, exc)
        return self._success(name, value)

    def _sandbox_call(
        self, name: str, spec: ToolSpec, kwargs: dict[str, Any], sandbox: Sandbox | None
    ) -> ToolResult:
        if sandbox is None:
            return results.sandbox_failed(
                name,
                f"tool '{name}' runs inside a sandbox, but none was given to the registry "
                "(configure a sandbox backend for this environment)",
            )
        assert spec.source is not None, "sandbox specs always carry their source"
        try:
            executed: ExecResult = sandbox.call_function(
                spec.source, spec.function_name, kwargs, timeout_s=spec.timeout_s
            )
        except SandboxError as exc:
            return results.sandbox_failed(name, f"the sandbox failed while running '{name}': {exc}")
        if executed.timed_out:
            return results.timed_out(name, spec.timeout_s, in_sandbox=True)
        if executed.error is not None:
            return results.sandbox_error(name, executed.error)
        return self._success(name, executed.value)

    def _success(self, name: str, value: Any) -> ToolResult:
        return ToolResult(name=name, content=results.format_value(value), value=value)

    def _finish(self, result: ToolResult, tool_key: str) -> ToolResult:
        capped = results.truncate(result.content, self.config.max_result_chars)
        if capped is not result.content:
            result = replace(result, content=capped)
        self.stats.record(tool_key, result)
        return result


def _as_spec(item: Any) -> ToolSpec:
    if isinstance(item, ToolSpec):
        return item
    spec = getattr(item, "spec", None)
    if isinstance(spec, ToolSpec):
        return spec
    if callable(item):
        return ToolSpec.from_function(item)
    raise ToolDefinitionError(f"not a tool: {item!r} (expected a @tool function or a ToolSpec)")


def _refuse_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"ToolRegistry.call cannot run the async tool '{name}' inside a running event loop; "
        "use `await registry.acall(...)`"
    )


async def _in_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run `fn` in a new daemon thread and await its result.

    Like `asyncio.to_thread`, but a thread left running after a timeout neither holds a slot
    of the loop's executor nor blocks the interpreter (or `asyncio.run`) from exiting.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, exc: BaseException | None) -> None:
        if future.done():  # cancelled by a timeout: nobody waits for the result
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value, exc = context.run(fn, *args, **kwargs), None
        except BaseException as error:  # handed to the awaiting task, which decides
            value, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop is closed: the caller gave up long ago
            pass

    threading.Thread(
        target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True
    ).start()
    return await future
