"""Fixtures of the trainer tests."""

from __future__ import annotations

import pytest
import torch

from tir_rl.models import TinyModelSpec, prepare_tiny_model
from tir_rl.trainer import Trainer


@pytest.fixture(scope="session")
def tiny_model_path():
    return prepare_tiny_model(TinyModelSpec())


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
"""Every trainer test runs on each available device: the same suite must pass on both."""


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def make_trainer(tiny_model_path, device):
    def build(**overrides) -> Trainer:
        defaults = {"model": str(tiny_model_path), "lr": 1e-3, "device": device}
        config = Trainer.Config(**{**defaults, **overrides})
        return Trainer(config)

    return build
