"""Fixtures shared by the integration suites: a real `vllm serve` on loopback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest

from tir_rl.distributed import free_port


@pytest.fixture(scope="session")
def vllm_serve(tmp_path_factory):
    """Start `vllm serve` for a local engine config: `with vllm_serve(config) as url: ...`.

    The server is `tir-rl launch`'s (`running_servers`: `VLLM_SERVER_DEV_MODE=1`, its own
    process group, stopped on exit); the exit also fails the test if any of its processes
    outlived the stop.
    """
    import psutil

    from tir_rl.engine.vllm_http import serve_command
    from tir_rl.launch import ServerPlan, running_servers

    @contextlib.contextmanager
    def start(config, *, served_model_name: str | None = None) -> Iterator[str]:
        port = free_port()
        plan = ServerPlan(
            url=f"http://127.0.0.1:{port}",
            command=serve_command(
                config, port=port, served_model_name=served_model_name, python=sys.executable
            ),
            log=tmp_path_factory.mktemp("server") / "server.log",
        )
        processes: list[psutil.Process] = []
        with running_servers([plan]) as (server,):
            processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children(True)]
            yield plan.url
        _gone, alive = psutil.wait_procs(processes, timeout=30)
        for process in alive:
            process.kill()
        assert not alive, f"vllm serve left {[p.pid for p in alive]} running; killed them"

    return start
