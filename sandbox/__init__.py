"""Sandboxed code execution for code tools (tir_rl.sandbox).

```python
from tir_rl.sandbox import open_episode
with open_episode() as sb:                   # one episode's sandbox from the warm pool
    sb.run("x = 41", timeout_s=5)
    sb.run("print(x + 1)", timeout_s=5).stdout   # "42" and a newline
```

Backends (`SandboxConfig.backend`): ``docker`` (default; see docker.py), ``bwrap``
(bubblewrap, for machines without Docker; see bwrap.py) and ``unsafe-local`` (a plain
subprocess, no isolation at all, for debugging only; never chosen automatically).
The threat model of each is in docs/sandbox.md.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from tir_rl.errors import ConfigError
from tir_rl.sandbox.base import ExecResult, Sandbox
from tir_rl.sandbox.bwrap import BwrapBackend
from tir_rl.sandbox.docker import DockerBackend

__all__ = [
    "Backend", "ExecResult", "Sandbox", "SandboxConfig", "configure", "get_pool",
    "open_episode", "shutdown",
]


class Backend(enum.StrEnum):
    """Which isolation runs the code."""

    DOCKER = "docker"
    BWRAP = "bwrap"
    UNSAFE_LOCAL = "unsafe-local"


@dataclass(kw_only=True)
class SandboxConfig:
    """Which backend runs code tools, and its settings."""

    backend: Backend = Backend.DOCKER
    """'docker' (default), 'bwrap', or 'unsafe-local' (no isolation: debugging only)."""
    run_id: str | None = None
    """Label put on this run's containers (default: random per process)."""
    docker: DockerBackend.Config = field(default_factory=DockerBackend.Config)
    """Settings of the Docker backend."""
    bwrap: BwrapBackend.Config = field(default_factory=BwrapBackend.Config)
    """Settings of the bubblewrap (and unsafe-local) backend."""

    def validate(self) -> None:
        """Check values that the type annotations cannot express."""
        for name, cfg in (("docker", self.docker), ("bwrap", self.bwrap)):
            if cfg.pool_size < 0:
                raise ConfigError(f"sandbox.{name}.pool_size must be >= 0, got {cfg.pool_size}")
            if cfg.default_timeout_s <= 0:
                raise ConfigError(f"sandbox.{name}.default_timeout_s must be > 0")


_lock = threading.Lock()
_config: SandboxConfig | None = None
_pools: dict[Backend, object] = {}


def configure(config: SandboxConfig) -> None:
    """Set the process-wide sandbox config; pools of a previous config are shut down."""
    global _config
    config.validate()
    shutdown()
    with _lock:
        _config = config


def get_pool(backend: Backend | str | None = None):  # noqa: ANN201 - WarmPool, imported lazily
    """The warm pool of `backend` (default: the configured one), started on first use."""
    global _config
    with _lock:
        if _config is None:
            _config = SandboxConfig()
        config = _config
        name = Backend(backend) if backend is not None else config.backend
        pool = _pools.get(name)
        if pool is None:
            pool = _make_pool(name, config)
            if not _pools:
                atexit.register(shutdown)
            _pools[name] = pool
        return pool


def _make_pool(name: Backend, config: SandboxConfig):  # noqa: ANN202
    if name is Backend.DOCKER:
        backend = DockerBackend(config=config.docker)
        if config.run_id:
            backend.run_id = config.run_id
        return backend.make_pool()
    return BwrapBackend(config=config.bwrap, isolated=name is Backend.BWRAP).make_pool()


@contextlib.contextmanager
def open_episode(backend: Backend | str | None = None) -> Iterator[Sandbox]:
    """One episode's sandbox from the configured backend's warm pool; closed on exit."""
    from tir_rl.sandbox.pool import EpisodeSandbox

    sandbox = EpisodeSandbox(get_pool(backend))
    try:
        yield sandbox
    finally:
        sandbox.close()


def shutdown() -> None:
    """Kill every sandbox of this process (runs at exit; safe to call twice)."""
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()  # type: ignore[attr-defined]
