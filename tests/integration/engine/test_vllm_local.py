"""Real vLLM (CPU) on a tiny random Llama: one engine for the whole module."""

import asyncio
import os
from pathlib import Path

import pytest
import torch

from tir_rl.engine import FinishReason, GenerateRequest, VLLMLocalEngine
from tir_rl.engine.parity import probe_parity, transformers_logprobs
from tir_rl.engine.weights.transfer import WeightTransfer
from tir_rl.errors import ConfigError, EngineError, ParityError

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 256
PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]
ENGINE_CORE = min(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    config = VLLMLocalEngine.Config(
        model_path=str(tiny_model_path),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=0.0625,
        enable_prefix_caching=True,
        max_num_seqs=32,
        cpu_cores=str(ENGINE_CORE),
    )
    with VLLMLocalEngine(config) as engine:
        yield engine


def run(coro):
    return asyncio.run(coro)


def request(**kwargs):
    return GenerateRequest(**{"prompt_token_ids": PROMPT, "max_tokens": 16, "seed": 7, **kwargs})


def test_sampled_ids_and_logprobs_match_transformers_fp32_recompute(engine, hf_model):
    result = run(engine.generate(request(max_tokens=24, temperature=0.7)))
    assert len(result.token_ids) == len(result.logprobs) > 0
    assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    full = PROMPT + result.token_ids
    recomputed = transformers_logprobs(hf_model, full, temperature=0.7)[len(PROMPT) - 1 :]
    sampled = torch.tensor(result.logprobs)
    assert recomputed.shape == sampled.shape
    assert (recomputed - sampled).abs().max().item() < 1e-3


def test_logprobs_are_processed_not_raw(engine, hf_model):
    result = run(engine.generate(request(max_tokens=8, temperature=0.5)))
    full = PROMPT + result.token_ids
    raw = transformers_logprobs(hf_model, full, temperature=1.0)[len(PROMPT) - 1 :]
    assert (raw - torch.tensor(result.logprobs)).abs().max().item() > 1e-2


def test_concurrent_requests_all_complete_and_match_solo_runs(engine):
    async def many():
        return await asyncio.gather(*(engine.generate(request(seed=s)) for s in range(16)))

    results = run(many())
    assert all(0 < len(r.token_ids) <= 16 for r in results)
    solo = run(engine.generate(request(seed=5)))
    assert results[5].token_ids == solo.token_ids
    assert len({tuple(r.token_ids) for r in results}) > 1


def test_same_seed_reproduces_and_other_seed_differs(engine):
    a = run(engine.generate(request(seed=11)))
    b = run(engine.generate(request(seed=11)))
    c = run(engine.generate(request(seed=12)))
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert a.token_ids != c.token_ids


def test_too_long_prompt_fails_only_that_request(engine):
    async def mixed():
        too_long = GenerateRequest(prompt_token_ids=[5] * (MAX_MODEL_LEN + 10), max_tokens=4)
        return await asyncio.gather(
            engine.generate(request(seed=1)),
            engine.generate(too_long),
            engine.generate(request(seed=2)),
            return_exceptions=True,
        )

    ok1, bad, ok2 = run(mixed())
    assert isinstance(bad, EngineError)
    assert "maximum context length" in str(bad)
    assert len(ok1.token_ids) == len(ok2.token_ids) == 16
    assert len(run(engine.generate(request(seed=3))).token_ids) == 16  # engine still alive


def _first_new_token_index(ids, start):
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_stop_token_id_ends_the_turn_and_is_kept(engine):
    reference = run(engine.generate(request(seed=21)))
    i = _first_new_token_index(reference.token_ids, 3)
    stop_id = reference.token_ids[i]
    result = run(engine.generate(request(seed=21, stop_token_ids=[stop_id])))
    assert result.token_ids == reference.token_ids[: i + 1]
    assert result.finish_reason == FinishReason.STOP
    assert result.stop_sequence == (stop_id,)


def test_multi_token_stop_sequence_is_matched_on_ids(engine):
    reference = run(engine.generate(request(seed=22)))
    seq = reference.token_ids[4:7]
    result = run(engine.generate(request(seed=22, stop_token_sequences=[seq, [99999 % 49152]])))
    assert result.token_ids == reference.token_ids[:7]
    assert result.logprobs == pytest.approx(reference.logprobs[:7], abs=1e-6)
    assert result.finish_reason == FinishReason.STOP
    assert result.stop_sequence == tuple(seq)


def test_non_contiguous_stop_sequence_does_not_stop(engine):
    reference = run(engine.generate(request(seed=23)))
    gapped = [reference.token_ids[4], reference.token_ids[6]]
    if gapped == reference.token_ids[5:7]:
        pytest.skip("sampled tokens happen to repeat")
    result = run(engine.generate(request(seed=23, stop_token_sequences=[gapped])))
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == reference.finish_reason


def test_a_second_turn_reads_the_first_turns_blocks_from_the_prefix_cache(engine):
    assert engine.kv_block_size == 32  # the CPU default with the prefix cache on
    context = [*PROMPT, 11, 12, 13] * 8  # 88 tokens: two whole blocks
    first = run(engine.generate(request(prompt_token_ids=context, max_tokens=24, seed=3)))
    assert first.num_prompt_tokens == 88 and first.num_cached_prompt_tokens == 0
    turn = [*context, *first.token_ids, *PROMPT]
    cached = run(engine.generate(request(prompt_token_ids=turn, seed=4)))
    fresh = run(engine.generate(request(prompt_token_ids=turn, seed=4, read_prefix_cache=False)))
    whole_blocks = (len(context) + len(first.token_ids) - 1) // 32 * 32
    assert cached.num_cached_prompt_tokens >= whole_blocks >= 64
    assert fresh.num_cached_prompt_tokens == 0
    assert fresh.token_ids == cached.token_ids  # float32: the cache changes nothing


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (a thread's `children` lists those that thread started)."""
    children = [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    return [p for child in children for p in (child, *_descendants(child))]


def test_the_engine_computes_on_the_cores_it_was_given(engine):
    run(engine.generate(request()))
    pids = _descendants(os.getpid())
    names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids}
    # The model runs inside the engine-core process (`cpu_platform.worker_in_engine_core`):
    # no worker process of its own ("VLLM::EngineCore" is cut to 15 characters in `comm`).
    assert "VLLM::Worker" not in names.values(), names
    cores = [pid for pid, name in names.items() if name == "VLLM::EngineCor"]
    assert len(cores) == 1, names
    masks = {
        frozenset(os.sched_getaffinity(int(task.name)))
        for task in Path(f"/proc/{cores[0]}/task").iterdir()
    }
    assert masks == {frozenset({ENGINE_CORE})}


def test_a_block_size_the_cpu_attention_cannot_take_is_refused_before_start(tiny_model_path):
    config = VLLMLocalEngine.Config(model_path=str(tiny_model_path), block_size=16)
    with pytest.raises(ConfigError, match="multiples of 32"):
        VLLMLocalEngine(config)


def test_update_weights_changes_outputs_and_parity_follows_the_weights(
    engine, hf_model, probe_ids, perturbed_model
):
    before = run(engine.generate(request(seed=31)))
    assert run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3)).passed

    run(engine.update_weights(perturbed_model.state_dict()))
    try:
        after = run(engine.generate(request(seed=31)))
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
        report = run(probe_parity(engine, perturbed_model, probe_ids, tolerance=1e-3))
        assert report.max_abs_diff < 1e-3 and report.num_tokens == len(probe_ids) - 1
        with pytest.raises(ParityError, match="stale engine weights"):
            run(probe_parity(engine, hf_model, probe_ids, tolerance=1e-3))
    finally:
        run(engine.update_weights(hf_model.state_dict()))
    restored = run(engine.generate(request(seed=31)))
    assert restored.token_ids == before.token_ids


