"""Which process owns a resource, told apart from a later process that reuses its pid.

Sandbox containers (a Docker label) and engine processes (an environment variable) carry
their owner's `owner_id`; cleaners end what belongs to owners that are no longer alive.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def boot_id() -> str:
    """This boot of the machine (pids and start times are only unique within one)."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]


def process_state(pid: int) -> str | None:
    """The state letter of `pid` (R, S, Z, ...), or None when there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0]


def owner_id(pid: int | None = None) -> str:
    """``<boot id>:<pid>:<start time>``: one process, told apart from a later one with its pid."""
    pid = os.getpid() if pid is None else pid
    return f"{boot_id()}:{pid}:{start_time(pid)}"


def owner_alive(owner: str) -> bool:
    """Whether the process named by `owner_id` still runs (a zombie counts as dead)."""
    try:
        boot, pid_text, start = owner.split(":")
        pid = int(pid_text)
    except ValueError:
        return False
    if boot != boot_id() or start_time(pid) != start:
        return False
    return process_state(pid) not in ("Z", "X", None)
