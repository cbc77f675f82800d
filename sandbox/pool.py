"""A warm pool of workers and the episode sandbox built on it (shared by every backend).

```
 start jobs (max_parallel_starts threads)          kill jobs (background threads)
      │ new worker, pinged                                  ▲
      ▼                                                     │ after close / timeout / crash
 ready queue ──acquire()──► EpisodeSandbox (one episode) ───┘
      ▲                          │ every acquire schedules one replacement start,
      └──────────────────────────┘ so `size` workers stay warm in steady state
```

A worker serves exactly one episode and is then killed: no state, file or process crosses
episodes. When a cell overruns its hard deadline or the interpreter dies, the worker is
killed, the call returns a result with `state_lost=True`, and the episode's next call runs
in a fresh worker from the pool.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from tir_rl.errors import SandboxError, SetupError
from tir_rl.sandbox.base import CellLimits, ExecResult
from tir_rl.sandbox.protocol import Worker, WorkerDied, WorkerTimeout, response_to_result

logger = logging.getLogger(__name__)

_LOST = "variables, imports and files from earlier calls are gone"


class WarmPool:
    """Keeps `size` started workers ready; hands each to one episode, then kills it."""

    def __init__(
        self,
        start_worker: Callable[[], Worker],
        *,
        size: int,
        max_parallel_starts: int,
        limits: CellLimits,
        acquire_timeout_s: float = 120.0,
        max_attempts: int = 5,
    ) -> None:
        self._start_worker = start_worker
        self.size = size
        self.limits = limits
        self.acquire_timeout_s = acquire_timeout_s
        self.max_attempts = max_attempts
        self._ready: queue.Queue[Worker | BaseException] = queue.Queue()
        self._starts = ThreadPoolExecutor(max_parallel_starts, thread_name_prefix="sandbox-start")
        self._kills = ThreadPoolExecutor(4, thread_name_prefix="sandbox-kill")
        self._lock = threading.Lock()
        self._closed = False
        self._live: set[Worker] = set()
        self.start_durations_s: list[float] = []
        self.num_killed = 0
        for _ in range(size):
            self._schedule_start()

    # ----------------------------------------------------------------- workers

    def _schedule_start(self) -> None:
        with self._lock:
            if not self._closed:
                self._starts.submit(self._start_one)

    def _start_one(self) -> None:
        if self._closed:
            return
        began = time.monotonic()
        try:
            worker = self._start_worker()
        except BaseException as exc:  # noqa: BLE001 - handed to the next acquire()
            logger.warning("sandbox worker failed to start: %s", exc)
            self._ready.put(exc)
            return
        with self._lock:
            self.start_durations_s.append(time.monotonic() - began)
            if self._closed:
                self._kills.submit(worker.kill)
                return
            self._live.add(worker)
        self._ready.put(worker)

    def acquire(self) -> Worker:
        """Take a warm worker (waiting for one if all are in use) and schedule a replacement.

        A failed start is retried a few times (a neighbour's fork bomb or a busy engine can
        make one start fail); a set-up problem (missing image or engine) is raised at once.
        """
        if self._closed:
            raise SandboxError("the sandbox pool was shut down")
        failure: BaseException | None = None
        for attempt in range(self.max_attempts):
            self._schedule_start()
            try:
                item = self._ready.get(timeout=self.acquire_timeout_s)
            except queue.Empty:
                raise SandboxError(
                    f"no sandbox became ready within {self.acquire_timeout_s:g} s; the machine "
                    "may be overloaded (lower the number of concurrent episodes)"
                ) from None
            if isinstance(item, BaseException):
                if isinstance(item, SetupError):
                    raise item
                failure = item
                time.sleep(0.1 * (attempt + 1))
                continue
            try:
                item.request({"op": "ping"}, timeout_s=5.0)
            except (WorkerDied, WorkerTimeout) as exc:
                self.discard(item)
                failure = exc
                continue
            return item
        if isinstance(failure, SandboxError):
            raise failure
        raise SandboxError(f"sandboxes keep failing to start: {failure!r}") from failure

    def discard(self, worker: Worker) -> None:
        """Kill `worker` in the background (never blocks the caller)."""
        with self._lock:
            self._live.discard(worker)
            self.num_killed += 1
            closed = self._closed
            if not closed:
                self._kills.submit(_quiet_kill, worker)
        if closed:
            _quiet_kill(worker)

    def num_ready(self) -> int:
        """Workers started and waiting (approximate)."""
        return self._ready.qsize()

    def close(self) -> None:
        """Kill every worker this pool started; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live)
            self._live.clear()
        self._starts.shutdown(wait=True, cancel_futures=True)
        # Plain threads: executors refuse new work once the interpreter is exiting (atexit).
        killers = [threading.Thread(target=_quiet_kill, args=(w,)) for w in live]
        for thread in killers:
            thread.start()
        for thread in killers:
            thread.join()
        self._kills.shutdown(wait=True)

    def stats(self) -> dict[str, float]:
        """Start-time statistics (for benchmarks and logs)."""
        durations = list(self.start_durations_s)
        return {
            "sandbox/num_started": float(len(durations)),
            "sandbox/num_killed": float(self.num_killed),
            "sandbox/start_median_s": statistics.median(durations) if durations else 0.0,
        }


