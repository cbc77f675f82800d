"""chunked_token_logprobs: log-softmax at the targets without a float32 [n, V] tensor."""

import pytest
import torch

from tir_rl.trainer.token_stats import chunked_token_logprobs, token_stats

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _reference(logits, targets, temperature):
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_log_softmax_in_any_chunking(device, temperature):
    gen = torch.Generator().manual_seed(0)
    base = 3 * torch.randn(11, 257, generator=gen)
    targets = torch.randint(0, 257, (11,), generator=gen).to(device)
    weights = torch.randn(11, generator=gen).to(device)

    reference_logits = base.clone().to(device).requires_grad_()
    expected = _reference(reference_logits, targets, temperature)
    (expected * weights).sum().backward()

    for chunk_rows in (1, 4, 1024):
        logits = base.clone().to(device).requires_grad_()
        logprobs, lse = chunked_token_logprobs(
            logits, targets, temperature=temperature, chunk_rows=chunk_rows
        )
        torch.testing.assert_close(logprobs, expected.detach())
        torch.testing.assert_close(lse, torch.logsumexp(base.to(device) / temperature, dim=-1))
        (logprobs * weights).sum().backward()
        torch.testing.assert_close(logits.grad, reference_logits.grad)


def test_bfloat16_logits_are_scored_in_float32():
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(5, 100, generator=gen)).bfloat16()
    targets = torch.randint(0, 100, (5,), generator=gen)
    logprobs, _ = chunked_token_logprobs(logits, targets)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, _reference(logits, targets, 1.0))


def test_no_rows_give_empty_outputs_that_still_backpropagate():
    logits = torch.zeros(0, 7, requires_grad=True)
    logprobs, lse = chunked_token_logprobs(logits, torch.zeros(0, dtype=torch.long))
    assert logprobs.shape == (0,) and lse.shape == (0,)
    logprobs.sum().backward()
    assert logits.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_entropy_matches_the_softmax_entropy_and_backward_leaves_logits_intact(
    dtype, temperature
):
    gen = torch.Generator().manual_seed(2)
    base = (3 * torch.randn(9, 130, generator=gen)).to(dtype)
    targets = torch.randint(0, 130, (9,), generator=gen)
    logits = base.clone().requires_grad_()
    logprobs, lse, entropy, outside = token_stats(
        logits, targets, temperature=temperature, chunk_rows=4, entropy=True
    )
    assert not outside.any()  # no truncation: every target is in the (whole) kept set
    probs = torch.softmax(base.float() / temperature, dim=-1)
    expected = -(probs * torch.log_softmax(base.float() / temperature, dim=-1)).sum(dim=-1)
    torch.testing.assert_close(entropy, expected)
    assert not entropy.requires_grad and not lse.requires_grad
    logprobs.sum().backward()
    assert logits.grad.dtype == dtype
    assert torch.equal(logits.detach(), base)
    reference = base.clone().requires_grad_()
    _reference(reference, targets, temperature).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)
