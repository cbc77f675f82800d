"""The trained lab model shipped with the package (`model: lab-sft`, docs/lab_model.md)."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from tir_rl.envs.multihop import MultiHopEnv
from tir_rl.errors import ModelError
from tir_rl.lab.sft import play_demonstration
from tir_rl.models import LAB_SFT_MODEL_NAME, lab_sft_model, resolve_model


def test_the_shipped_model_resolves_by_name_and_renders_multihop_exactly():
    folder = resolve_model(LAB_SFT_MODEL_NAME)
    assert (folder / "config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    env = MultiHopEnv(horizon=3, split="test")
    demo = play_demonstration(env, tokenizer, seed=2)
    text = tokenizer.decode(demo.token_ids)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == demo.token_ids
    for name in env.reset(seed=2)[1]["task"].data["path"]:  # each name is one token
        assert len(tokenizer(name, add_special_tokens=False)["input_ids"]) == 1, name


def test_a_changed_or_missing_weights_file_is_refused(tmp_path):
    copy = tmp_path / "lab_sft"
    shutil.copytree(lab_sft_model(), copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="not the shipped"):
        lab_sft_model(copy)
    weights.unlink()
    with pytest.raises(ModelError, match="missing"):
        lab_sft_model(copy)
