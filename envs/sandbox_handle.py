"""`LazySandbox`: an episode's sandbox, opened on first use and closed once.

Environments hand a `LazySandbox` to their tool registry on every call. Nothing is opened
until a tool actually runs code, so environments whose tools are plain in-process
functions never touch Docker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from tir_rl.errors import SandboxError

if TYPE_CHECKING:
    from tir_rl.sandbox.base import ExecResult, Sandbox


class LazySandbox:
    """Implements the `Sandbox` protocol by opening the real one on the first call."""

    def __init__(self, factory: Callable[[], AbstractContextManager[Sandbox]]) -> None:
        """Remember how to open the sandbox; open nothing yet.

        Args:
            factory: Returns a context manager yielding the sandbox
                (e.g. `tir_rl.sandbox.open_episode`).
        """
        self._factory = factory
        self._context: AbstractContextManager[Sandbox] | None = None
        self._sandbox: Sandbox | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        """Whether the real sandbox has been opened."""
        return self._sandbox is not None

    def _get(self) -> Sandbox:
        with self._lock:
            if self._closed:
                raise SandboxError("this episode's sandbox was closed; reset the environment")
            if self._sandbox is None:
                try:
                    context = self._factory()
                    self._sandbox = context.__enter__()
                except SandboxError:
                    raise
                except Exception as exc:  # a broken factory is a sandbox failure too
                    raise SandboxError(f"could not open the episode's sandbox: {exc!r}") from exc
                self._context = context
            return self._sandbox

    def run(self, code: str, *, timeout_s: float) -> ExecResult:
        """Run a cell of Python code in the episode's sandbox (opening it if needed)."""
        return self._get().run(code, timeout_s=timeout_s)

    def call_function(
        self, source: str, function_name: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> ExecResult:
        """Call a shipped function in the episode's sandbox (opening it if needed)."""
        return self._get().call_function(source, function_name, arguments, timeout_s=timeout_s)

    def close(self) -> None:
        """Close the real sandbox if it was opened; idempotent."""
        with self._lock:
            context, self._context, self._sandbox = self._context, None, None
            self._closed = True
        if context is not None:
            context.__exit__(None, None, None)
