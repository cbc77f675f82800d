"""Counts of tool calls and failures, for metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tir_rl.types import ToolErrorKind, ToolResult

UNKNOWN_TOOL_KEY = "<unknown>"
"""Per-tool key under which calls of tools that do not exist are counted."""


@dataclass
class ToolStats:
    """Tool calls and failures since the last `reset`, in total, per error kind and per tool.

    Calls of unknown tools are counted under `UNKNOWN_TOOL_KEY`, so that made-up names do not
    grow the per-tool tables without bound.
    """

    num_calls: int = 0
    num_errors: int = 0
    errors_by_kind: dict[ToolErrorKind, int] = field(
        default_factory=lambda: dict.fromkeys(ToolErrorKind, 0)
    )
    """Every `ToolErrorKind`, zero when it did not happen."""
    calls_by_tool: dict[str, int] = field(default_factory=dict)
    errors_by_tool: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, tool: str, result: ToolResult) -> None:
        """Count one call of `tool` (its registered name, or `UNKNOWN_TOOL_KEY`)."""
        with self._lock:
            self.num_calls += 1
            self.calls_by_tool[tool] = self.calls_by_tool.get(tool, 0) + 1
            if result.error is not None:
                self.num_errors += 1
                self.errors_by_kind[result.error] += 1
                self.errors_by_tool[tool] = self.errors_by_tool.get(tool, 0) + 1

    def reset(self) -> None:
        """Set every count back to zero."""
        with self._lock:
            self.num_calls = 0
            self.num_errors = 0
            self.errors_by_kind = dict.fromkeys(ToolErrorKind, 0)
            self.calls_by_tool = {}
            self.errors_by_tool = {}

    def as_metrics(self, prefix: str = "tools") -> dict[str, float]:
        """Flat metric names (`tools/calls`, `tools/errors/timeout`, `tools/calls/add`...)."""
        with self._lock:
            out = {
                f"{prefix}/calls": float(self.num_calls),
                f"{prefix}/errors": float(self.num_errors),
                f"{prefix}/error_rate": self.num_errors / self.num_calls if self.num_calls else 0.0,
            }
            out.update({f"{prefix}/errors/{k}": float(v) for k, v in self.errors_by_kind.items()})
            out.update({f"{prefix}/calls/{k}": float(v) for k, v in self.calls_by_tool.items()})
            out.update(
                {f"{prefix}/tool_errors/{k}": float(v) for k, v in self.errors_by_tool.items()}
            )
            return out
