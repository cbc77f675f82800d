"""The kept set of min-p, top-k and top-p, against vLLM's own sampler code, and its replay."""

from __future__ import annotations

import pytest
import torch

from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.errors import ConfigError
from tir_rl.trainer.token_stats import token_stats

SETTINGS = [
    SamplingTruncation(top_p=0.9),
    SamplingTruncation(top_k=20),
    SamplingTruncation(min_p=0.05),
    SamplingTruncation(top_p=0.8, top_k=20, min_p=0.02),
    SamplingTruncation(top_k=1),
    SamplingTruncation(top_p=1e-3),
]


def vllm_kept(logits: torch.Tensor, cut: SamplingTruncation) -> torch.Tensor:
    """The tokens vLLM-CPU's sampler leaves finite: its min-p processor's rule, then its own
    `apply_top_k_top_p_pytorch` (logits already divided by the temperature)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = logits.clone()
    if cut.min_p > 0:  # vllm.v1.sample.logits_processor.builtin.MinPLogitsProcessor.apply
        probs = torch.softmax(x, dim=-1)
        x[probs < probs.amax(dim=-1, keepdim=True) * cut.min_p] = -torch.inf
    k = None if cut.top_k is None else torch.full((x.shape[0],), cut.top_k)
    p = None if cut.top_p >= 1 else torch.full((x.shape[0],), cut.top_p)
    return torch.isfinite(apply_top_k_top_p_pytorch(x, k, p, allow_cpu_sync=True))


@pytest.mark.parametrize("cut", SETTINGS, ids=str)
def test_the_kept_set_is_vllms(cut):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen) * 3  # peaked and flat rows alike
    assert torch.equal(cut.kept(logits), vllm_kept(logits, cut))


@pytest.mark.parametrize("cut", SETTINGS, ids=str)
def test_the_replayed_logprob_is_the_log_softmax_over_the_kept_set(cut):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(32, 100, generator=gen) * 2).requires_grad_(True)
    temperature = 0.7
    scaled = logits.detach() / temperature
    keep = cut.kept(scaled)
    targets = torch.multinomial(
        torch.where(keep, scaled, -torch.inf).softmax(-1), 1, generator=gen
    )[:, 0]
    stats = token_stats(logits, targets, temperature=temperature, truncation=cut, entropy=True)
    masked = torch.where(keep, logits / temperature, -torch.inf)
    want = torch.log_softmax(masked, dim=-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(stats.logprobs, want, rtol=0, atol=1e-6)
    assert not stats.outside.any()
    (grad,) = torch.autograd.grad(stats.logprobs.sum(), logits)
    logits_ref = logits.detach().clone().requires_grad_(True)
    masked_ref = torch.where(keep, logits_ref / temperature, -torch.inf)
    ref = torch.log_softmax(masked_ref, dim=-1).gather(-1, targets[:, None]).sum()
    (want_grad,) = torch.autograd.grad(ref, logits_ref)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-6)
    probs = masked.detach().softmax(-1)
    entropy = -torch.where(keep, probs * probs.log(), 0.0).sum(-1)
    torch.testing.assert_close(stats.entropy, entropy, rtol=0, atol=1e-5)


def test_the_full_vocabulary_logprob_is_the_kept_one_plus_the_log_kept_mass():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(2))
    cut = SamplingTruncation(top_p=0.9)
    targets = logits.argmax(-1)  # always kept
    kept = token_stats(logits, targets, truncation=cut).logprobs
    full = token_stats(logits, targets).logprobs
    mass = torch.where(cut.kept(logits), logits.softmax(-1), 0.0).sum(-1)
    torch.testing.assert_close(full, kept + mass.log(), rtol=0, atol=1e-6)


def test_a_sampled_token_outside_the_replayed_set_is_kept_and_counted():
    logits = torch.tensor([[5.0, 4.0, -3.0, -4.0]])
    stats = token_stats(logits, torch.tensor([3]), truncation=SamplingTruncation(top_k=2))
    assert stats.outside.tolist() == [True]
    want = torch.log_softmax(torch.tensor([5.0, 4.0, -4.0]), -1)[2]
    assert stats.logprobs.item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs", [{"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"min_p": 1.0}, {"min_p": -0.1}]
)
def test_bad_values_are_refused(kwargs):
    with pytest.raises(ConfigError, match="rollout"):
        SamplingTruncation(**kwargs).validate()


def test_inactive_settings_cut_nothing():
    assert not SamplingTruncation().active
    logits = torch.randn(4, 10)
    assert SamplingTruncation().kept(logits).all()
