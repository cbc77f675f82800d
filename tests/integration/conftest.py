"""Fixtures shared by the integration suites: a real `vllm serve` on loopback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tir_rl.distributed import free_port

SERVER_START_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def vllm_serve(tmp_path_factory):
    """Start `vllm serve` for a local engine config: `with vllm_serve(config) as url: ...`.

    The server runs with `VLLM_SERVER_DEV_MODE=1` (weight reloads over HTTP); on exit it is
    stopped together with its engine processes, and the exit fails the test if any of them
    outlived the stop.
    """
    import httpx
    import psutil

    from tir_rl.engine.vllm_http import serve_command

    @contextlib.contextmanager
    def start(config, *, served_model_name: str | None = None) -> Iterator[str]:
        port = free_port()
        cmd = serve_command(
            config, port=port, served_model_name=served_model_name, python=sys.executable
        )
        log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        children: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while time.monotonic() < deadline:
                assert proc.poll() is None, f"vllm serve exited; see {log.name}"
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            else:
                pytest.fail(f"vllm serve did not become healthy; see {log.name}")
            children = psutil.Process(proc.pid).children(recursive=True)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            _gone, alive = psutil.wait_procs(children, timeout=30)
            for child in alive:
                child.kill()
            assert not alive, f"vllm serve left {[c.pid for c in alive]} running; killed them"

    return start
