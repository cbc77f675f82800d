"""A private event loop in a daemon thread, so an engine works from any caller's loop.

vLLM's `AsyncLLM` and `httpx.AsyncClient` bind to the loop they were created on. Owning that
loop in a thread makes engine coroutines awaitable from any loop (the agent loop's, a
trainer's `asyncio.run`, a test's) and from plain sync code via `run_sync`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on one long-lived event loop in a daemon thread."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The private loop."""
        return self._loop

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the private loop and block until it finishes."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the private loop from the caller's loop (cancellation propagates)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def stop(self) -> None:
        """Stop the loop and join the thread (idempotent)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()
