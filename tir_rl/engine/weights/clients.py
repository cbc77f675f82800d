"""How each engine takes part in a weight transfer by vLLM's engines (`transfer`).

A `TransferGroup` drives the receiving side through a client: `LocalTransferClient` calls
the in-process `AsyncLLM`, `HttpTransferClient` a server's weight-sync routes. Both block;
the transfer backends drive them from threads.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tir_rl.engine.server_connection import authorization_headers, http_error
from tir_rl.errors import EngineError, EngineUnavailableError

if TYPE_CHECKING:
    from tir_rl.engine.server_connection import ServerConnection
    from tir_rl.engine.weights.transfer import WeightTransfer


class LocalTransferClient:
    """A local engine's weight-sync calls (`AsyncLLM`'s), blocking, for a `TransferGroup`."""

    name = "local"

    def __init__(self, call_engine: Callable[..., Any], world_size: int) -> None:
        """`call_engine(name, *args)` runs one of `AsyncLLM`'s methods and waits for it."""
        self._call_engine = call_engine
        self._world_size = world_size

    def world_size(self) -> int:
        """The engine's workers: the ranks it takes in the group."""
        return self._world_size

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer group."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        self._call_engine("init_weight_transfer_engine", request)

    def start_weight_update(self) -> None:
        """Begin an update (vLLM's layerwise reload)."""
        self._call_engine("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one update and load it."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        self._call_engine("update_weights", request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update (vLLM's layerwise reload finishes the layers)."""
        self._call_engine("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the trainer's transfer group."""
        self._call_engine("shutdown_weight_transfer_engine")


class HttpTransferClient:
    """A server's weight-sync routes (vLLM's `/init_weight_transfer_engine` and the rest).

    Blocking calls (the transfer backends drive them from threads); a server that cannot be
    reached raises `EngineUnavailableError`, any other failure `EngineError`.
    """

    def __init__(self, config: ServerConnection, transfer: WeightTransfer) -> None:
        """Read the servers' key once (a transfer makes several calls).

        Raises:
            ConfigError: `api_key_file` is not a valid secret file.
        """
        self.name = config.base_url
        self._config = config
        self._transfer = transfer
        self._headers = authorization_headers(config)

    def world_size(self) -> int:
        """The engine's workers: the ranks it takes in the group."""
        return int(self._call("GET", "/get_world_size")["world_size"])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer group."""
        self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """Begin an update (vLLM's layerwise reload)."""
        self._call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one update and load it."""
        self._call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update (vLLM's layerwise reload finishes the layers)."""
        body = None if weight_version is None else {"weight_version": weight_version}
        self._call("POST", "/finish_weight_update", body)

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the trainer's transfer group."""
        self._call("POST", "/shutdown_weight_transfer_engine")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        c = self._config
        url = f"{c.base_url.rstrip('/')}{path}"
        try:
            response = httpx.request(
                method,
                url,
                json=body,
                headers=self._headers,
                timeout=httpx.Timeout(c.timeout_s, connect=c.connect_timeout_s),
            )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                httpx.ReadError, httpx.WriteError) as exc:  # fmt: skip
            raise EngineUnavailableError(f"{c.base_url} is unreachable: {exc}") from exc
        if response.status_code == 404:
            raise EngineError(
                f"{c.base_url} has no {path} route: start it with VLLM_SERVER_DEV_MODE=1 and "
                f"{shlex.join(self._transfer.server_flag())}"
            )
        if response.status_code >= 400:
            raise http_error(method, url, response, c)
        return response.json() if response.content else None
