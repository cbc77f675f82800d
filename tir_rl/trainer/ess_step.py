"""VCPO's step size: the learning rate scaled by the effective sample size of the batch.

VCPO (arXiv 2602.17616) measures how far a batch sampled by μ is from the policy it trains by
the effective sample size of its sequence importance weights,

    w_i = exp( Σ_t (ℓ^old_t − ℓ^μ_t) )               (model tokens of sequence i, not clamped)
    ρ   = (Σ_i w_i)² / ((Σ_i w_i² + 1e-8) · B)          (B sequences of the whole step, all ranks)

and shrinks the step when ρ drops: lr_eff = lr · min(1, ρ/ρ_ref)^½ (rule `sqrt`; `linear` drops
the square root). AdamW is invariant to the loss's scale, so the rate is what must shrink.

ρ is the effective sample size of the raw sequence weights. tir-rl's `mismatch/is_seq_ess` is the
same formula on weights clamped to [1/C, C] (C = 2), as a mean of the ranks' values: it is
bounded below (it cannot fall under 4C/(1 + C)² = 0.64 with C = 2) and reads a few wild sequences as
mild, where ρ falls towards 1/B. Both are logged (`mismatch/vcpo_ess` is ρ).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.mismatch.metrics import METRIC_EXP_BOUND, masked_log_ratio

ESS_KEY = "mismatch/vcpo_ess"
SCALE_KEY = "train/ess_lr_scale"
_EPS = 1e-8
"""VCPO's guard in the ESS's denominator."""


class ESSRule(StrEnum):
    """How the rate follows the ESS ratio."""

    SQRT = "sqrt"
    """lr · min(1, ρ/ρ_ref)^½ (VCPO's default)."""
    LINEAR = "linear"
    """lr · min(1, ρ/ρ_ref)."""


@dataclass(kw_only=True, frozen=True)
class ESSStepSize:
    """`trainer.ess_step_size`: VCPO's ESS-scaled learning rate (off by default)."""

    enabled: bool = False
    """Scale each update's learning rate by the step's ESS ratio ρ (`mismatch/vcpo_ess`); the
    applied factor is logged as `train/ess_lr_scale`."""
    reference: float = 1.0
    """ρ_ref: the ESS ratio from which on the rate is not reduced (VCPO's default 1)."""
    rule: ESSRule = ESSRule.SQRT
    """`sqrt` (VCPO's) or `linear`."""

    def validate(self) -> None:
        """Raise ConfigError on a reference outside (0, 1]."""
        if not 0 < self.reference <= 1:
            raise ConfigError(
                f"trainer.ess_step_size.reference must be in (0, 1], got {self.reference}"
            )

    def scale(self, ess_ratio: float) -> float:
        """The factor of the learning rate at ESS ratio ρ (1 when off)."""
        if not self.enabled:
            return 1.0
        ratio = min(1.0, ess_ratio / self.reference)
        return ratio**0.5 if self.rule is ESSRule.SQRT else ratio


def sequence_weight_sums(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor
) -> Tensor:
    """[3] float64 (Σ w_i, Σ w_i², number of sequences) of one rank's share, for the all-reduce.

    log w_i is clamped to ±`METRIC_EXP_BOUND` (300) before exp, so w_i² stays finite in
    float64; a sequence that far off would overflow VCPO's own float32 weights.
    """
    valid = loss_mask > 0
    delta = masked_log_ratio(trainer_logprobs, sampler_logprobs, valid, torch.float64)
    has_tokens = valid.any(dim=-1)
    log_w = delta.sum(dim=-1)[has_tokens].clamp(-METRIC_EXP_BOUND, METRIC_EXP_BOUND)
    w = torch.exp(log_w)
    return torch.stack([w.sum(), w.square().sum(), has_tokens.sum().double()]).cpu()


def ess_ratio(sum_w: float, sum_w2: float, num_sequences: float) -> float:
    """ρ from the global sums (1 for an empty batch)."""
    if num_sequences <= 0:
        return 1.0
    return sum_w**2 / ((sum_w2 + _EPS) * num_sequences)
