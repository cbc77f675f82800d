"""SIGTERM (a scheduler's `scancel`, a preemption, `kill`): unwind like an exception.

Python's default SIGTERM handling ends the process without running `finally` blocks, which
leaves vLLM's engine and worker processes running (holding gigabytes each) and a training
run without its last checkpoint. `exit_on_sigterm` makes SIGTERM raise `SystemExit(143)`.

An exception raised from a signal handler lands wherever the main thread is. Where that is
a finalizer or a weakref callback, Python prints "Exception ignored" and goes on: the
SIGTERM is lost (seen under Slurm's `scancel`, `bench/slurm_records/`). So the handler
also remembers the request, and long loops call `raise_if_terminated` at their safe points
(the training loop, between steps), which raises it again.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import NoReturn

TERMINATED_STATUS = 128 + signal.SIGTERM
_requested = threading.Event()


def exit_on_sigterm() -> None:
    """Make SIGTERM raise `SystemExit(143)` in this process's main thread.

    Under torchrun the launcher owns termination, so ranks keep the default there (a
    checkpoint would wait on collectives of ranks already gone).
    """
    if os.environ.get("WORLD_SIZE", "1") != "1":
        return
    if threading.current_thread() is not threading.main_thread():
        return
    _requested.clear()
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame: object) -> NoReturn:
    _requested.set()
    raise SystemExit(TERMINATED_STATUS)


def requested() -> bool:
    """Whether this process got SIGTERM since `exit_on_sigterm`."""
    return _requested.is_set()


def raise_if_terminated() -> None:
    """Raise `SystemExit(143)` again if a SIGTERM came (its first raise may have been lost)."""
    if _requested.is_set():
        raise SystemExit(TERMINATED_STATUS)


def forget() -> None:
    """Clear a remembered SIGTERM (tests that send one to their own process)."""
    _requested.clear()
