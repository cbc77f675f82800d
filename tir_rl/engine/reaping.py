"""Engine processes never outlive the run that started them.

vLLM runs its `EngineCore` (and, with several devices, its `Worker`s) in child processes
started with multiprocessing *spawn* (`vllm/v1/engine/utils.py`, `CoreEngineProcManager`;
`vllm/v1/executor/multiproc_executor.py`). A clean shutdown ends them, but when the run is
killed (SIGKILL, the OOM killer) nothing does: they keep their memory indefinitely and the
next run starts a second engine beside them. Workers already exit when their EngineCore dies
(vLLM's death pipe); the EngineCore has no such link to its parent.

Two pieces close that gap, as labels and `tir-rl sandbox clean` do for containers:

* **Identity.** While a `VLLMLocalEngine` starts, ``TIR_RL_ENGINE_OWNER`` is set to the
  owner's `owner_id` (boot id, pid and start time: unique across pid reuse). Spawned
  children inherit it (workers from their EngineCore), so ``/proc/<pid>/environ`` tells
  whose engine a process is, and whether its owner still lives.
* **Death.** `EngineGuard` starts a small watchdog process (``python -m
  tir_rl.engine.reaping <owner>``, its own session so Ctrl-C does not reach it) that waits
  for the owner to exit and then ends every process carrying that owner's id. A clean
  `close` stops the watchdog first.

If the watchdog itself is killed too, the next engine start and ``tir-rl doctor`` end the
leftovers (`reap_leftovers`): processes whose owner is gone. An engine whose owner is alive
is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tir_rl.process.owner import owner_alive, owner_id, process_state, start_time

logger = logging.getLogger(__name__)

OWNER_ENV = "TIR_RL_ENGINE_OWNER"
"""Environment variable naming the process that owns an engine process (`owner_id`)."""

_PROC = Path("/proc")
_WATCH_INTERVAL_S = 0.2


@dataclass(frozen=True)
class EngineProcess:
    """A process started for an engine (it carries ``TIR_RL_ENGINE_OWNER``)."""

    pid: int
    start_time: str
    """Its own start time, so that a reused pid is never signalled."""
    owner: str
    """The `owner_id` of the run that started it."""
    command: str
    """Its command line or process title (``VLLM::EngineCore``), for messages."""

    @property
    def owner_pid(self) -> int:
        """The pid of the owning run."""
        return int(self.owner.split(":")[1])

    def is_running(self) -> bool:
        """Whether this very process (not a later one with its pid) still runs."""
        return start_time(self.pid) == self.start_time and process_state(self.pid) not in ("Z", "X")


def engine_processes(*, owner: str | None = None) -> list[EngineProcess]:
    """Engine processes on this machine (those of `owner` only, if given)."""
    found = []
    prefix = f"{OWNER_ENV}=".encode()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").strip()
        except OSError:  # gone meanwhile, or another user's process
            continue
        marks = [v for v in environ.split(b"\0") if v.startswith(prefix)]
        start = start_time(int(entry.name))
        if not marks or start is None:
            continue
        mark = marks[0][len(prefix) :].decode(errors="replace")
        if owner is None or mark == owner:
            found.append(
                EngineProcess(int(entry.name), start, mark, command.decode(errors="replace"))
            )
    return found


def leftover_engine_processes() -> list[EngineProcess]:
    """Engine processes whose owning run has exited (never those of a live run)."""
    return [p for p in engine_processes() if not owner_alive(p.owner)]


def end_processes(processes: Sequence[EngineProcess], *, grace_s: float = 5.0) -> None:
    """SIGTERM `processes`, then SIGKILL those still running after `grace_s` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        running = [p for p in processes if p.is_running()]
        for process in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, sig)
        deadline = time.monotonic() + wait_s
        while any(p.is_running() for p in running) and time.monotonic() < deadline:
            time.sleep(0.05)


def reap_leftovers(*, grace_s: float = 5.0) -> list[EngineProcess]:
    """End the engine processes of runs that have exited; returns what was ended."""
    leftovers = leftover_engine_processes()
    if leftovers:
        owners = sorted({p.owner_pid for p in leftovers})
        logger.warning(
            "ending %d leftover engine process(es) of exited run(s) (pids %s, owner pids %s)",
            len(leftovers),
            [p.pid for p in leftovers],
            owners,
        )
        end_processes(leftovers, grace_s=grace_s)
    return leftovers


class EngineGuard:
    """Marks the engine processes started inside `starting` and ends them if the owner dies.

    ``with guard.starting(): start_the_engine()`` sets ``TIR_RL_ENGINE_OWNER`` for the
    children started meanwhile and then starts the watchdog; `close` stops the watchdog
    (call it after a clean engine shutdown).
    """

    def __init__(self) -> None:
        self.owner = owner_id()
        self._watchdog: subprocess.Popen[bytes] | None = None

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Mark the processes started in this block as engine processes of this run."""
        previous = os.environ.get(OWNER_ENV)
        os.environ[OWNER_ENV] = self.owner
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(OWNER_ENV, None)
            else:
                os.environ[OWNER_ENV] = previous
        if self._watchdog is None:
            self._watchdog = _start_watchdog(self.owner)

    def close(self) -> None:
        """Stop the watchdog (idempotent)."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None and watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()


def _start_watchdog(owner: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "tir_rl.engine.reaping", owner],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def watch(owner: str) -> None:
    """Wait for `owner` to exit, then end its engine processes (the watchdog's body)."""
    while owner_alive(owner):
        time.sleep(_WATCH_INTERVAL_S)
    end_processes(engine_processes(owner=owner), grace_s=2.0)


if __name__ == "__main__":
    watch(sys.argv[1])
