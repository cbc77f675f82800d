"""The sandbox protocol: what a code-execution backend offers an episode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one cell (or one shipped function call) run in a sandbox."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    """repr() of the cell's last expression, if it had one and it was not None."""
    error: str | None = None
    """Trimmed traceback (or a one-line account) when the code failed."""
    timed_out: bool = False
    value: Any = None
    """For `call_function`: the function's JSON-decoded return value."""
    state_lost: bool = False
    """The interpreter was killed (hard timeout, memory, crash) during this call: the next
    call runs in a fresh interpreter, without the variables or files of earlier calls."""
    duration_s: float = 0.0
    """Wall-clock time of the call as seen by the host."""

    @property
    def ok(self) -> bool:
        """Whether the code ran to completion without an error."""
        return self.error is None and not self.timed_out


class Sandbox(Protocol):
    """One episode's isolated interpreter; state persists across calls within the episode."""

    def run(self, code: str, *, timeout_s: float) -> ExecResult:
        """Run a cell of Python code."""
        ...

    def call_function(
        self, source: str, function_name: str, arguments: dict[str, Any], *, timeout_s: float
    ) -> ExecResult:
        """Define `function_name` from `source` inside the sandbox and call it with `arguments`.

        The return value comes back JSON-decoded in `ExecResult.value`.
        """
        ...

    def close(self) -> None:
        """End the episode: the sandbox is discarded, never reused."""
        ...
