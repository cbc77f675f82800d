"""Fixtures shared by the integration suites: a real `vllm serve` on loopback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tir_rl.distributed import free_port


@dataclass(frozen=True)
class Served:
    """A running test server: where it is and the file of the secret it asks for."""

    url: str
    api_key_file: str
    pid: int
    """The API server's process (its engine core is a child)."""


@pytest.fixture(scope="session")
def vllm_serve(tmp_path_factory):
    """Start `vllm serve` for a local engine config: `with vllm_serve(config) as served: ...`.

    The server is `tir-rl launch`'s (`running_servers`: `VLLM_SERVER_DEV_MODE=1`, the run's
    secret asked on every route, its own process group, stopped on exit); `served` is a
    `Served` (its URL and the secret's file). The exit also fails the test if any of the
    server's processes outlived the stop.
    """
    import psutil

    from tir_rl.engine.vllm_http import serve_command
    from tir_rl.launch import ServerPlan, new_run_secret, running_servers

    @contextlib.contextmanager
    def start(config, *, served_model_name: str | None = None) -> Iterator[Served]:
        port = free_port()
        secret_file = new_run_secret(tmp_path_factory.mktemp("secret"))
        plan = ServerPlan(
            url=f"http://127.0.0.1:{port}",
            command=serve_command(
                config, port=port, served_model_name=served_model_name, python=sys.executable
            ),
            log=tmp_path_factory.mktemp("server") / "server.log",
        )
        processes: list[psutil.Process] = []
        with running_servers([plan], secret_file) as (server,):
            processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children(True)]
            yield Served(plan.url, str(secret_file), server.pid)
        _gone, alive = psutil.wait_procs(processes, timeout=30)
        for process in alive:
            process.kill()
        assert not alive, f"vllm serve left {[p.pid for p in alive]} running; killed them"

    return start
