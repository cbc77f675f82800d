"""What every sandbox backend shares: the protocol an episode uses, and the settings.

`Sandbox` is what a backend offers an episode; `BackendConfig` holds the settings every
backend has (warm pool, resource limits, per-call deadlines and payload caps), which
`DockerBackend.Config` and `BwrapBackend.Config` extend with their own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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


@dataclass(kw_only=True)
class CellLimits:
    """Per-call limits applied on the host side (shared by every backend)."""

    default_timeout_s: float = 10.0
    """Soft deadline of a call when the caller gives none (raised inside Python)."""
    hard_grace_s: float = 2.0
    """Extra seconds after the soft deadline before the host kills the sandbox."""
    max_code_bytes: int = 1 << 20
    """Larger code or argument payloads are refused without running."""
    max_output_bytes: int = 16384
    """Cap on each of stdout, stderr, the result repr and the traceback (bytes/characters)."""


@dataclass(kw_only=True)
class BackendConfig(CellLimits):
    """Settings every backend has: the per-call limits, the warm pool, resource limits."""

    pool_size: int = 4
    """Sandboxes kept started and waiting for an episode."""
    max_parallel_starts: int = 2
    """Sandboxes started at the same time when refilling the pool."""
    memory_mb: int = 512
    """Memory limit of one sandbox, swap included; exceeding it kills the interpreter
    (bubblewrap without its cgroup: an address-space rlimit, much coarser)."""
    pids_limit: int = 64
    """Maximum processes and threads in one sandbox, to stop fork bombs (bubblewrap without
    its cgroup: RLIMIT_NPROC, which counts per user)."""
    tmpfs_mb: int = 64
    """Size of the sandbox's private ``/tmp`` (the only writable place)."""
    nofile: int = 256
    """Open-file limit."""
    fsize_bytes: int = 64 << 20
    """Largest file a process may write."""
    preload: tuple[str, ...] = ()
    """Modules imported when a sandbox starts (e.g. 'numpy'), before any episode."""
    start_timeout_s: float = 60.0
    """How long a new sandbox may take to answer its first ping."""

    def cell_limits(self) -> CellLimits:
        """A copy of the per-call limits, for the warm pool."""
        return CellLimits(**{f.name: getattr(self, f.name) for f in fields(CellLimits)})
