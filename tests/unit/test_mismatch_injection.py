"""MismatchInjection: weight transforms, stale syncs, engine overrides, config checks."""

from __future__ import annotations

import logging

import pytest
import torch

from tir_rl import config
from tir_rl.engine.vllm_local import VLLMLocalEngine
from tir_rl.errors import ConfigError
from tir_rl.mismatch.injection import (
    EMBED_KEY,
    FINAL_NORM_KEY,
    LM_HEAD_KEY,
    MismatchInjection,
    output_projection_keys,
)
from tir_rl.run_config import RunConfig


def llama_state_dict(*, tied: bool) -> dict[str, torch.Tensor]:
    """The state dict of a real (tiny, in-memory) transformers Llama, as the trainer sends it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    return {k: v.detach() for k, v in model.state_dict().items()}


def inject(**kwargs) -> MismatchInjection:
    return MismatchInjection(MismatchInjection.Config(**kwargs))


def changed_keys(before: dict, after: dict) -> set[str]:
    assert set(before) == set(after)
    return {k for k in before if not torch.equal(before[k], after[k])}


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


# ---------------------------------------------------------------------- lm_head rounding


def test_tied_model_rounds_the_embedding_vllm_loads_and_nothing_else():
    state = llama_state_dict(tied=True)
    assert state[LM_HEAD_KEY].data_ptr() == state[EMBED_KEY].data_ptr()  # HF keeps both keys
    original = snapshot(state)
    out = inject(lm_head_dtype="bfloat16").sampler_state(state, 1)
    assert changed_keys(original, out) == {EMBED_KEY, LM_HEAD_KEY}
    assert torch.equal(out[EMBED_KEY], out[LM_HEAD_KEY])
    assert torch.equal(out[EMBED_KEY], original[EMBED_KEY].bfloat16().float())
    assert out[EMBED_KEY].dtype == torch.float32
    assert changed_keys(original, state) == set()  # the trainer's tensors are untouched


def test_untied_model_rounds_only_the_lm_head():
    state = llama_state_dict(tied=False)
    original = snapshot(state)
    out = inject(lm_head_dtype="float16").sampler_state(state, 1)
    assert changed_keys(original, out) == {LM_HEAD_KEY}
    assert torch.equal(out[LM_HEAD_KEY], original[LM_HEAD_KEY].half().float())


def test_rounding_error_has_the_size_of_the_dtype_resolution():
    head = llama_state_dict(tied=True)[EMBED_KEY]
    for dtype, bits in (("bfloat16", 8), ("float16", 11)):
        out = inject(lm_head_dtype=dtype).sampler_state({EMBED_KEY: head}, 0)[EMBED_KEY]
        normal = head.abs() > 1e-3  # float16 is subnormal below 6e-5
        rel = ((out - head).abs() / head.abs())[normal].max().item()
        assert 0 < rel <= 2.0**-bits


def test_tied_detection_by_values_when_storage_is_not_shared():
    state = llama_state_dict(tied=True)
    state[LM_HEAD_KEY] = state[LM_HEAD_KEY].clone()  # e.g. gathered from FSDP shards
    assert output_projection_keys(state) == [EMBED_KEY, LM_HEAD_KEY]
    del state[LM_HEAD_KEY]
    assert output_projection_keys(state) == [EMBED_KEY]


def test_missing_weight_names_the_key():
    with pytest.raises(ConfigError, match="model.embed_tokens.weight"):
        inject(lm_head_dtype="bfloat16").sampler_state({"x": torch.ones(2)}, 1)
    with pytest.raises(ConfigError, match="model.norm.weight"):
        inject(logit_noise_std=0.1).sampler_state({"x": torch.ones(2)}, 1)


# ---------------------------------------------------------------------- logit noise


def test_noise_moves_only_the_final_norm_gain_by_the_seeded_factor():
    state = llama_state_dict(tied=True)
    original = snapshot(state)
    out = inject(logit_noise_std=0.05, noise_seed=3).sampler_state(state, 1)
    assert changed_keys(original, out) == {FINAL_NORM_KEY}
    eps = torch.randn(original[FINAL_NORM_KEY].shape, generator=torch.Generator().manual_seed(3))
    expected = original[FINAL_NORM_KEY] * (1 + 0.05 * eps)
    torch.testing.assert_close(out[FINAL_NORM_KEY], expected, rtol=0, atol=1e-7)
    assert changed_keys(original, state) == set()


def test_noise_is_deterministic_per_seed_and_fixed_across_syncs():
    state = llama_state_dict(tied=True)
    a = inject(logit_noise_std=0.03, noise_seed=1)
    first = a.sampler_state(state, 1)[FINAL_NORM_KEY]
    assert torch.equal(a.sampler_state(state, 2)[FINAL_NORM_KEY], first)
    same_seed = inject(logit_noise_std=0.03, noise_seed=1).sampler_state(state, 5)
    other_seed = inject(logit_noise_std=0.03, noise_seed=2).sampler_state(state, 1)
    assert torch.equal(same_seed[FINAL_NORM_KEY], first)
    assert not torch.equal(other_seed[FINAL_NORM_KEY], first)


def test_zero_noise_and_default_config_send_the_trainer_weights_unchanged():
    state = llama_state_dict(tied=True)
    for injection in (inject(logit_noise_std=0.0, noise_seed=9), MismatchInjection()):
        out = injection.sampler_state(state, 1)
        assert out is not None and out.keys() == state.keys()
        assert all(out[k] is state[k] for k in state)
        assert not injection.transforms_weights and injection.strict_parity


def test_noise_scales_linearly_with_std():
    injection_small, injection_big = inject(logit_noise_std=0.01), inject(logit_noise_std=0.1)
    torch.testing.assert_close(injection_big.noise((64,)), 10 * injection_small.noise((64,)))
    assert 0.05 < injection_big.noise((4096,)).std().item() < 0.15


# ---------------------------------------------------------------------- stale syncs


def test_sync_every_skips_all_but_every_kth_optimizer_step():
    state = {FINAL_NORM_KEY: torch.ones(3)}
    injection = inject(sync_every=3)
    synced = [s for s in range(10) if injection.sampler_state(state, s) is not None]
    assert synced == [0, 3, 6, 9]
    assert injection.sampler_state(state, 4, force=True) is not None  # engine start / resume
    assert all(inject(sync_every=1).sampler_state(state, s) is not None for s in range(5))
    assert not injection.transforms_weights and not injection.strict_parity


def test_negative_step_is_refused():
    with pytest.raises(ConfigError, match="optimizer_step"):
        MismatchInjection().sampler_state({}, -1)


# ---------------------------------------------------------------------- engine config


def test_engine_overrides_dtype_and_logprobs_mode_idempotently():
    engine = VLLMLocalEngine.Config(model_path="tiny")
    injection = inject(sampler_dtype="bfloat16", raw_logprobs=True)
    out = injection.apply_to_engine_config(engine)
    assert (out.dtype, out.logprobs_mode, out.allow_other_logprobs_mode) == (
        "bfloat16",
        "raw_logprobs",
        True,
    )
    out.validate()
    assert injection.apply_to_engine_config(out) == out
    assert engine.dtype == "float32"  # the input config is not modified
    assert MismatchInjection().apply_to_engine_config(engine) is engine


def test_flags_and_description_follow_the_config():
    assert "none" in MismatchInjection().describe()
    injection = inject(lm_head_dtype="bfloat16", logit_noise_std=0.1, sync_every=2)
    assert injection.transforms_weights and not injection.strict_parity
    text = injection.describe()
    assert "bfloat16" in text and "0.1" in text and "every 2" in text
    assert not inject(raw_logprobs=True).transforms_weights
    assert not inject(sampler_dtype="float16").strict_parity
    assert injection.changes_sampling and inject(sync_every=3).changes_sampling
    assert not inject(raw_logprobs=True).changes_sampling
    assert not inject(sampler_dtype="float16").changes_sampling


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"logit_noise_std": -0.1}, "logit_noise_std"),
        ({"logit_noise_std": float("nan")}, "logit_noise_std"),
        ({"sampler_dtype": "float32"}, "sampler_dtype"),
        ({"lm_head_dtype": "fp8"}, "lm_head_dtype"),
    ],
)
def test_invalid_config_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        inject(**kwargs)


# ---------------------------------------------------------------------- RunConfig section


def test_run_config_applies_engine_overrides():
    cfg = config.load(
        RunConfig,
        overrides=[
            "inject.sampler_dtype=bfloat16",
            "inject.raw_logprobs=true",
            "rollout.temperature=0.7",
            "trainer.temperature=0.7",
        ],
    )
    assert cfg.engine.dtype == "bfloat16"
    assert cfg.engine.logprobs_mode == "raw_logprobs" and cfg.engine.allow_other_logprobs_mode
    assert cfg.trainer.dtype == "float32"
    reloaded = config.from_dict(RunConfig, config.to_dict(cfg))  # saved config round-trips
    assert reloaded.engine == cfg.engine and reloaded.inject == cfg.inject


def test_run_config_default_leaves_the_engine_alone():
    cfg = config.load(RunConfig)
    assert not cfg.inject.active
    assert cfg.engine.dtype == "float32" and cfg.engine.logprobs_mode == "processed_logprobs"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["inject.sync_every=0"], "sync_every"),
        (["inject.lm_head_dtype=float32"], "lm_head_dtype"),
        (["inject.sampler_dtype=bfloat16", "trainer.dtype=bfloat16"], "trainer.dtype"),
        (["inject.noise_std=0.1"], "logit_noise_std"),
        (["inject.sampler_dtype=bfloat16", "run.eval_clean_sampler=true"], "tir-rl eval"),
    ],
)
def test_run_config_refuses_bad_injection(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(RunConfig, overrides=overrides)


def test_raw_logprobs_at_temperature_one_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="tir_rl.run_config"):
        config.load(RunConfig, overrides=["inject.raw_logprobs=true"])
    assert "no effect at rollout.temperature=1" in caplog.text
