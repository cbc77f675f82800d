"""`rollout.sampling_from: model`: the sampling a model's card declares, folded in at load."""

from __future__ import annotations

import json
import logging

import pytest

from tir_rl.config import load
from tir_rl.errors import ConfigError
from tir_rl.rollout.card_sampling import CardSampling, SamplingSource, read_card_sampling
from tir_rl.run_config import RunConfig

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1}
"""Qwen3's generation_config.json (its sampling keys as published, ids shortened)."""


def carded_model(tmp_path, card: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "generation_config.json").write_text(json.dumps(card))
    return folder


def config(folder, *sets: str) -> RunConfig:
    return load(RunConfig, None, [f"model={folder}", "rollout.sampling_from=model", *sets])


def test_the_card_s_sampling_is_the_run_s_and_the_trainer_s(tmp_path):
    resolved = config(carded_model(tmp_path, QWEN3))
    rollout = resolved.rollout
    assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.min_p) == (0.6, 0.95, 20, 0)
    assert resolved.trainer.temperature == 0.6  # divides by the card's temperature
    assert rollout.truncation.active  # and replays the card's kept set
    assert rollout.sampling_from is SamplingSource.CONFIG  # the saved config is explicit


def test_config_sampling_leaves_the_card_alone(tmp_path):
    folder = carded_model(tmp_path, QWEN3)
    resolved = load(RunConfig, None, [f"model={folder}"])
    assert (resolved.rollout.temperature, resolved.rollout.top_k) == (1.0, None)


def test_a_setting_given_beside_the_card_is_refused_unless_it_agrees(tmp_path):
    folder = carded_model(tmp_path, QWEN3)
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.8 .* card says top_p 0.95"):
        config(folder, "rollout.top_p=0.8")
    assert config(folder, "rollout.top_k=20").rollout.top_k == 20
    assert config(folder, "rollout.min_p=0.05").rollout.min_p == 0.05  # the card is silent


def test_penalties_the_trainer_cannot_replay_are_named_and_not_applied(tmp_path, caplog):
    card = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    sampling = read_card_sampling(carded_model(tmp_path, card))
    assert sampling == CardSampling(0.7, 0.8, 20, None, ("repetition_penalty=1.05",))
    with caplog.at_level(logging.WARNING):
        config(tmp_path / "model")
    assert "repetition_penalty=1.05" in caplog.text


@pytest.mark.parametrize(
    ("card", "why"),
    [
        ({"do_sample": False, "temperature": 0.6}, "greedy"),
        ({"bos_token_id": 1, "eos_token_id": 2}, "declares no temperature"),
    ],
)
def test_a_card_without_sampling_to_train_with_is_refused(tmp_path, card, why):
    with pytest.raises(ConfigError, match=why):
        config(carded_model(tmp_path, card))


def test_a_model_without_a_generation_config_is_refused(tmp_path):
    folder = carded_model(tmp_path, {})
    (folder / "generation_config.json").unlink()
    with pytest.raises(ConfigError, match="does not exist"):
        config(folder)


def test_a_top_k_of_zero_is_off_as_in_transformers(tmp_path):
    card = carded_model(tmp_path, {"temperature": 0.8, "top_k": 0})
    assert read_card_sampling(card).top_k is None
