"""The run's secret: what every server and endpoint of a run asks its callers for.

A run that listens (a pool of `vllm serve` servers, the chat endpoint, `tir-rl serve`)
generates one secret, keeps it in a file only its owner can read, and hands the file's path
(never the secret itself: command lines are visible to every user of the machine) to the
processes that need it. Each server checks `Authorization: Bearer <secret>` on every route,
health and control routes included (`RunSecretMiddleware`); a request without it gets 401
and reaches nothing. Loopback is no boundary: on a shared machine every user reaches it.

Why every route, and not vLLM's own `--api-key`: vLLM guards only the paths under `/v1`,
`/v2`, `/inference` and `/cohere`, while its development routes (`/collective_rpc`,
`/update_weights`, `/reset_prefix_cache`, ...) change the policy (docs/scale.md, "Who can
drive a run").
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tir_rl.errors import ConfigError

SECRET_FILE_ENV = "TIR_RL_RUN_SECRET_FILE"
"""Environment variable naming the secret file of the run a server belongs to."""
SECRET_FILE_NAME = "secret"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def refuse_unless_own(
    path: Path, info: os.stat_result, *, what: str, open_to: int, fix: str
) -> None:
    """Raise `ConfigError` unless `path` is this user's and closed to others.

    `info` is its stat; `open_to` the permission bits that must be clear (e.g.
    `stat.S_IWGRP | stat.S_IWOTH`: no one else writes it); `what` names the file in the
    message, `fix` says what to do.
    """
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"{what} {path} belongs to another user (uid {info.st_uid}): use one of your own"
        )
    if info.st_mode & open_to:
        raise ConfigError(
            f"{what} {path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): {fix}"
        )


@dataclass(frozen=True)
class RunSecret:
    """A run's bearer token (never printed: `repr` hides it)."""

    value: str = field(repr=False)

    @classmethod
    def generate(cls) -> RunSecret:
        """A fresh 256-bit secret."""
        return cls(secrets.token_urlsafe(32))

    @classmethod
    def read(cls, path: Path) -> RunSecret:
        """The secret in `path`, a file only its owner may read or write.

        Raises:
            ConfigError: the file is missing, empty, not this user's, or open to others.
        """
        try:
            info = path.stat()
            text = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"cannot read the run's secret file {path} ({exc.strerror}): give the file "
                "tir-rl launch or tir-rl serve wrote (<run dir>/launch/secret)"
            ) from exc
        refuse_unless_own(
            path,
            info,
            what="the run's secret file",
            open_to=stat.S_IRWXG | stat.S_IRWXO,
            fix=f"run `chmod 600 {path}`, or start a new run",
        )
        if not text:
            raise ConfigError(f"the run's secret file {path} is empty")
        return cls(text)

    def write(self, path: Path) -> Path:
        """Write the secret to `path`, readable by its owner only; return `path`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.unlink(missing_ok=True)
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(self.value + "\n")
        tmp.replace(path)
        return path

    @property
    def authorization(self) -> str:
        """The `Authorization` header's value."""
        return f"Bearer {self.value}"

    def admits(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries this secret (constant time)."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.strip().encode()).digest()
        return secrets.compare_digest(given, hashlib.sha256(self.value.encode()).digest())


def secret_from_environment() -> RunSecret:
    """The secret of the file `TIR_RL_RUN_SECRET_FILE` names (a server's view of its run).

    Raises:
        ConfigError: the variable is unset, or the file is not a valid secret file.
    """
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        raise ConfigError(
            f"{SECRET_FILE_ENV} is not set: a tir-rl server refuses to start without its run's "
            "secret. tir-rl launch sets it; when starting `vllm serve` yourself, write a secret "
            f"with `python -m tir_rl.process.run_secret FILE` and export {SECRET_FILE_ENV}=FILE"
        )
    return RunSecret.read(Path(path))


class RunSecretMiddleware:
    """ASGI middleware: every HTTP and WebSocket request must carry the run's secret.

    Args:
        app: The application behind it.
        secret: The secret to ask for; None reads `TIR_RL_RUN_SECRET_FILE` now (how vLLM's
            `--middleware` builds it, with the app as its only argument), failing closed
            with `ConfigError` when there is none.
    """

    def __init__(self, app: ASGIApp, secret: RunSecret | None = None) -> None:
        self.app = app
        self.secret = secret if secret is not None else secret_from_environment()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 401 (or close a WebSocket) unless the request carries the secret."""
        if scope["type"] not in ("http", "websocket"):  # lifespan: no caller to check
            await self.app(scope, receive, send)
            return
        if not self.secret.admits(request_header(scope, "authorization")):
            await _refuse(scope, send)
            return
        await self.app(scope, receive, send)


def request_header(scope: Scope, name: str) -> str | None:
    """The value of header `name` (lower case) of an ASGI request, or None."""
    wanted = name.encode()
    for key, value in scope.get("headers", ()):
        if key.lower() == wanted:
            return value.decode("latin-1")
    return None


async def _refuse(scope: Scope, send: Send) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = (
        b'{"error": {"message": "this server belongs to a tir-rl run: send its secret as '
        b'Authorization: Bearer <secret>", "type": "unauthorized", "code": 401}}'
    )
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    """`python -m tir_rl.process.run_secret FILE`: write a fresh secret to FILE (mode 600)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m tir_rl.process.run_secret FILE")
    path = RunSecret.generate().write(Path(args[0]))
    print(f"wrote a new run secret to {path} (mode 600)")


if __name__ == "__main__":
    main()
