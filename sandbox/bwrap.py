"""bubblewrap backend (machines without Docker) and the explicit ``unsafe-local`` backend.

Each worker is ``bwrap ... python3 -I -c <REPL server>`` on the sandbox image's root file
system (the staging root kept by `tir-rl sandbox build`, bound read-only as ``/``), speaking
the same JSON-line protocol over pipes. Isolation: new user, pid, network, IPC, UTS and
mount namespaces (``--unshare-all``), a private size-limited tmpfs ``/tmp``, no capabilities,
``--die-with-parent``; when started as root, bubblewrap itself runs as the unprivileged
`Config.uid` and the worker is put in its own cgroup with memory and pids limits, else
rlimits stand in (see docs/sandbox.md for what that does not cover).

``unsafe-local`` runs the same REPL as a plain child process of the trainer: no isolation
whatsoever. It exists to debug the protocol and is only used when named explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tir_rl.errors import SandboxError, SetupError
from tir_rl.sandbox.base import BackendConfig
from tir_rl.sandbox.image import ImageBuilder, repl_source
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

_CGROUP_V1 = Path("/sys/fs/cgroup")


@dataclass(kw_only=True)
class BwrapBackend:
    """Starts bubblewrap sandboxes (or, with ``isolated=False``, plain subprocesses)."""

    @dataclass(kw_only=True)
    class Config(BackendConfig):
        """bubblewrap sandbox settings."""

        rootfs: Path | None = None
        """Root file system bound read-only as ``/``; default: the last `tir-rl sandbox build`."""
        uid: int = 1000
        """Unprivileged uid that bubblewrap (and the code) runs as when started as root."""
        cgroups: bool = True
        """Put each sandbox in its own memory/pids cgroup when running as root (else, and
        when not root, coarse rlimits stand in: see docs/sandbox.md)."""
        busy_retry_s: float = 10.0
        """How long to keep retrying a start the kernel refuses for now (EAGAIN: without
        cgroups, RLIMIT_NPROC counts every process of `uid`, e.g. a fork bomb still dying)."""

    config: Config = field(default_factory=Config)
    isolated: bool = True
    """False gives the ``unsafe-local`` backend: the REPL as a plain subprocess."""

    def make_pool(self) -> WarmPool:
        """Check the prerequisites and start a warm pool."""
        if self.isolated:
            if shutil.which("bwrap") is None:
                raise SetupError("bubblewrap is not installed: `bash scripts/docker-engine.sh` "
                                 "(or `apt-get install -y bubblewrap`)")
            if not (self.rootfs() / "usr/bin/python3").exists():
                raise SetupError(f"no sandbox root file system at {self.rootfs()}: "
                                 "run `tir-rl sandbox build`")
        cfg = self.config
        return WarmPool(self.start_worker, size=cfg.pool_size,
                        max_parallel_starts=cfg.max_parallel_starts, limits=cfg.cell_limits())

    def rootfs(self) -> Path:
        """The root file system the sandboxes run on."""
        return self.config.rootfs or ImageBuilder().current_rootfs()

    def _command(self) -> list[str]:
        cfg = self.config
        repl = ["-I", "-c", repl_source(),
                json.dumps({"max_output_bytes": cfg.max_output_bytes,
                            "preload": list(cfg.preload)})]
        if not self.isolated:
            return [sys.executable, *repl]
        return [
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", str(self.rootfs().resolve()), "/",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(cfg.tmpfs_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
            "--hostname", "sandbox", "--cap-drop", "ALL", "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "OPENBLAS_NUM_THREADS", "1",
            "--chdir", "/tmp", "python3", *repl,
        ]

    def start_worker(self) -> PipeWorker:
        """Start one sandbox and wait for its REPL to answer; retry while the kernel is busy."""
        deadline = time.monotonic() + self.config.busy_retry_s
        delay = 0.1
        while True:
            try:
                return self._start_worker_once()
            except _KernelBusy as busy:
                if time.monotonic() + delay > deadline:
                    raise SandboxError(
                        f"the bubblewrap sandbox did not start: {busy}. Without cgroups the "
                        f"process limit is RLIMIT_NPROC ({self.config.pids_limit * 8}), which "
                        f"counts every process of uid {self.config.uid} on this machine: end "
                        "that uid's other processes, raise pids_limit, or run as root with "
                        "cgroups on"
                    ) from None
                logger.debug("sandbox start refused for now (%s); retrying", busy)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _start_worker_once(self) -> PipeWorker:
        cfg = self.config
        use_cgroups = self.isolated and cfg.cgroups
        cgroup = Cgroup.create(cfg.memory_mb, cfg.pids_limit) if use_cgroups else None
        as_root = os.geteuid() == 0

        def preexec() -> None:  # runs in the child between fork and exec
            if cgroup is not None:
                cgroup.join(os.getpid())
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if not self.isolated:
                return
            resource.setrlimit(resource.RLIMIT_NOFILE, (cfg.nofile, cfg.nofile))
            resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.fsize_bytes, cfg.fsize_bytes))
            if cgroup is None:  # no cgroups: coarse stand-ins
                mem = cfg.memory_mb << 20
                resource.setrlimit(resource.RLIMIT_AS, (mem * 4, mem * 4))
                resource.setrlimit(resource.RLIMIT_NPROC, (cfg.pids_limit * 8,) * 2)
            if as_root:
                os.setgroups([])
                os.setgid(cfg.uid)
                os.setuid(cfg.uid)

        try:
            proc = subprocess.Popen(
                self._command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, preexec_fn=preexec, start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"} if self.isolated else None,
            )
        except BlockingIOError as exc:  # EAGAIN in fork or setuid: too many processes now
            if cgroup is not None:
                cgroup.remove()
            raise _KernelBusy(str(exc)) from None
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        worker = PipeWorker(proc, cgroup, max_line_bytes=cfg.max_output_bytes * 32)
        worker.memory_mb = cfg.memory_mb
        try:
            pong = worker.request({"op": "ping"}, timeout_s=cfg.start_timeout_s)
        except (WorkerDied, WorkerTimeout) as exc:
            worker.kill()
            diagnostics = worker.diagnostics()
            if _EAGAIN_TEXT in diagnostics:
                raise _KernelBusy(diagnostics) from None
            raise SandboxError(f"the bubblewrap sandbox did not start: {diagnostics} "
                               f"({exc!r}); if this persists, run `tir-rl sandbox build`"
                               ) from None
        if pong.get("pong") != PROTOCOL_VERSION:
            worker.kill()
            raise SandboxError("the sandbox REPL speaks another protocol version")
        return worker


_EAGAIN_TEXT = "Resource temporarily unavailable"


class _KernelBusy(Exception):
    """A sandbox start the kernel refused with EAGAIN (worth retrying shortly)."""


class PipeWorker:
    """A REPL server child process spoken to over its stdin/stdout pipes."""

    def __init__(self, proc: subprocess.Popen, cgroup: Cgroup | None, *,
                 max_line_bytes: int) -> None:
        self.proc = proc
        self.cgroup = cgroup
        self.name = f"pid-{proc.pid}"
        self.memory_mb = 0
        self._stderr = bytearray()
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self._reader = LineReader(self._recv, max_line_bytes=max_line_bytes)
        self._killed = False
        self._kill_lock = threading.Lock()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for chunk in iter(lambda: self.proc.stderr.read1(4096), b""):  # type: ignore[union-attr]
            if len(self._stderr) < 65536:
                self._stderr += chunk

    def _recv(self, max_bytes: int, timeout_s: float) -> bytes:
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            raise TimeoutError()
        return os.read(fd, max_bytes)

    def request(self, payload: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """Send one request and wait (at most `timeout_s`) for the answer."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdin is not None
        data = encode_request(payload)
        try:
            # A write larger than the pipe buffer blocks until the REPL reads it; the REPL
            # reads requests whenever it is idle, and payloads are capped by CellLimits.
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise WorkerDied(f"the interpreter's stream broke: {exc}") from exc
        return decode_response(self._reader.read_line(deadline))

    def diagnostics(self) -> str:
        """What bubblewrap or the interpreter wrote to stderr (start-up failures)."""
        time.sleep(0.05)
        return bytes(self._stderr).decode("utf-8", "replace").strip()[-500:]

    def death_reason(self) -> str | None:
        """Why the interpreter ended (memory limit, signal, exit code)."""
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None  # alive but its stream broke or was corrupted: the caller's reason
        if self.cgroup is not None and self.cgroup.oom_killed():
            return (f"the memory limit ({self.memory_mb} MiB) was exceeded and the interpreter "
                    "was killed")
        if code < 0 or code > 128:
            sig = -code if code < 0 else code - 128
            what = {9: "SIGKILL", 11: "SIGSEGV (segmentation fault)", 6: "SIGABRT"}.get(
                sig, f"signal {sig}")
            return f"the interpreter was killed by {what}"
        return f"the interpreter exited with status {code}"

    def kill(self) -> None:
        """Kill the sandbox and every process in it; idempotent."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup is not None:
            self.cgroup.kill_all()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("sandbox %s did not exit after SIGKILL", self.name)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self.cgroup is not None:
            self.cgroup.remove()


@dataclass
class Cgroup:
    """A per-sandbox cgroup (v1 ``memory`` + ``pids`` hierarchies, or v2) with limits."""

    paths: list[Path]

    @classmethod
    def create(cls, memory_mb: int, pids_limit: int) -> Cgroup | None:
        """Make the cgroup, or return None when cgroups are not writable (not root)."""
        if os.geteuid() != 0:
            return None
        name = f"tir-rl-sandbox/{uuid.uuid4().hex[:12]}"
        mem = str(memory_mb << 20)
        try:
            if (_CGROUP_V1 / "cgroup.controllers").exists():  # v2
                parent = _CGROUP_V1 / "tir-rl-sandbox"
                parent.mkdir(exist_ok=True)
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
                path = _CGROUP_V1 / name
                path.mkdir()
                (path / "memory.max").write_text(mem)
                (path / "memory.swap.max").write_text("0")
                (path / "pids.max").write_text(str(pids_limit))
                return cls([path])
            memory, pids = _CGROUP_V1 / "memory" / name, _CGROUP_V1 / "pids" / name
            memory.mkdir(parents=True)
            pids.mkdir(parents=True)
            (memory / "memory.limit_in_bytes").write_text(mem)
            swap = memory / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(mem)
            (pids / "pids.max").write_text(str(pids_limit))
            return cls([memory, pids])
        except OSError as exc:
            logger.warning("cgroups unavailable (%s); falling back to rlimits", exc)
            return None

    def join(self, pid: int) -> None:
        """Move `pid` into the cgroup (called in the child before exec)."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(pid))

    def kill_all(self) -> None:
        """SIGKILL every process still in the cgroup."""
        for _ in range(50):
            pids = set()
            for path in self.paths:
                try:
                    pids.update(int(p) for p in (path / "cgroup.procs").read_text().split())
                except OSError:
                    pass
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer struck inside this cgroup."""
        for path in self.paths:
            for name, key in (("memory.oom_control", "oom_kill "), ("memory.events", "oom_kill ")):
                try:
                    for line in (path / name).read_text().splitlines():
                        if line.startswith(key) and int(line.split()[1]) > 0:
                            return True
                except (OSError, ValueError):
                    pass
        return False

    def remove(self) -> None:
        """Delete the (empty) cgroup directories."""
        for path in self.paths:
            for _ in range(20):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
