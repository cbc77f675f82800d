"""Failure tilt: whether the sampler favoured an update's failed episodes over the trainer.

The collapse lab found (docs/collapse.md A5) that under every mismatch cause it ran, the
failed sequences carry a negative mean log-ratio δ̄ = mean_t (ℓ^old_t − ℓ^μ_t), far larger in
size than the succeeded ones', and that whatever weighed failures less (a sequence mask, a
token weight, or dropping failures at random) kept the runs from collapsing. The tilt is the
advantage-weighted mean of δ̄ over the sequences the update trains on, weighed as the update
weighs them:

    tilt = Σ_i w_i A_i δ̄_i / Σ_i w_i |A_i|,

where A_i is the GRPO advantage and w_i the share of the sequence's weight the correction
left it (Σ_t weight_t / n_i: 1 without a correction, 0 for a rejected sequence). It is
positive when failures (A < 0) are over-weighted by the sampler (δ̄ < 0) or successes
under-weighted, in nats per token, and 0 when the gap is unrelated to the outcome.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tir_rl.metric import Metric

TILT_KEY = "mismatch/failure_tilt"
TILT_MASS_KEY = "mismatch/failure_tilt_mass"
"""Σ_i w_i |A_i|: what the tilt is a mean over (its weight across ranks)."""


def tilt_sums(
    advantages: Tensor, log_ratio_means: Tensor, sequence_weights: Tensor
) -> tuple[float, float]:
    """(Σ w A δ̄, Σ w |A|) over sequences; the tilt is their quotient.

    Args:
        advantages: [B] GRPO advantage per sequence (0: no gradient, contributes nothing).
        log_ratio_means: [B] δ̄_i, mean ℓ^old − ℓ^μ over the sequence's model tokens.
        sequence_weights: [B] w_i, the correction's weight left to the sequence (0 to 1-ish).
    """
    a = advantages.double()
    w = sequence_weights.double()
    return float((w * a * log_ratio_means.double()).sum()), float((w * a.abs()).sum())


def failure_tilt(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    advantages: Tensor,
    weights: Tensor | None,
) -> dict[str, Metric]:
    """The tilt of one rank's share of an update (see the module docstring).

    Args:
        trainer_logprobs: [B, T] ℓ^old of the update.
        sampler_logprobs: [B, T] ℓ^μ; any value where `loss_mask` is 0.
        loss_mask: [B, T], 1 for model-sampled tokens (before the correction).
        advantages: [B] the update's advantages.
        weights: [B, T] the correction's weights, 0 where it rejected; None: no correction.

    Returns:
        `mismatch/failure_tilt` (a mean over `mismatch/failure_tilt_mass`) and that mass;
        {} when no sequence carries a gradient.
    """
    mask = loss_mask.bool()
    n = mask.sum(dim=-1).clamp(min=1).double()
    delta = torch.where(mask, trainer_logprobs.double() - sampler_logprobs.double(), 0.0)
    kept = torch.ones_like(delta) if weights is None else weights.double()
    sequence_weights = torch.where(mask, kept, 0.0).sum(dim=-1) / n
    log_ratio_means = (delta.sum(dim=-1) / n).cpu()
    tilted, mass = tilt_sums(advantages.cpu(), log_ratio_means, sequence_weights.cpu())
    if mass <= 0:
        return {}
    return {TILT_KEY: Metric.mean(tilted / mass, TILT_MASS_KEY), TILT_MASS_KEY: Metric.count(mass)}
