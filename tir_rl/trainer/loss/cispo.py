"""CISPO: a clipped, stop-gradient importance weight that drops no token (arXiv 2506.13585).

PPO's clip zeroes the gradient of a token whose ratio left the band, and in long reasoning the
rare tokens that leave it first (forks, "wait") are the ones that matter. CISPO clips the
weight instead and keeps every token's gradient:

    L_t = −sg(clip(r_t, 1 − clip_low, 1 + clip_high)) · A_t · ℓ^θ_t,   r_t = exp(ℓ^θ_t − ℓ^old_t)

(no lower clip by default, as in the paper and verl). Its held-back fractions count tokens whose
weight the clip changed: `clip_fraction_low` r_t < 1 − clip_low, `clip_fraction_high`
r_t > 1 + clip_high, whatever the advantage's sign.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.trainer.loss.base import LossTerms, PolicyLossMetrics, TokenInputs, finish


class CISPOLoss:
    """Policy gradient with a clipped, detached importance weight (the module docstring)."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        """CISPO's weight clip (`loss.cispo`)."""

        clip_low: float | None = None
        """ε_lo: the weight is clipped below at 1 − clip_low; null: no lower clip (the
        paper's choice; verl writes it as clip_ratio_low 10)."""
        clip_high: float = 0.2
        """ε_hi: the weight is clipped above at 1 + clip_high (verl's example: 0.2)."""

        def validate(self) -> None:
            """Raise ConfigError on inconsistent values."""
            if self.clip_high < 0 or (self.clip_low is not None and self.clip_low < 0):
                raise ConfigError(
                    f"loss.cispo clip_low (or null) and clip_high must be >= 0, got "
                    f"{self.clip_low}, {self.clip_high}"
                )

    def __init__(self, config: Config | None = None, terms: LossTerms | None = None) -> None:
        self.config = config if config is not None else CISPOLoss.Config()
        self.terms = terms if terms is not None else LossTerms()
        self.config.validate()
        self.terms.validate()

    @property
    def needs_reference(self) -> bool:
        """Whether the loss has a KL term, so that its caller must pass `ref_logprobs`."""
        return self.terms.kl_coef > 0

    def global_normalizer(self, *, num_tokens: int, num_sequences: int) -> int:
        """The D this loss divides by (`LossTerms.global_normalizer`)."""
        return self.terms.global_normalizer(num_tokens=num_tokens, num_sequences=num_sequences)

    def __call__(
        self,
        logprobs: Tensor,
        *,
        old_logprobs: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
        weights: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        num_global_tokens: int | None = None,
        num_global_sequences: int | None = None,
    ) -> tuple[Tensor, PolicyLossMetrics]:
        """Loss of one micro-batch; arguments as in `GRPOLoss.__call__`."""
        cfg = self.config
        x = TokenInputs.of(logprobs, old_logprobs, advantages, loss_mask)
        with torch.no_grad():
            ratio = x.ratio.detach()
            low = None if cfg.clip_low is None else 1 - cfg.clip_low
            clipped = ratio.clamp(min=low, max=1 + cfg.clip_high)
            held_low = ratio < low if low is not None else torch.zeros_like(x.valid)
            held_high = ratio > 1 + cfg.clip_high
        per_token = -clipped * x.advantages * x.logprobs
        return finish(
            per_token,
            x,
            self.terms,
            held_low=held_low,
            held_high=held_high,
            weights=weights,
            ref_logprobs=ref_logprobs,
            num_global_tokens=num_global_tokens,
            num_global_sequences=num_global_sequences,
        )
