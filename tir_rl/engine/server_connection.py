"""Where one `vllm serve` server is, how to talk to it, and what its refusals mean.

`ServerConnection` is one server's address, key and timeouts (the run config's
`engine.http` adds a pool's servers to it); `authorization_headers` gives the run's secret
as the bearer token; `http_error` turns an error answer into an `EngineError` that says
what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl.errors import ConfigError, EngineError
from tir_rl.process.run_secret import RunSecret

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True, kw_only=True)
class ServerConnection:
    """Where one `vllm serve` server is and how to talk to it."""

    base_url: str = ""
    """Server root, e.g. `http://127.0.0.1:8000` (no `/v1`)."""
    served_model_name: str | None = None
    """The server's `--served-model-name`; None accepts the server's only model."""
    api_key_file: str | None = None
    """File holding the servers' bearer token (the run's secret, `tir_rl.process.run_secret`), only
    its owner may read it. `tir-rl launch` sets it to the secret it gave its servers."""
    api_key: str | None = None
    """Bearer token given inline, for a server started with `--api-key` by someone else; it
    is written to the run's config.yaml, so prefer `api_key_file`."""
    timeout_s: float = 600.0
    """Longest wait for one response (a long completion under load takes a while)."""
    connect_timeout_s: float = 10.0
    """Longest wait to open a connection."""
    max_retries: int = 4
    """Retries after a connection error or a 502/503/504 answer (not after 4xx)."""
    backoff_s: float = 0.5
    """First retry delay; doubles on every further retry."""
    max_connections: int = 512
    """Concurrent HTTP connections (one per request in flight)."""

    def connection(self) -> dict[str, object]:
        """These settings by name, to build another config that shares them."""
        return {name: getattr(self, name) for name in ServerConnection.__dataclass_fields__}

    def validate_connection(self) -> None:
        """Raise `ConfigError` for an address or retry setting that cannot work."""
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"engine.http.base_url must start with http(s)://: {self.base_url}")
        if self.max_retries < 0 or self.backoff_s < 0:
            raise ConfigError("engine.http.max_retries and engine.http.backoff_s must be >= 0")
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError(
                "engine.http.api_key and engine.http.api_key_file are both set: give the "
                "servers' key one way (api_key_file keeps it out of the run's config.yaml)"
            )


def authorization_headers(address: ServerConnection) -> dict[str, str]:
    """The `Authorization` header for `address`'s servers (none when no key is configured).

    Raises:
        ConfigError: `api_key_file` is not a valid secret file (missing, open to others).
    """
    if address.api_key_file is not None:
        secret = RunSecret.read(Path(address.api_key_file).expanduser())
        return {"Authorization": secret.authorization}
    if address.api_key:
        return {"Authorization": f"Bearer {address.api_key}"}
    return {}


def http_error(
    method: str, url: str, response: httpx.Response, address: ServerConnection
) -> EngineError:
    """The `EngineError` for a server's error answer; a 401 says which key to give."""
    if response.status_code == 401:
        given = "the key it was given" if address.api_key or address.api_key_file else "no key"
        return EngineError(
            f"{method} {url}: HTTP 401: the server refused {given}. A server tir-rl launch "
            "started wants its run's secret: set engine.http.api_key_file to the launch's "
            '<run dir>/launch/secret (docs/scale.md, "Who can drive a run")'
        )
    return EngineError(f"{method} {url}: HTTP {response.status_code}: {_error_text(response)}")


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message", error))[:500]
    return str(error)[:500]
