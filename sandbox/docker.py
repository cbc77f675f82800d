"""Docker backend: hardened containers, each running one persistent REPL server.

Every container runs ``python3 -I -c <REPL server> <config>`` as its main process (under
Docker's ``--init``), with the flags of `DockerBackend.Config`: unprivileged user, read-only
root, size-limited ``/tmp``, no network, no capabilities, no new privileges, memory / pids /
CPU / open-file / file-size limits. The host talks to the REPL over the container's attached
stdin/stdout (Docker's multiplexed stream), which costs well under a millisecond per cell.

Containers carry labels (`LABEL_RUN`, `LABEL_OWNER`) so that leftovers of crashed runs are
removed at the start of every pool and by ``tir-rl sandbox clean``.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tir_rl.errors import SandboxError, SetupError
from tir_rl.process.owner import owner_alive, owner_id
from tir_rl.sandbox.base import BackendConfig
from tir_rl.sandbox.image import repl_source
from tir_rl.sandbox.pool import WarmPool
from tir_rl.sandbox.protocol import (
    PROTOCOL_VERSION,
    LineReader,
    WorkerDied,
    WorkerTimeout,
    decode_response,
    encode_request,
)

logger = logging.getLogger(__name__)

LABEL_SANDBOX = "tir-rl.sandbox"
LABEL_RUN = "tir-rl.run-id"
LABEL_OWNER = "tir-rl.owner"
"""``<boot id>:<pid>:<process start time>`` of the process that started the container."""

FIX_ENGINE = "bash scripts/docker-engine.sh"
FIX_IMAGE = "tir-rl sandbox build"


@dataclass(kw_only=True)
class DockerBackend:
    """Starts hardened containers and cleans up after crashed runs."""

    @dataclass(kw_only=True)
    class Config(BackendConfig):
        """Docker sandbox settings (every hardening flag is configurable)."""

        pool_size: int = 8  # Docker's own defaults of two `BackendConfig` fields
        max_parallel_starts: int = 4
        image: str = "tir-rl-sandbox:latest"
        """Image with ``python3`` (built by `tir-rl sandbox build`)."""
        cpus: float = 1.0
        """CPU share of one container."""
        user: str = "1000:1000"
        """uid:gid the interpreter runs as (never root)."""
        network: str = "auto"
        """'auto': ``none`` on daemons with a bridge, the daemon default (loopback only) on a
        bridge-less daemon as set up by scripts/docker-engine.sh; or a Docker network mode."""
        docker_host: str | None = None
        """Engine address; default: ``$DOCKER_HOST`` or the local socket."""

    config: Config = field(default_factory=Config)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        self._client: Any = None
        self._network_mode: str | None = None

    # ------------------------------------------------------------------ engine

    @property
    def api(self) -> Any:
        """The low-level Docker API client (connected on first use)."""
        if self._client is None:
            self._client = connect(self.config.docker_host,
                                   max_pool_size=self.config.pool_size * 4 + 64)
        return self._client.api

    def check_image(self) -> None:
        """Raise SetupError naming the fix when the engine or the image is missing."""
        import docker.errors

        try:
            self.api.inspect_image(self.config.image)
        except docker.errors.ImageNotFound:
            raise SetupError(
                f"The sandbox image {self.config.image!r} does not exist: run `{FIX_IMAGE}`."
            ) from None

    def make_pool(self) -> WarmPool:
        """Clean leftovers of crashed runs, check the image, and start a warm pool."""
        clean_containers(self.api, own_run_id=self.run_id, everything=False)
        self.check_image()
        return WarmPool(self.start_worker, size=self.config.pool_size,
                        max_parallel_starts=self.config.max_parallel_starts,
                        limits=self.config.cell_limits())

    def _network(self) -> str | None:
        if self.config.network != "auto":
            return self.config.network
        if self._network_mode is None:
            has_bridge = bool(self.api.networks(names=["bridge"]))
            self._network_mode = "none" if has_bridge else ""
        return self._network_mode or None

    def start_worker(self) -> DockerWorker:
        """Create, attach and start one container and wait for its REPL to answer."""
        import docker.types

        cfg = self.config
        repl_config = {"max_output_bytes": cfg.max_output_bytes, "preload": list(cfg.preload)}
        host_config = self.api.create_host_config(
            init=True,
            mem_limit=f"{cfg.memory_mb}m",
            memswap_limit=f"{cfg.memory_mb}m",
            pids_limit=cfg.pids_limit,
            nano_cpus=int(cfg.cpus * 1e9),
            read_only=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={cfg.tmpfs_mb}m,mode=1777"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=cfg.nofile, hard=cfg.nofile),
                docker.types.Ulimit(name="fsize", soft=cfg.fsize_bytes, hard=cfg.fsize_bytes),
            ],
            network_mode=self._network(),
        )
        container = self.api.create_container(
            cfg.image,
            command=["python3", "-I", "-c", repl_source(), json.dumps(repl_config)],
            user=cfg.user,
            stdin_open=True,
            tty=False,
            working_dir="/tmp",
            environment={"HOME": "/tmp", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
                         "PATH": "/usr/local/bin:/usr/bin:/bin"},
            labels={LABEL_SANDBOX: "1", LABEL_RUN: self.run_id, LABEL_OWNER: owner_id()},
            host_config=host_config,
        )
        cid = container["Id"]
        worker = None
        try:
            sock = self.api.attach_socket(
                cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
            self.api.start(cid)
            worker = DockerWorker(self.api, cid, sock, max_line_bytes=cfg.max_output_bytes * 32,
                                  memory_mb=cfg.memory_mb)
            pong = worker.request({"op": "ping"}, timeout_s=cfg.start_timeout_s)
            if pong.get("pong") != PROTOCOL_VERSION:
                raise SandboxError(f"the sandbox REPL speaks protocol {pong.get('pong')!r}, "
                                   f"expected {PROTOCOL_VERSION}")
            return worker
        except BaseException as exc:
            detail = worker.diagnostics() if worker else ""
            try:
                self.api.remove_container(cid, force=True)
            except Exception:  # noqa: BLE001 - best effort; clean-up removes it later
                pass
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(
                f"sandbox container did not start: {exc!r} {detail} "
                f"(rebuild the image with `{FIX_IMAGE}`)"
            ) from exc


class DockerWorker:
    """One container's REPL, spoken to over its attached (multiplexed) stdio stream."""

    def __init__(
        self, api: Any, container_id: str, sock: Any, *, max_line_bytes: int, memory_mb: int = 0
    ) -> None:
        self.api = api
        self.memory_mb = memory_mb
        self.container_id = container_id
        self.name = container_id[:12]
        self._sock: socket.socket = getattr(sock, "_sock", sock)
        self._keepalive = sock  # the SDK's wrapper owns the HTTP response behind the socket
        self._frames = bytearray()
        self._stderr = bytearray()
        self._reader = LineReader(self._recv_stdout, max_line_bytes=max_line_bytes)
        self._killed = False
        self._kill_lock = threading.Lock()
        self._started = int(time.time()) - 1

    def request(self, payload: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """Send one request and wait (at most `timeout_s`) for the answer."""
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.settimeout(max(timeout_s, 0.001))
            self._sock.sendall(encode_request(payload))
        except TimeoutError as exc:
            raise WorkerTimeout() from exc
        except OSError as exc:
            raise WorkerDied(f"the interpreter's stream broke: {exc}") from exc
        return decode_response(self._reader.read_line(deadline))

    def _recv_stdout(self, max_bytes: int, timeout_s: float) -> bytes:
        """Next chunk of the container's stdout, stripping Docker's 8-byte frame headers."""
        while True:
            if len(self._frames) >= 8:
                stream, size = self._frames[0], struct.unpack(">I", self._frames[4:8])[0]
                if len(self._frames) >= 8 + size:
                    payload = bytes(self._frames[8 : 8 + size])
                    del self._frames[: 8 + size]
                    if stream == 1:
                        return payload
                    if len(self._stderr) < 65536:
                        self._stderr += payload
                    continue
            self._sock.settimeout(max(timeout_s, 0.001))
            chunk = self._sock.recv(max(max_bytes, 1 << 16))
            if not chunk:
                return b""
            self._frames += chunk

    def diagnostics(self) -> str:
        """What the interpreter wrote to its own stderr (start-up failures)."""
        text = bytes(self._stderr).decode("utf-8", "replace").strip()
        return f"(interpreter stderr: {text[-500:]})" if text else ""

    def death_reason(self) -> str | None:
        """Why the container's interpreter ended (memory limit, signal, exit code)."""
        try:
            state = self.api.inspect_container(self.container_id)["State"]
        except Exception:  # noqa: BLE001 - the container may already be gone
            return None
        for _ in range(20):  # the stream closes a moment before Docker records the exit
            if not state.get("Running"):
                break
            time.sleep(0.05)
            state = self.api.inspect_container(self.container_id)["State"]
        code = state.get("ExitCode")
        if state.get("OOMKilled") or (code == 128 + 9 and self._oom_recorded_late()):
            return f"the memory limit ({self.memory_mb} MiB) was exceeded and the interpreter " \
                   "was killed"
        if state.get("Running"):
            return None  # alive but its stream broke or was corrupted: the caller's reason
        if code is not None and code > 128:
            sig = code - 128
            what = {9: "SIGKILL", 11: "SIGSEGV (segmentation fault)", 6: "SIGABRT",
                    15: "SIGTERM"}.get(sig, f"signal {sig}")
            return f"the interpreter was killed by {what}"
        return f"the interpreter exited with status {code}"

    def _oom_recorded_late(self, wait_s: float = 1.0) -> bool:
        """Whether Docker records an OOM kill of this container within `wait_s`.

        Docker can record a SIGKILLed container's exit before the kernel's OOM event reaches
        it, and then `OOMKilled` reads false at first; its event log has the `oom` event.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.api.inspect_container(self.container_id)["State"].get("OOMKilled"):
                    return True
                events = self.api.events(
                    since=self._started,
                    until=int(time.time()) + 1,
                    filters={"container": self.container_id, "event": "oom"},
                    decode=True,
                )
                if any(True for _ in events):
                    return True
            except Exception:  # noqa: BLE001 - the container may already be gone
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def kill(self) -> None:
        """Remove the container (killing everything in it); idempotent."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
        import docker.errors

        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self.api.remove_container(self.container_id, force=True)
        except docker.errors.NotFound:
            pass


def connect(docker_host: str | None = None, *, max_pool_size: int = 64) -> Any:
    """A `docker.DockerClient`, or SetupError naming the command that starts the engine."""
    import docker
    import docker.errors

    try:
        if docker_host:
            client = docker.DockerClient(base_url=docker_host, max_pool_size=max_pool_size)
        else:
            client = docker.from_env(max_pool_size=max_pool_size)
        client.api.ping()
    except docker.errors.DockerException as exc:
        raise SetupError(
            f"Cannot reach the Docker engine ({exc}). Start it with `{FIX_ENGINE}`, "
            f"then build the image with `{FIX_IMAGE}`."
        ) from None
    return client


def clean_containers(api: Any, *, own_run_id: str | None, everything: bool) -> int:
    """Remove sandbox containers of other runs whose owner died (or all, with `everything`)."""
    removed = 0
    for info in api.containers(all=True, filters={"label": LABEL_SANDBOX}):
        labels = info.get("Labels") or {}
        if not everything:
            if labels.get(LABEL_RUN) == own_run_id or owner_alive(labels.get(LABEL_OWNER, "")):
                continue
        try:
            api.remove_container(info["Id"], force=True)
            removed += 1
        except Exception as exc:  # noqa: BLE001 - racing another cleaner is fine
            logger.debug("could not remove %s: %s", info["Id"][:12], exc)
    if removed:
        logger.info("removed %d leftover sandbox container(s)", removed)
    return removed
