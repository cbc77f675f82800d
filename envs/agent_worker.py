"""`WorkerAgentEnv`: episodes played by a long-lived worker process that stays up.

`CommandAgentEnv` starts one process per episode. A harness that is slow to start (verifiers
spends 7 s importing itself, then loads its environment) pays that for every episode. A
`WorkerAgentEnv` starts its command once (or `workers` times) and sends it every episode
as one line of JSON; the worker plays many episodes at once and answers each with a line.

The protocol, one JSON object per line, is all a worker must speak (any language; no
tir-rl import):

- tir-rl writes ``{"id": ID, "base_url": URL, "split": "train"|"test", "index": N}`` to the
  worker's standard input for each episode, and ``{"cancel": ID}`` when an episode is
  cancelled or overruns `rollout.agent_timeout_s` (the worker should stop playing it).
- The worker writes ``{"id": ID, "reward": r}`` or ``{"id": ID, "error": "message"}`` to
  its standard output when an episode ends. Other lines are ignored.
- The endpoint's API key is in the worker's environment (``TIR_RL_ENDPOINT_KEY`` and
  ``OPENAI_API_KEY``), as for `CommandAgentEnv`.
- The worker exits when its standard input closes (the run ended or was killed).

An episode whose worker dies ends with `error_agent` (its calls kept, reward 0) and the next
episode starts the worker again; a worker that dies before answering any episode
`MAX_FAILED_STARTS` times in a row is not started again, and its episodes fail at once with
its standard error's end. The rollout closes its workers with its endpoint; closing kills
each worker's whole process group.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

from tir_rl.envs.agent_env import ENDPOINT_KEY_ENV, ProgramAgentEnv, check_argv
from tir_rl.envs.episode import Task
from tir_rl.errors import ConfigError

__all__ = [
    "MAX_FAILED_STARTS",
    "AgentWorker",
    "AgentWorkerError",
    "AgentWorkerPool",
    "EpisodeRequest",
    "WorkerAgentEnv",
    "close_agent_workers",
]

log = logging.getLogger(__name__)

MAX_FAILED_STARTS = 3
"""A worker that dies this many times in a row without answering an episode stays down."""
STDERR_LINES = 40
"""How much of a worker's standard error its error messages quote."""


class AgentWorkerError(RuntimeError):
    """A worker could not play an episode: it died, could not start, or answered an error."""


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode for a worker to play."""

    id: str
    base_url: str
    split: str
    index: int

    def line(self) -> str:
        """The request as the worker reads it: one JSON line."""
        return json.dumps(dataclasses.asdict(self)) + "\n"


class AgentWorker:
    """One worker process and the episodes it is playing."""

    def __init__(self, argv: list[str], api_key: str) -> None:
        self.argv = argv
        self._pending: dict[str, concurrent.futures.Future[float]] = {}
        self._lock = threading.Lock()
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, ENDPOINT_KEY_ENV: api_key, "OPENAI_API_KEY": api_key},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: closing kills its children too
        )
        self.answered = 0
        """Episodes this worker answered (a reward or an error of the episode's own)."""
        self._stderr_reader = threading.Thread(
            target=self._read_stderr, name="agent worker stderr", daemon=True
        )
        self._stderr_reader.start()
        threading.Thread(target=self._read_answers, name="agent worker", daemon=True).start()

    @property
    def pid(self) -> int:
        """The worker's process id (and process group id)."""
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    @property
    def load(self) -> int:
        """Episodes in play."""
        return len(self._pending)

    def submit(self, request: EpisodeRequest) -> concurrent.futures.Future[float]:
        """Send the episode; the future gets its reward or an `AgentWorkerError`."""
        future: concurrent.futures.Future[float] = concurrent.futures.Future()
        with self._lock:
            self._pending[request.id] = future
        if not self._write(request.line()):
            self._fail(request.id, self._died("before it read the episode"))
        return future

    def cancel(self, episode_id: str) -> None:
        """Tell the worker to stop playing the episode (its answer, if any, is dropped)."""
        with self._lock:
            self._pending.pop(episode_id, None)
        self._write(json.dumps({"cancel": episode_id}) + "\n")

    def stderr_tail(self) -> str:
        """The end of what the worker wrote to its standard error."""
        return "\n".join(self._stderr)[-800:]

    def close(self, grace_s: float = 5.0) -> None:
        """Close its input, then end its process group (TERM, then KILL after `grace_s`)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        self.proc.wait()

    # ------------------------------------------------------------------ threads
    def _write(self, line: str) -> bool:
        try:
            assert self.proc.stdin is not None
            with self._lock:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
        except (OSError, ValueError):  # a closed pipe: the worker is gone
            return False
        return True

    def _read_answers(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answer = _parse_answer(line)
            if answer is None:
                log.debug("agent worker %d: %s", self.pid, line.rstrip())
                continue
            episode_id, reward, error = answer
            with self._lock:
                future = self._pending.pop(episode_id, None)
                self.answered += 1
            if future is None:  # cancelled, or an id the worker made up
                continue
            if error is not None:
                _settle(future, error=AgentWorkerError(f"the worker answered: {error}"))
            else:
                _settle(future, reward=reward)
        self.proc.wait()
        with self._lock:
            orphans = list(self._pending)
        for episode_id in orphans:
            self._fail(episode_id, self._died("while playing this episode"))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip())

    def _died(self, when: str) -> AgentWorkerError:
        try:
            status = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        self._stderr_reader.join(timeout=2)  # its last lines, read once it closed
        return AgentWorkerError(
            f"the agent worker {self.argv[0]} (pid {self.pid}) exited with status {status} "
            f"{when}; the next episode starts it again. Its stderr ends: {self.stderr_tail()}"
        )

    def _fail(self, episode_id: str, error: AgentWorkerError) -> None:
        with self._lock:
            future = self._pending.pop(episode_id, None)
        if future is not None:
            _settle(future, error=error)


def _settle(
    future: concurrent.futures.Future[float],
    *,
    reward: float | None = None,
    error: BaseException | None = None,
) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(float(reward))  # type: ignore[arg-type]
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass


def _parse_answer(line: str) -> tuple[str, float | None, str | None] | None:
    """(id, reward, error) from an answer line; None for any other line."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("id"), str):
        return None
    if "error" in value:
        return value["id"], None, str(value["error"])
    reward = value.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return value["id"], None, f"its answer has no numeric reward: {line.strip()[:200]}"
    return value["id"], float(reward), None


class AgentWorkerPool:
    """`size` workers of one command; each episode goes to the least loaded one."""

    def __init__(self, argv: list[str], api_key: str, size: int) -> None:
        self.argv, self.api_key, self.size = argv, api_key, size
        self._workers: list[AgentWorker | None] = [None] * size
        self._failed_starts = [0] * size
        self._lock = threading.Lock()
        self._turn = 0

    def submit(self, request: EpisodeRequest) -> tuple[AgentWorker, concurrent.futures.Future]:
        """Send the episode to a live worker (starting one if needed)."""
        with self._lock:
            slot = min(range(self.size), key=self._slot_order)
            self._turn += 1
            worker = self._workers[slot]
            if worker is None or not worker.alive:
                worker = self._start(slot, worker)
            self._workers[slot] = worker
        return worker, worker.submit(request)

    def _slot_order(self, slot: int) -> tuple[int, int]:
        """Least loaded first; among equals, the next in turn (so every worker plays)."""
        worker = self._workers[slot]
        load = 0 if worker is None or not worker.alive else worker.load
        return load, (slot - self._turn) % self.size

    def _start(self, slot: int, dead: AgentWorker | None) -> AgentWorker:
        if dead is not None:
            self._failed_starts[slot] = 0 if dead.answered else self._failed_starts[slot] + 1
            if self._failed_starts[slot] >= MAX_FAILED_STARTS:
                raise AgentWorkerError(
                    f"the agent worker {self.argv[0]} died {MAX_FAILED_STARTS} times without "
                    f"answering an episode; it is not started again. Run its command "
                    f"{self.argv} by hand to see why. Its stderr ends: {dead.stderr_tail()}"
                )
            dead.close(grace_s=0.5)
        return AgentWorker(self.argv, self.api_key)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.pid for w in self._workers if w is not None and w.alive]

    def close(self) -> None:
        """End every worker of the pool."""
        with self._lock:
            workers, self._workers = self._workers, [None] * self.size
        for worker in workers:
            if worker is not None:
                worker.close()


