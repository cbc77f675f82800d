"""What a tir-rl `vllm serve` runs in front of vLLM's app (`--middleware`, `serve_command`).

Two checks, in this order:

1. **The run's secret on every route** (`tir_rl.process.run_secret.RunSecretMiddleware`, the secret
   read from `TIR_RL_RUN_SECRET_FILE` when the server starts): without it a request gets
   401 and reaches nothing, control routes (`/collective_rpc`, `/update_weights`,
   `/init_weight_transfer_engine`, `/reset_prefix_cache`, ...) and `/health` included.
2. **Published weights verified before they load.** A `POST /collective_rpc` whose method
   is `reload_weights` must carry the folder's digest (`X-Tir-Rl-Weights-Sha256`, which the
   trainer computed when it published the folder: `weights_io.weights_digest`); the server
   hashes the folder's files and refuses (409) when they differ, before vLLM reads them.

This module is imported by the server process: keep it light (no torch, no vLLM).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tir_rl.engine.weights.files import weights_digest
from tir_rl.process.run_secret import (
    ASGIApp,
    Message,
    Receive,
    RunSecretMiddleware,
    Scope,
    Send,
    request_header,
)

SERVER_GUARD = "tir_rl.engine.in_vllm.server_guard.ServerGuard"
"""The `--middleware` import path `serve_command` gives vLLM."""
WEIGHTS_DIGEST_HEADER = "X-Tir-Rl-Weights-Sha256"
MAX_CONTROL_BODY_BYTES = 1 << 20
"""Largest `/collective_rpc` body the reload check reads (a reload's body is a path)."""


class ServerGuard:
    """ASGI middleware for vLLM's API server: the run's secret, then verified reloads.

    Built by vLLM with the app as its only argument; fails closed (`ConfigError`) when
    `TIR_RL_RUN_SECRET_FILE` names no valid secret file.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = RunSecretMiddleware(VerifiedReload(app))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the secret, then the reload, then hand the request to vLLM."""
        await self.app(scope, receive, send)


class VerifiedReload:
    """Refuses a `reload_weights` call whose folder does not match the digest it carries."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass everything but a `/collective_rpc` reload, which is checked first."""
        if not (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope["path"].rstrip("/") == "/collective_rpc"
        ):
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_CONTROL_BODY_BYTES:
                await _answer(send, 413, "a /collective_rpc body is at most 1 MiB")
                return
            if not message.get("more_body", False):
                break
        refusal = await _reload_refusal(body, request_header(scope, WEIGHTS_DIGEST_HEADER.lower()))
        if refusal is not None:
            await _answer(send, 409, refusal)
            return
        await self.app(scope, _replay(body, receive), send)


async def _reload_refusal(body: bytes, digest: str | None) -> str | None:
    """Why a `/collective_rpc` body must not reach vLLM, or None to let it through."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # not a reload: vLLM answers it
    if not isinstance(call, dict) or call.get("method") != "reload_weights":
        return None
    kwargs = call.get("kwargs")
    folder = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
    if not isinstance(folder, str):
        return "reload_weights without a weights_path is refused on a tir-rl server"
    if not digest:
        return (
            f"reload_weights of {folder} carries no {WEIGHTS_DIGEST_HEADER} header: a tir-rl "
            "server loads only weights whose digest the trainer published"
        )
    try:
        on_disk = await asyncio.to_thread(weights_digest, Path(folder))
    except OSError as exc:
        return f"cannot read {folder} to check its digest: {exc}"
    if on_disk != digest:
        return (
            f"the weights in {folder} are not the ones the trainer published (their SHA-256 "
            f"is {on_disk[:16]}..., the trainer's {digest[:16]}...): someone changed them after "
            "publication; nothing was loaded"
        )
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
