"""The run's secret and what checks it: the secret file, the middleware, verified reloads."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tir_rl.engine.in_vllm.server_guard import WEIGHTS_DIGEST_HEADER, ServerGuard
from tir_rl.engine.weights.files import check_weights_root, publish_state_dict
from tir_rl.errors import ConfigError
from tir_rl.process.run_secret import SECRET_FILE_ENV, RunSecret, RunSecretMiddleware


def test_a_secret_file_is_owner_only_and_refused_when_open_to_others(tmp_path):
    secret = RunSecret.generate()
    path = secret.write(tmp_path / "run" / "secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert RunSecret.read(path) == secret and secret.value not in repr(secret)
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        RunSecret.read(path)
    with pytest.raises(ConfigError, match="cannot read"):
        RunSecret.read(tmp_path / "missing")
    assert secret.admits(f"Bearer {secret.value}") and secret.admits(f"bearer {secret.value}")
    assert not secret.admits(None) and not secret.admits(secret.value)
    assert not secret.admits(f"Bearer {secret.value}x") and not secret.admits("Basic x")


def _app() -> tuple[Starlette, list[dict]]:
    """A stand-in for vLLM's app: it records each call that reaches it."""
    reached: list[dict] = []

    async def rpc(request):
        reached.append(json.loads(await request.body()))
        return JSONResponse({"results": [None]})

    async def health(request):
        reached.append({"health": True})
        return JSONResponse({})

    routes = [Route("/collective_rpc", rpc, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes), reached


def test_the_middleware_admits_only_the_secret_on_every_route():
    app, reached = _app()
    secret = RunSecret.generate()
    client = TestClient(RunSecretMiddleware(app, secret))
    call = {"method": "check_health"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": secret.value}):
        assert client.get("/health", headers=headers).status_code == 401
        assert client.post("/collective_rpc", json=call, headers=headers).status_code == 401
    assert reached == []
    key = {"Authorization": secret.authorization}
    assert client.post("/collective_rpc", json=call, headers=key).status_code == 200
    assert reached == [call]


def test_the_server_guard_fails_closed_without_the_run_s_secret(tmp_path, monkeypatch):
    app, _ = _app()
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with pytest.raises(ConfigError, match=SECRET_FILE_ENV):
        ServerGuard(app)
    open_file = tmp_path / "open"
    open_file.write_text("s3cret\n")
    open_file.chmod(0o644)
    monkeypatch.setenv(SECRET_FILE_ENV, str(open_file))
    with pytest.raises(ConfigError, match="other users"):
        ServerGuard(app)


def test_a_reload_loads_only_the_published_bytes(tmp_path, monkeypatch):
    app, reached = _app()
    secret = RunSecret.generate()
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret.write(tmp_path / "secret")))
    client = TestClient(ServerGuard(app))
    key = {"Authorization": secret.authorization}
    published = publish_state_dict({"w": torch.ones(4)}, tmp_path / "weights", version=1)
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(published.folder)}}
    # Without the secret, the digest is not even looked at.
    assert client.post("/collective_rpc", json=reload).status_code == 401
    # With it: no digest, then a wrong one, are refused before the app sees the call.
    assert client.post("/collective_rpc", json=reload, headers=key).status_code == 409
    wrong = {**key, WEIGHTS_DIGEST_HEADER: "0" * 64}
    assert client.post("/collective_rpc", json=reload, headers=wrong).status_code == 409
    assert reached == []
    signed = {**key, WEIGHTS_DIGEST_HEADER: published.sha256}
    assert client.post("/collective_rpc", json=reload, headers=signed).status_code == 200
    assert reached == [reload]  # the body reached vLLM whole
    # The file changed after publication (same size, one byte): refused, nothing loaded.
    weights = published.folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    tampered = client.post("/collective_rpc", json=reload, headers=signed)
    assert tampered.status_code == 409 and "not the ones the trainer published" in tampered.text
    # A file added beside it is caught too; other methods pass untouched.
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (published.folder / "extra.safetensors").write_bytes(b"x")
    assert client.post("/collective_rpc", json=reload, headers=signed).status_code == 409
    other = {"method": "check_health"}
    assert client.post("/collective_rpc", json=other, headers=key).status_code == 200
    assert reached == [reload, other]


def test_a_weights_folder_others_can_write_is_refused(tmp_path):
    mine = tmp_path / "w"
    check_weights_root(mine)
    assert not stat.S_IMODE(mine.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="chmod go-w"):
        publish_state_dict({"w": torch.ones(1)}, shared, version=1)


def test_a_client_reads_its_key_from_the_file_it_names(tmp_path, monkeypatch):
    from tir_rl.engine.server_connection import ServerConnection, authorization_headers

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = RunSecret.generate()
    secret.write(tmp_path / ".tir-rl" / "run.secret")
    address = ServerConnection(base_url="http://h:1", api_key_file="~/.tir-rl/run.secret")
    assert authorization_headers(address) == {"Authorization": secret.authorization}
    assert authorization_headers(ServerConnection(base_url="http://h:1")) == {}
    (tmp_path / ".tir-rl" / "run.secret").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        authorization_headers(address)
