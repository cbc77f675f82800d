"""The rollout producer: plays groups in a thread of its own as fast as the buffer admits them.

::

    GroupBuffer.admit() ──► ticket (task index, due step) ──► G episodes (Rollout.run_episode)
          ▲  on_change wakes the producer                         │ at most
          │  (a step taken, the engine's clock advanced)          │ max_concurrent_episodes
          │                                                       ▼
    trainer: GroupBuffer.take()  ◄───────────────  GroupBuffer.finish(ticket, trajectories)

The producer runs its own event loop in a daemon thread, so episodes go on while the
trainer computes and while new weights reach the engine (an update lands in flight: see
`Engine.update_weights`). `held()` stops admissions until the groups in flight are played
(an evaluation runs alone on the engine); `cancel` ends dropped groups; `stop` ends all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from tir_rl.rollout.buffer import GroupBuffer, GroupTicket

if TYPE_CHECKING:
    from tir_rl.rollout.episode import EpisodeSpec
    from tir_rl.rollout.loop import Rollout
    from tir_rl.types import Trajectory

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 60.0


class RolloutProducer:
    """Feeds a `GroupBuffer` from a background thread; see the module docstring."""

    def __init__(
        self,
        rollout: Rollout,
        buffer: GroupBuffer,
        group_specs: Callable[[int], Sequence[EpisodeSpec]],
        *,
        max_concurrent_episodes: int,
    ) -> None:
        """Set up (nothing runs before `start`).

        Args:
            rollout: the agent loop the episodes run in.
            buffer: where admissions come from and played groups go.
            group_specs: the episodes of the group with a task index.
            max_concurrent_episodes: episodes in flight at once, over all groups.
        """
        self.rollout = rollout
        self.buffer = buffer
        self.group_specs = group_specs
        self.max_concurrent_episodes = max_concurrent_episodes
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._started = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._holding = False
        self._hold_lock = threading.Lock()
        """Orders a hold against an admission: after `held` takes it, nothing is admitted."""
        self._stopping = False
        self._tasks: dict[int, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ the caller's side

    def start(self) -> None:
        """Start the producer thread; groups are admitted from now on."""
        assert self._thread is None, "a producer starts once"
        self._thread = threading.Thread(target=self._run, name="tir-rl-producer", daemon=True)
        self._thread.start()
        self._started.wait()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside the block nothing is admitted and no group is in flight.

        Entering waits until the groups in flight are played (they go to the buffer).
        """
        with self._hold_lock:
            self._holding = True
        try:
            while not self._idle.wait(0.5):  # a timeout, so that Ctrl-C gets through
                pass
            yield
        finally:
            self._holding = False
            self._poke()

    def cancel(self, tickets: Sequence[GroupTicket]) -> None:
        """End the episodes of these groups (dropped by the buffer)."""
        if not tickets or self._loop is None:
            return
        indices = [t.index for t in tickets]

        def cancel_them() -> None:
            for index in indices:
                task = self._tasks.get(index)
                if task is not None:
                    task.cancel()

        with contextlib.suppress(RuntimeError):  # the loop has closed
            self._loop.call_soon_threadsafe(cancel_them)

    def stop(self) -> None:
        """Cancel every group in flight and end the thread (idempotent).

        A cancelled group's task goes back to the buffer's replay list.
        """
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._poke()
        self._thread.join(_STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the rollout producer did not stop within %.0f s", _STOP_TIMEOUT_S)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(wake.set)

    # ------------------------------------------------------------------ the thread's side

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 (handed to the trainer through the buffer)
            logger.exception("the rollout producer failed")
            self.buffer.close(exc)
        finally:
            self._started.set()
            self._idle.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.buffer.on_change(self._poke)
        slots = asyncio.Semaphore(self.max_concurrent_episodes)
        self._started.set()
        try:
            while not self._stopping:
                self._wake.clear()
                while not self._stopping:
                    with self._hold_lock:
                        ticket = None if self._holding else self.buffer.admit()
                        if ticket is None:
                            break
                        self._idle.clear()
                    task = asyncio.create_task(self._play(ticket, slots))
                    self._tasks[ticket.index] = task
                    task.add_done_callback(lambda _t, i=ticket.index: self._done(i))
                await self._wake.wait()
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _done(self, index: int) -> None:
        self._tasks.pop(index, None)
        if not self._tasks:
            self._idle.set()

    async def _play(self, ticket: GroupTicket, slots: asyncio.Semaphore) -> None:
        async def one(spec: EpisodeSpec) -> list[Trajectory]:
            async with slots:
                return await self.rollout.run_episode(spec)

        try:
            episodes = await asyncio.gather(*(one(s) for s in self.group_specs(ticket.index)))
            trajectories = [t for samples in episodes for t in samples]
        except asyncio.CancelledError:
            self.buffer.abandon(ticket)  # stopped (replayed on resume), or dropped (no-op)
            raise
        except BaseException as exc:  # a bug: episodes turn their failures into statuses
            self.buffer.close(exc)
            raise
        self.buffer.finish(ticket, list(trajectories))
