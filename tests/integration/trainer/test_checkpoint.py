"""Checkpoint and resume: the next step after a resume is the step that would have run."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from trainer_helpers import make_batch

from tir_rl.errors import ConfigError
from tir_rl.mismatch.guard import CollapseGuard
from tir_rl.trainer import checkpoint


def test_resume_reproduces_the_next_step_exactly(make_trainer, tmp_path):
    batch = make_batch()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    first = make_trainer(lr=1e-2)
    guard = CollapseGuard()
    first.train_step(batch, adv, guard=guard)
    saved_params = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    path = checkpoint.save(
        tmp_path / "step_1", first, data_position={"epoch": 0, "index": 7}, guard=guard
    )
    draws = (random.random(), np.random.rand(), torch.rand(3))
    expected = first.train_step(batch, adv)
    expected_params = {n: p.detach().clone() for n, p in first.model.named_parameters()}

    second = make_trainer(lr=1e-2, seed=99)
    resumed = checkpoint.load(path, second, guard=CollapseGuard())
    assert resumed.step == 1 and second.step == 1
    assert resumed.data_position == {"epoch": 0, "index": 7}
    assert resumed.trainer_config["lr"] == 1e-2
    assert (random.random(), np.random.rand()) == draws[:2]
    assert torch.equal(torch.rand(3), draws[2])
    for name, p in second.model.named_parameters():
        assert torch.equal(p, saved_params[name]), name

    got = second.train_step(batch, adv)
    assert got.loss == expected.loss
    assert got.grad_norm == expected.grad_norm
    for name, p in second.model.named_parameters():
        assert torch.equal(p, expected_params[name]), name


def test_saved_model_is_a_plain_hf_checkpoint(make_trainer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = make_trainer(lr=1e-2)
    batch = make_batch()
    trainer.train_step(batch, torch.ones(batch.num_sequences))
    path = checkpoint.save(tmp_path / "ckpt", trainer)
    model_dir = path / checkpoint.MODEL_DIR
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = loaded.state_dict()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(state[name], p.detach().cpu()), name
    assert AutoTokenizer.from_pretrained(model_dir).eos_token is not None
    assert not (tmp_path / ".ckpt.tmp").exists()


def test_loading_something_else_is_a_config_error(make_trainer, tmp_path):
    with pytest.raises(ConfigError, match="not a tir-rl checkpoint"):
        checkpoint.load(tmp_path, make_trainer())
