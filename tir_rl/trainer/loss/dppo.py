"""DPPO: a trust region on a direct estimate of the policy divergence (arXiv 2602.04879).

PPO clips the ratio r = π_θ/π_old, which over-restricts rare tokens (a ratio of 2 on a token of
probability 1e-4 moves almost no mass) and under-restricts likely ones. DPPO instead bounds the
divergence of each token's two-outcome distribution {the sampled token, any other}, with
p = exp(ℓ^θ_t) and q = exp(ℓ^old_t):

    binary total variation  D_TV = |p − q|
    binary KL               D_KL = q·(ℓ^old − ℓ^θ) + (1 − q)·log((1 − q + 1e-8) / (1 − p + 1e-8))

A token leaves the step (mask M_t = 0) when the update would carry it further out of the trust
region: for A > 0 when p has risen by more than δ_high (TV: p − q > δ_high; KL: D_KL > δ_high
and p > q), for A ≤ 0 when it has fallen by more than δ_low. The rest are trained on the
importance-weighted policy gradient:

    L_t = −A_t · sg(min(r_t, C)) · M_t · ℓ^θ_t,     ∇L_t = −A_t · M_t · ∇r_t  (r_t < C)

The value is the authors' (and verl's) form; its gradient is that of the unclipped surrogate on
the tokens kept. Its held-back fractions: `clip_fraction_low` counts masked tokens with A < 0,
`clip_fraction_high` those with A > 0.

The anchor ℓ^old is what the trainer passes: its recompute (decoupled mode), or the sampler's
logprobs in bypass mode (`correction.bypass: ppo_clip`), which the authors recommend: the trust
region then bounds the divergence from the policy that actually sampled the tokens. With one
optimizer step per batch (tir-rl's step) and the recompute as anchor, p = q and nothing is
masked: the trust region acts in bypass mode, or when the correction's weights carry the gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.trainer.loss.base import LossTerms, PolicyLossMetrics, TokenInputs, finish

_KL_EPS = 1e-8
"""Keeps log((1 − q)/(1 − p)) finite where a probability is 1 (the authors' constant)."""


@dataclass(kw_only=True, frozen=True)
class DPPOBounds:
    """The trust region's size on each side and the ratio's truncation."""

    delta_low: float
    """δ_low: how far a token with A ≤ 0 may fall (in the divergence's units) before it leaves
    the step."""
    delta_high: float
    """δ_high: how far a token with A > 0 may rise before it leaves the step."""
    ratio_cap: float | None = None
    """C: the importance weight is truncated at min(r, C); null: not truncated (the authors'
    runs set C = 1e4, which never binds)."""

    SECTION: ClassVar[str] = "dppo"
    """The config section these bounds are set in (for messages)."""

    def validate(self) -> None:
        """Raise ConfigError on a bound that is not positive."""
        section = self.SECTION
        if self.delta_low <= 0 or self.delta_high <= 0:
            raise ConfigError(
                f"loss.{section} delta_low and delta_high must be > 0, got {self.delta_low}, "
                f"{self.delta_high}"
            )
        if self.ratio_cap is not None and self.ratio_cap <= 0:
            raise ConfigError(f"loss.{section} ratio_cap must be > 0 or null, got {self.ratio_cap}")


class _DivergenceTrustRegion:
    """The DPPO loss around a divergence (subclasses say which, and its default bounds)."""

    def __init__(self, config: DPPOBounds, terms: LossTerms | None) -> None:
        self.config = config
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

    def _outside(self, x: TokenInputs) -> tuple[Tensor, Tensor]:
        """[B, T] bool (risen too far, fallen too far), no grad."""
        raise NotImplementedError

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
        x = TokenInputs.of(logprobs, old_logprobs, advantages, loss_mask)
        with torch.no_grad():
            risen, fallen = self._outside(x)
            outside = torch.where(x.advantages > 0, risen, fallen)
            keep = (~outside).float()
            weight = x.ratio.detach()
            if self.config.ratio_cap is not None:
                weight = weight.clamp(max=self.config.ratio_cap)
        per_token = -x.advantages * weight * keep * x.logprobs
        return finish(
            per_token,
            x,
            self.terms,
            held_low=outside & (x.advantages < 0),
            held_high=outside & (x.advantages > 0),
            weights=weights,
            ref_logprobs=ref_logprobs,
            num_global_tokens=num_global_tokens,
            num_global_sequences=num_global_sequences,
        )


class DPPOBinaryTVLoss(_DivergenceTrustRegion):
    """DPPO with the binary total variation |p − q| (the module docstring)."""

    @dataclass(kw_only=True, frozen=True)
    class Config(DPPOBounds):
        """The binary-TV trust region (`loss.dppo_tv`); the authors' δ = 0.15 on both sides."""

        SECTION: ClassVar[str] = "dppo_tv"

        delta_low: float = 0.15
        """δ_low: a token with A ≤ 0 leaves the step once p − q < −δ_low."""
        delta_high: float = 0.15
        """δ_high: a token with A > 0 leaves the step once p − q > δ_high."""

    def __init__(self, config: Config | None = None, terms: LossTerms | None = None) -> None:
        super().__init__(config if config is not None else DPPOBinaryTVLoss.Config(), terms)

    def _outside(self, x: TokenInputs) -> tuple[Tensor, Tensor]:
        gap = torch.exp(x.logprobs.detach()) - torch.exp(x.old_logprobs)  # p − q
        return gap > self.config.delta_high, gap < -self.config.delta_low


class DPPOBinaryKLLoss(_DivergenceTrustRegion):
    """DPPO with the binary KL divergence KL(q ‖ p) (the module docstring)."""

    @dataclass(kw_only=True, frozen=True)
    class Config(DPPOBounds):
        """The binary-KL trust region (`loss.dppo_kl`); the authors' δ = 0.05 on both sides."""

        SECTION: ClassVar[str] = "dppo_kl"

        delta_low: float = 0.05
        """δ_low: a token with A ≤ 0 leaves the step once p < q and D_KL > δ_low."""
        delta_high: float = 0.05
        """δ_high: a token with A > 0 leaves the step once p > q and D_KL > δ_high."""

    def __init__(self, config: Config | None = None, terms: LossTerms | None = None) -> None:
        super().__init__(config if config is not None else DPPOBinaryKLLoss.Config(), terms)

    def _outside(self, x: TokenInputs) -> tuple[Tensor, Tensor]:
        lp, old = x.logprobs.detach(), x.old_logprobs
        p, q = torch.exp(lp), torch.exp(old)
        kl = q * (old - lp) + (1 - q) * torch.log((1.0 - q + _KL_EPS) / (1.0 - p + _KL_EPS))
        risen = (kl > self.config.delta_high) & (p > q)
        fallen = (kl > self.config.delta_low) & (p < q)
        return risen, fallen