_POOLS: dict[tuple[tuple[str, ...], str, int], AgentWorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def worker_pool(argv: list[str], api_key: str, size: int) -> AgentWorkerPool:
    """The pool for this command and endpoint key, started on first use."""
    key = (tuple(argv), api_key, size)
    with _POOLS_LOCK:
        if key not in _POOLS:
            if not _POOLS:  # registering twice would only close twice
                atexit.unregister(_close_all)
                atexit.register(_close_all)
            _POOLS[key] = AgentWorkerPool(argv, api_key, size)
        return _POOLS[key]


def close_agent_workers(api_key: str) -> None:
    """End every worker serving the endpoint with this key (its rollout closes)."""
    with _POOLS_LOCK:
        keys = [key for key in _POOLS if key[1] == api_key]
        pools = [_POOLS.pop(key) for key in keys]
    for pool in pools:
        pool.close()


def _close_all() -> None:
    for api_key in {key[1] for key in list(_POOLS)}:
        close_agent_workers(api_key)


class WorkerAgentEnv(ProgramAgentEnv):
    """Episodes played by a worker process that stays up (the protocol is the module's doc).

    ``env.kwargs.command`` is the worker's argv, e.g. ``[.venv-verifiers/bin/python,
    examples/verifiers_env/worker.py]``; ``workers`` how many to run (each plays any number
    of episodes at once; `rollout.max_concurrent_episodes` bounds the total).
    """

    @dataclass(kw_only=True)
    class Config(ProgramAgentEnv.Config):
        """Options (from the run config's `env.kwargs`)."""

        command: list[str] = dataclasses.field(default_factory=list)
        """The worker's argv; started once per worker, in the run's working directory."""
        workers: int = 1
        """Worker processes; each episode goes to the one with the fewest in play."""

        def validate(self) -> None:
            """Raise `ConfigError` naming the bad field."""
            super().validate()
            check_argv(
                self.command,
                "WorkerAgentEnv needs env.kwargs.command: a list of strings (the worker's "
                "argv), e.g. [.venv-verifiers/bin/python, examples/verifiers_env/worker.py]",
            )
            if self.workers < 1:
                raise ConfigError(f"env.kwargs.workers={self.workers}: must be >= 1")

    config: Config

    async def agent(self, client: Any, task: Task) -> float:
        """Send the episode to a worker and wait for its reward."""
        import asyncio

        base_url = str(client.base_url).rstrip("/")
        pool = worker_pool(self.config.command, str(client.api_key), self.config.workers)
        request = EpisodeRequest(
            id=base_url.split("/")[-2],  # the endpoint's episode key (.../episodes/<key>/v1)
            base_url=base_url,
            split=self.split.value,
            index=int(task.data["index"]),
        )
        worker, future = pool.submit(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            worker.cancel(request.id)
            raise
