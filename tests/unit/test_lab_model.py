"""The lab model's initialisation copies from context before any training."""

from __future__ import annotations

import pytest
import torch

from tir_rl.errors import ConfigError
from tir_rl.lab_model import FROZEN_PARAMETERS, LabModelSpec, build_lab_model, copy_accuracy

VOCAB = 49152  # the bundled tokenizer's size: codes must stay distinct at this scale


def build(**changes):
    return build_lab_model(
        LabModelSpec(**changes), vocab_size=VOCAB, bos_token_id=1, eos_token_id=2
    ).eval()


@pytest.fixture(scope="module")
def model():
    return build()


@pytest.mark.parametrize(("context", "floor"), [(96, 0.99), (600, 0.95)])
def test_the_circuit_copies_a_span_seen_once_before_training(model, context, floor):
    # Measured 1.00 and 0.97: over 600 random tokens a few codes of the 49K collide.
    assert copy_accuracy(model, context=context, span=12) >= floor


def test_without_the_previous_token_head_nothing_is_copied():
    broken = build(previous_code_gain=0.0)
    assert copy_accuracy(broken, context=96, span=12) < 0.05


def test_the_same_seed_builds_the_same_weights_and_another_seed_does_not(model):
    again, other = build(), build(seed=1)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_frozen_parameters_name_the_codes(model):
    names = dict(model.named_parameters())
    assert set(FROZEN_PARAMETERS) <= set(names)
    assert names["lm_head.weight"].data_ptr() != names["model.embed_tokens.weight"].data_ptr()


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"hidden_size": 200}, "multiple of 64"), ({"num_layers": 1}, "at least 2"),
     ({"induction_pairs": 30}, "rotary pairs")],
)
def test_a_shape_the_circuit_cannot_fit_is_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        LabModelSpec(**changes).validate()
