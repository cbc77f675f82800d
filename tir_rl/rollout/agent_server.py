"""`AgentServer`: the endpoint server `AgentEnv` agents talk to, and the workers behind it.

A run's runtime owns one (`tir_rl.runtime.open_runtime`) and closes it with the run; a
`Rollout` built alone makes its own. It starts the HTTP server on the first agent episode
(a run of stepped envs never listens), and closing it ends the agent workers serving its
key (`WorkerAgentEnv`) before the server stops.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tir_rl.envs.agent_worker import close_agent_workers

if TYPE_CHECKING:
    from tir_rl.endpoint import ChatEndpoint, EndpointServer

__all__ = ["AgentServer"]


class AgentServer:
    """The agents' endpoint server, started on first use.

    Args:
        endpoint: Gives the chat endpoint to serve (called once, on first use); it should
            serve only the episodes the run opens (``open_on_first_call=False``).
    """

    def __init__(self, endpoint: Callable[[], ChatEndpoint]) -> None:
        self._endpoint = endpoint
        self._server: EndpointServer | None = None
        self._lock = threading.Lock()

    def get(self) -> EndpointServer:
        """The running server (started now if this is the first agent episode)."""
        with self._lock:
            if self._server is None:
                from tir_rl.endpoint import EndpointServer

                self._server = EndpointServer(self._endpoint())
            return self._server

    def close(self) -> None:
        """End the agent workers serving this server's key, then the server (idempotent)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            close_agent_workers(server.api_key)
            server.close()
