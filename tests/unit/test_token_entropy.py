"""token_entropy: the trainer's per-token entropy from its (temperature-scaled) logits."""

import math

import pytest
import torch

from tir_rl.trainer.token_stats import token_entropy

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_logits_give_log_vocab_size(device):
    for vocab in (2, 49152):
        logits = torch.full((3, vocab), 7.5, device=device)
        expected = torch.full((3,), math.log(vocab), device=device)
        torch.testing.assert_close(token_entropy(logits), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_the_categorical_entropy_in_any_chunking(device):
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(10, 300, generator=gen)).to(device)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    for chunk_rows in (1, 3, 1024):
        torch.testing.assert_close(token_entropy(logits, chunk_rows=chunk_rows), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_logits_have_zero_entropy_and_no_grad_flows(device):
    logits = torch.tensor([[0.0, -1e4, -1e4], [-1e4, -1e4, 0.0]], device=device, requires_grad=True)
    entropy = token_entropy(logits)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, torch.zeros(2, device=device))
