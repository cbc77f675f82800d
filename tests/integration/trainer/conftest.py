"""Fixtures of the trainer tests."""

from __future__ import annotations

import pytest

from tir_rl.models import TinyModelSpec, prepare_tiny_model
from tir_rl.trainer import Trainer


@pytest.fixture(scope="session")
def tiny_model_path():
    return prepare_tiny_model(TinyModelSpec())


@pytest.fixture
def make_trainer(tiny_model_path):
    def build(**overrides) -> Trainer:
        config = Trainer.Config(model=str(tiny_model_path), **{"lr": 1e-3, **overrides})
        return Trainer(config)

    return build
