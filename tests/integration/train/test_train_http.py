"""Training against a real `vllm serve` through `engine.kind: http` (tiny model, CPU)."""

import asyncio
import shutil

import pytest
import torch
from test_train_tiny import tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from tir_rl.engine.parity import probe_ids_from_text, transformers_logprobs
from tir_rl.engine.reaping import engine_processes, owner_id
from tir_rl.engine.vllm_http import VLLMHttpEngine
from tir_rl.engine.vllm_local import VLLMLocalEngine
from tir_rl.errors import EngineError
from tir_rl.evaluate import resolve_checkpoint
from tir_rl.models import prepare_tiny_model
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.rl_loop import latest_checkpoint, run_train
from tir_rl.runtime import open_runtime

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(vllm_serve):
    config = VLLMLocalEngine.Config(
        model_path=str(prepare_tiny_model()), max_model_len=2048, kv_cache_gib=0.25
    )
    with vllm_serve(config) as served:
        yield served


def http_engine(served, weights_dir):
    return (
        "engine.kind=http",
        f"engine.http.base_url={served.url}",
        f"engine.http.api_key_file={served.api_key_file}",
        f"engine.weights_dir={weights_dir}",
    )


def served_logprobs(served, ids):
    config = VLLMHttpEngine.Config(base_url=served.url, api_key_file=served.api_key_file)
    with VLLMHttpEngine(config) as engine:
        return torch.tensor(asyncio.run(engine.prompt_logprobs(ids)))


@pytest.fixture(scope="module")
def probe():
    return probe_ids_from_text(AutoTokenizer.from_pretrained(prepare_tiny_model()))


def test_two_steps_train_through_the_server_and_leave_it_the_trained_weights(
    server, probe, tmp_path
):
    config = tiny_config(
        tmp_path / "runs",
        "run.eval_tasks=1",
        "run.max_staleness=1",  # asynchronous: updates land between the server's requests
        "correction_preset=token_tis",  # geo_rs_token_tis would reject the stale sequences
        "run.save_trajectories=8",
        engine=http_engine(server, tmp_path / "weights"),
    )
    # e.g. the multiprocessing resource tracker an earlier local engine of this process started
    already = {p.pid for p in engine_processes(owner=owner_id())}
    summary = run_train(config)

    assert summary.steps_done == 2
    rows = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/skipped"] == 0.0 for r in rows)
    assert all(r["sync/parity_max_abs_diff"] < 1e-3 for r in rows)
    assert all(r["staleness/lag_max"] <= 1 for r in rows)
    for saved in load_trajectories(summary.run_dir / "trajectories.jsonl"):
        t = saved.trajectory
        turns: dict[int, set[int]] = {}
        for turn, version, mask in zip(t.turn_ids, t.policy_versions, t.loss_mask, strict=True):
            if mask:
                turns.setdefault(turn, set()).add(version)
        assert all(len(v) == 1 for v in turns.values()), "one version per request over HTTP"
    started = [p for p in engine_processes(owner=owner_id()) if p.pid not in already]
    assert started == [], "an HTTP run starts no local engine"

    trained = AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint(str(latest_checkpoint(summary.run_dir))), dtype="float32"
    )
    initial = AutoModelForCausalLM.from_pretrained(prepare_tiny_model(), dtype="float32")
    served = served_logprobs(server, probe)
    assert (served - transformers_logprobs(trained, probe)).abs().max().item() < 1e-3
    assert (served - transformers_logprobs(initial, probe)).abs().max().item() > 1e-2


def test_a_run_puts_a_server_back_on_the_run_model_weights(server, probe, tmp_path):
    initial = AutoModelForCausalLM.from_pretrained(prepare_tiny_model(), dtype="float32")
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in initial.state_dict().items()}
    config = VLLMHttpEngine.Config(
        base_url=server.url,
        api_key_file=server.api_key_file,
        weights_dir=str(tmp_path / "other"),
    )
    with VLLMHttpEngine(config) as engine:
        asyncio.run(engine.update_weights(other))
    expected = transformers_logprobs(initial, probe)
    assert (served_logprobs(server, probe) - expected).abs().max().item() > 1e-2

    run = tiny_config(tmp_path, engine=http_engine(server, tmp_path / "weights"))
    with open_runtime(run):
        assert (served_logprobs(server, probe) - expected).abs().max().item() < 1e-3


def test_a_server_of_another_checkpoint_is_refused(server, tmp_path):
    copy = shutil.copytree(prepare_tiny_model(), tmp_path / "same-weights-other-path")
    run = tiny_config(tmp_path, f"model={copy}", engine=http_engine(server, tmp_path / "w"))
    with pytest.raises(EngineError, match="the sampler and the trainer must be the same network"):
        with open_runtime(run):
            pass