def _quiet_kill(worker: Worker) -> None:
    try:
        worker.kill()
    except Exception as exc:  # noqa: BLE001 - a failed kill is logged, clean-up catches it later
        logger.warning("could not kill sandbox %s: %s", worker.name, exc)


class EpisodeSandbox:
    """One episode's sandbox (implements `tir_rl.sandbox.base.Sandbox`).

    The worker is taken from the pool lazily, at the first call, so episodes that never run
    code cost nothing. Not thread-safe across calls of one episode (calls are serialised).
    """

    def __init__(self, pool: WarmPool) -> None:
        self._pool = pool
        self._worker: Worker | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.num_restarts = 0

    def run(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run a cell; see `Sandbox.run`."""
        return self._call({"op": "run", "code": code}, len(code.encode("utf-8", "replace")),
                          timeout_s)

    def call_function(
        self,
        source: str,
        function_name: str,
        arguments: dict[str, Any],
        *,
        timeout_s: float | None = None,
    ) -> ExecResult:
        """Define `function_name` from `source` in the sandbox and call it; see `Sandbox`."""
        import json

        try:
            size = len(source) + len(json.dumps(arguments))
        except (TypeError, ValueError) as exc:
            return ExecResult(error=f"TypeError: the arguments are not JSON: {exc}")
        payload = {"op": "call", "source": source, "name": function_name, "arguments": arguments}
        return self._call(payload, size, timeout_s)

    def close(self) -> None:
        """End the episode: its worker is killed (in the background), never reused."""
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._pool.discard(self._worker)
                self._worker = None

    def __enter__(self) -> EpisodeSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, payload: dict[str, Any], size: int, timeout_s: float | None) -> ExecResult:
        limits = self._pool.limits
        timeout_s = limits.default_timeout_s if timeout_s is None else float(timeout_s)
        if size > limits.max_code_bytes:
            return ExecResult(error=f"ValueError: the code is {size} bytes; the limit is "
                                    f"{limits.max_code_bytes} bytes. Send less code or data.")
        with self._lock:
            if self._closed:
                raise SandboxError("this episode's sandbox was closed")
            if self._worker is None:
                self._worker = self._pool.acquire()
            worker = self._worker
            payload = {**payload, "timeout_s": timeout_s}
            began = time.monotonic()
            try:
                response = worker.request(payload, timeout_s=timeout_s + limits.hard_grace_s)
            except WorkerTimeout:
                self._lose(worker)
                return ExecResult(
                    error=f"TimeoutError: the code ran longer than {timeout_s:g} s and did not "
                          f"stop when interrupted, so the interpreter was killed; {_LOST}.",
                    timed_out=True, state_lost=True, duration_s=time.monotonic() - began,
                )
            except WorkerDied as exc:
                reason = worker.death_reason() or str(exc)
                self._lose(worker)
                return ExecResult(
                    error=f"InterpreterDied: {reason}; a fresh interpreter will run the next "
                          f"call ({_LOST}).",
                    state_lost=True, duration_s=time.monotonic() - began,
                )
            result = response_to_result(response, duration_s=time.monotonic() - began)
            if self.num_restarts and result.error and "NameError" in result.error:
                result = replace(result, error=result.error.rstrip() + (
                    f"\n(Note: the interpreter was restarted earlier in this episode; {_LOST}.)"
                ))
            return result

    def _lose(self, worker: Worker) -> None:
        self._pool.discard(worker)
        self._worker = None
        self.num_restarts += 1
