"""GRPO's policy loss: the token-level PPO-clip surrogate (clip-higher, optional dual clip).

Per model token t of sequence i, with r_t = exp(ℓ^θ_t − ℓ^old_t):

    L_t = max(−A_i·r_t, −A_i·clip(r_t, 1 − clip_low, 1 + clip_high))

and, with `dual_clip` c, L_t = min(L_t, −A_i·c) where A_i < 0. The KL term, the correction
weights and the normalizer are the shared ones (`tir_rl.trainer.loss.base`).

Bypass mode (spec §4, ℓ^old := ℓ^μ) needs no other class: the trainer passes the sampler's
logprobs as `old_logprobs` and weights of 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.trainer.loss.base import LossTerms, PolicyLossMetrics, TokenInputs, finish


class GRPOLoss:
    """Token-level PPO-clip surrogate with asymmetric clip, optional k3 KL to a reference.

    Its held-back fractions: `clip_fraction_low` counts A < 0 and r < 1 − clip_low,
    `clip_fraction_high` A > 0 and r > 1 + clip_high.
    """

    @dataclass(kw_only=True, frozen=True)
    class Config:
        """PPO's ratio clip (`loss.grpo`)."""

        clip_low: float = 0.2
        """ε_lo: the ratio is clipped below at 1 − clip_low."""
        clip_high: float = 0.28
        """ε_hi: the ratio is clipped above at 1 + clip_high ("clip-higher", DAPO): a larger
        upper bound lets low-probability tokens with positive advantage grow, which keeps
        entropy from collapsing. Set 0.2 for the symmetric clip of the GRPO paper."""
        dual_clip: float | None = None
        """c > 1: for A < 0 the loss is also capped at −A·c (verl's dual clip uses 3)."""

        def validate(self) -> None:
            """Raise ConfigError on inconsistent values."""
            if not 0 <= self.clip_low < 1 or self.clip_high < 0:
                raise ConfigError(
                    f"loss.grpo clip_low must be in [0, 1) and clip_high >= 0, got "
                    f"{self.clip_low}, {self.clip_high}"
                )
            if self.dual_clip is not None and self.dual_clip <= 1:
                raise ConfigError(
                    f"loss.grpo dual_clip must be > 1 (e.g. 3.0), got {self.dual_clip}"
                )

    def __init__(self, config: Config | None = None, terms: LossTerms | None = None) -> None:
        self.config = config if config is not None else GRPOLoss.Config()
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
        """Loss of one micro-batch.

        Args:
            logprobs: [B, T] ℓ^θ of the sampled tokens, with grad.
            old_logprobs: [B, T] ℓ^old (the trainer's recompute; ℓ^μ in bypass mode).
            advantages: [B] per sequence, or [B, T] per token.
            loss_mask: [B, T], 1 for tokens that enter the loss (rejections folded in).
            weights: [B, T] detached correction weights, or None for plain GRPO.
            ref_logprobs: [B, T] reference-policy logprobs; needed when kl_coef > 0.
            num_global_tokens: model tokens of the whole global batch (token-mean).
            num_global_sequences: non-empty sequences of the whole global batch (seq-mean).

        Returns:
            The scalar loss and its metrics.
        """
        cfg = self.config
        x = TokenInputs.of(logprobs, old_logprobs, advantages, loss_mask)
        adv, ratio = x.advantages, x.ratio
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        per_token = torch.maximum(unclipped, clipped)
        if cfg.dual_clip is not None:
            capped = torch.minimum(per_token, -adv * cfg.dual_clip)
            per_token = torch.where(adv < 0, capped, per_token)
        with torch.no_grad():
            held_low = (adv < 0) & (ratio < 1 - cfg.clip_low)
            held_high = (adv > 0) & (ratio > 1 + cfg.clip_high)
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
