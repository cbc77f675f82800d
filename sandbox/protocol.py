"""Host side of the REPL protocol: workers, their failures, and responses as `ExecResult`s.

A *worker* is one running REPL server (inside a container, a bubblewrap sandbox or a plain
subprocess) that answers JSON-line requests. Backends differ only in how they start, talk
to and kill workers; everything above (pool, episode, messages) is shared.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from tir_rl.sandbox.base import ExecResult

PROTOCOL_VERSION = 1


class WorkerTimeout(Exception):
    """The worker did not answer before the hard deadline."""


class WorkerDied(Exception):
    """The worker's stream closed or broke (the interpreter exited, crashed or was killed)."""


class Worker(Protocol):
    """One running REPL server, used by one episode at a time."""

    name: str
    """Short identifier for logs (a container id, a pid)."""

    def request(self, payload: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its answer; raise WorkerTimeout or WorkerDied."""
        ...

    def death_reason(self) -> str | None:
        """After WorkerDied: a short account (e.g. 'the memory limit (512 MiB) was exceeded')."""
        ...

    def kill(self) -> None:
        """Kill the worker and everything it started; idempotent, may block briefly."""
        ...


class LineReader:
    """Reads newline-terminated responses from a byte source with a deadline and a size cap.

    `recv(max_bytes, timeout_s)` must return b"" at end of stream and raise `socket.timeout`
    (or `TimeoutError`) when nothing arrived in time.
    """

    def __init__(self, recv: Any, *, max_line_bytes: int) -> None:
        self._recv = recv
        self._buf = bytearray()
        self._max = max_line_bytes

    def read_line(self, deadline: float) -> bytes:
        """Return the next line (without its newline)."""
        while True:
            idx = self._buf.find(b"\n")
            if idx >= 0:
                line = bytes(self._buf[:idx])
                del self._buf[: idx + 1]
                return line
            if len(self._buf) > self._max:
                raise WorkerDied(f"the interpreter sent a response over {self._max} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout()
            try:
                chunk = self._recv(1 << 16, remaining)
            except TimeoutError as exc:
                raise WorkerTimeout() from exc
            except OSError as exc:
                raise WorkerDied(f"the interpreter's stream broke: {exc}") from exc
            if not chunk:
                raise WorkerDied("the interpreter exited")
            self._buf += chunk


def encode_request(payload: dict[str, Any]) -> bytes:
    """One request line."""
    return (json.dumps(payload, ensure_ascii=True) + "\n").encode("ascii")


def decode_response(line: bytes) -> dict[str, Any]:
    """Parse one response line; a malformed line means the protocol stream was corrupted."""
    try:
        response = json.loads(line)
    except ValueError as exc:
        raise WorkerDied("the interpreter's protocol stream was corrupted") from exc
    if not isinstance(response, dict):
        raise WorkerDied("the interpreter's protocol stream was corrupted")
    return response


def response_to_result(response: dict[str, Any], *, duration_s: float) -> ExecResult:
    """Turn a REPL response into an ExecResult (decoding a shipped function's JSON value)."""
    error = response.get("error")
    value = None
    value_json = response.get("value_json")
    if value_json is not None and error is None:
        value = json.loads(value_json)
    return ExecResult(
        stdout=_text(response.get("stdout")),
        stderr=_text(response.get("stderr")),
        result=response.get("result") if isinstance(response.get("result"), str) else None,
        error=_text(error) if error is not None else None,
        timed_out=bool(response.get("timed_out")),
        value=value,
        duration_s=duration_s,
    )


def _text(value: Any) -> str:
    if not isinstance(value, str):
        return ""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")
