"""The HTTP face of `ChatEndpoint`: an OpenAI-compatible server (Starlette on uvicorn).

Routes:

- `POST /episodes/{id}/v1/chat/completions`: a completion recorded under episode `id`
  (give an OpenAI client `base_url=<server>/episodes/<id>/v1`). `POST /v1/chat/completions`
  records under the `X-Episode-Id` header, else the `X-Session-ID` header (verifiers' clients
  send one per rollout), else under a new id returned in `X-Episode-Id`. With
  `"stream": true` the finished completion comes back as server-sent events
  (`tir_rl.endpoint.streaming`).
- `GET /v1/models`, `GET /episodes/{id}/v1/models`: the served model.
- `GET /episodes/{id}`: the calls recorded so far, in token ids.
- `POST /episodes/{id}/finish` with `{"reward": r}` (optionally `"group_id"`): the
  episode's training samples (`tir_rl.endpoint.call_samples`), after which the episode is
  forgotten. This is how a harness in another process (or another Python environment)
  hands its episodes to a trainer.
- `GET /health`.

Every route asks for the server's secret (`Authorization: Bearer <secret>`, the OpenAI
client's `api_key`): a request without it gets 401 (`tir_rl.process.run_secret`). Loopback is no
boundary on a shared machine, so the endpoint has no unauthenticated mode.

`EndpointServer` runs the app in a daemon thread (its own event loop) on a free port, for
a harness in the same process; `tir-rl serve` runs it in the foreground.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from typing import TYPE_CHECKING, Any

from tir_rl.endpoint.call_samples import samples_from_calls
from tir_rl.endpoint.openai_chat import RequestError
from tir_rl.endpoint.recorder import UnknownEpisodeError
from tir_rl.endpoint.streaming import completion_chunks, sse_events
from tir_rl.errors import SetupError, TirError
from tir_rl.process.run_secret import RunSecret, RunSecretMiddleware

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from tir_rl.endpoint.chat_endpoint import ChatEndpoint

__all__ = ["EndpointServer", "build_app"]

EPISODE_HEADER = "x-episode-id"
SESSION_HEADER = "x-session-id"
"""The per-rollout header verifiers' clients send (the same value every turn): an episode id
when no `X-Episode-Id` is given."""


def build_app(endpoint: ChatEndpoint, secret: RunSecret) -> Starlette:
    """The ASGI app serving `endpoint` to callers that send `secret`."""
    try:
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route
    except ImportError as exc:  # pragma: no cover (vLLM brings starlette)
        raise SetupError(
            "the endpoint needs starlette and uvicorn: pip install 'tir-rl[serve]'"
        ) from exc

    def error(exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    async def read_json(request: Request) -> Any:
        limit = endpoint.max_request_bytes
        too_large = RequestError(
            f"the request body is over {limit} bytes, more than a prompt of the context's "
            f"{endpoint.max_context_tokens} tokens can take: shorten the conversation",
            status=413,
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not JSON: {exc}") from exc

    async def completions(request: Request) -> Response:
        episode_id = (
            request.path_params.get("episode_id")
            or request.headers.get(EPISODE_HEADER)
            or request.headers.get(SESSION_HEADER)
            or uuid.uuid4().hex[:16]
        )
        try:
            payload = await read_json(request)
            body = await endpoint.complete(episode_id, payload)
        except RequestError as exc:
            return error(exc)
        headers = {EPISODE_HEADER: episode_id}
        if payload.get("stream"):
            options = payload.get("stream_options") or {}
            chunks = completion_chunks(body, include_usage=bool(options.get("include_usage")))
            return StreamingResponse(
                sse_events(chunks), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(body, headers=headers)

    async def models(request: Request) -> JSONResponse:
        entry = {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "tir-rl"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def episode(request: Request) -> JSONResponse:
        calls = endpoint.recorder.calls(request.path_params["episode_id"])
        return JSONResponse({"calls": [c.to_json() for c in calls]})

    async def finish(request: Request) -> JSONResponse:
        episode_id = request.path_params["episode_id"]
        if not endpoint.recorder.clients_open_episodes:
            return error(
                RequestError(
                    "a training run ends an agent's episode when the agent returns its reward; "
                    "/finish is for episodes a client opened (tir-rl serve)",
                    status=403,
                )
            )
        try:
            data = await read_json(request)
            reward = data.get("reward") if isinstance(data, dict) else None
            if not isinstance(reward, int | float) or not math.isfinite(reward):
                raise RequestError("finish needs {'reward': <finite number>}", param="reward")
            group_id = int(data.get("group_id", 0))
            calls = endpoint.recorder.take(episode_id)
        except RequestError as exc:
            return error(exc)
        except UnknownEpisodeError as exc:
            return error(RequestError(str(exc), status=404))
        samples = samples_from_calls(calls, reward=float(reward), group_id=group_id)
        return JSONResponse({"samples": [s.to_dict() for s in samples]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/episodes/{episode_id}/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/episodes/{episode_id}/v1/models", models, methods=["GET"]),
            Route("/episodes/{episode_id}", episode, methods=["GET"]),
            Route("/episodes/{episode_id}/finish", finish, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[Middleware(RunSecretMiddleware, secret=secret)],
    )


class EndpointServer:
    """`build_app(endpoint)` served by uvicorn in a daemon thread; a context manager.

    Args:
        endpoint: What to serve.
        host: Interface to bind.
        port: 0 picks a free port (`url` tells which).
        secret: What callers must send as their API key; None generates one (`api_key`).
    """

    def __init__(
        self,
        endpoint: ChatEndpoint,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: RunSecret | None = None,
    ) -> None:
        import uvicorn

        self.endpoint = endpoint
        self._secret = secret if secret is not None else RunSecret.generate()
        config = uvicorn.Config(
            build_app(endpoint, self._secret),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name="tir-rl-endpoint", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise TirError(
                    f"the endpoint could not listen on {host}:{port} (see the log above): "
                    "choose another port"
                )
            self._thread.join(timeout=0.02)
        sockets = self._server.servers[0].sockets
        bound_host, bound_port = sockets[0].getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        """The server's root URL (`<url>/v1` is an OpenAI base URL)."""

    @property
    def api_key(self) -> str:
        """The secret callers send (an OpenAI client's `api_key`)."""
        return self._secret.value

    def episode_base_url(self, episode_id: str) -> str:
        """The OpenAI base URL that records under `episode_id`."""
        return f"{self.url}/episodes/{episode_id}/v1"

    def close(self) -> None:
        """Stop serving and join the thread (idempotent)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> EndpointServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