def _tokens_so_far(engine: VLLMLocalEngine) -> int:
    processor = engine._llm.output_processor
    return max((s.detokenizer.num_output_tokens() for s in processor.request_states.values()),
               default=0)  # fmt: skip


def _update_in_flight(engine: VLLMLocalEngine, perturbed_model):
    """A long request; `perturbed_model`'s weights sent once it has 8 tokens; its result."""
    version = engine.policy_version

    async def update_mid_request():
        long = GenerateRequest(prompt_token_ids=PROMPT, max_tokens=MAX_MODEL_LEN - 16)
        task = asyncio.ensure_future(engine.generate(long))
        while _tokens_so_far(engine) < 8:
            await asyncio.sleep(0.005)
        await engine.update_weights(perturbed_model.state_dict(), version=version + 1)
        return await task

    result = run(update_mid_request())
    assert engine.policy_version == version + 1
    versions = result.policy_versions
    switch = versions.index(version + 1)
    assert switch >= 8 and versions == [version] * switch + [version + 1] * (len(versions) - switch)
    assert result.finish_reason is FinishReason.LENGTH  # the request was not cut
    return result, switch


def _sampled_by_which_weights(result, switch, hf_model, perturbed_model):
    """Largest |sampled - recomputed| logprob before the switch (old weights) and after it
    (new weights)."""
    full = PROMPT + result.token_ids
    sampled = torch.tensor(result.logprobs)
    old = transformers_logprobs(hf_model, full)[len(PROMPT) - 1 :]
    new = transformers_logprobs(perturbed_model, full)[len(PROMPT) - 1 :]
    before = (old[:switch] - sampled[:switch]).abs().max().item()
    return before, (new[switch:] - sampled[switch:]).abs().max().item()


# The two cases also cover both ways the weights arrive: a reloaded file (the module's engine:
# the default transfer, KV blocks cleared) and vLLM's transfer protocol (gloo, the CPU twin of
# nccl), each landing while a request is in flight.
def test_an_update_in_flight_keeps_the_request_and_labels_each_token_with_its_weights(
    engine, hf_model, perturbed_model
):
    assert engine.config.clear_kv_on_update and engine.config.weight_transfer is WeightTransfer.FILE
    try:
        result, switch = _update_in_flight(engine, perturbed_model)
    finally:
        run(engine.update_weights(hf_model.state_dict()))
    before, after = _sampled_by_which_weights(result, switch, hf_model, perturbed_model)
    assert before < 1e-3  # sampled by the old weights
    assert after < 1e-3  # the context was recomputed with the new weights: exact


def test_an_update_in_flight_through_gloo_keeping_the_kv_blocks_mixes_the_weights(
    tiny_model_path, hf_model, perturbed_model
):
    config = VLLMLocalEngine.Config(
        model_path=str(tiny_model_path),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=0.0625,
        clear_kv_on_update=False,
        weight_transfer=WeightTransfer.GLOO,
    )
    with VLLMLocalEngine(config) as engine:
        assert engine.policy_version == 0
        result, switch = _update_in_flight(engine, perturbed_model)
    before, after = _sampled_by_which_weights(result, switch, hf_model, perturbed_model)
    assert before < 1e-3  # sampled by the old weights
    assert after > 1e-2  # new queries over the old weights' keys and values: a mismatch of its own
