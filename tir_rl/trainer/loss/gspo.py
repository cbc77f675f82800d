"""GSPO: a length-normalized sequence ratio with a sequence-level clip (arXiv 2507.18071).

The importance ratio of sequence i is the geometric mean of its tokens' ratios,

    s_i = exp( (1/|y_i|) Σ_t (ℓ^θ_t − ℓ^old_t) ),    |y_i| = its tokens in the loss (≥ 1),

and every token of the sequence carries it, with the token's own gradient (GSPO-token):

    s_{i,t} = sg(s_i) · exp(ℓ^θ_t − sg(ℓ^θ_t))    (value s_i, log clamped at 10 above)
    L_t = max(−A_i·s_{i,t}, −A_i·clip(s_{i,t}, 1 − clip_low, 1 + clip_high))

so a sequence is clipped as a whole. With the paper's aggregation (a mean over sequences of each
sequence's token mean: `sequence_mean`, this loss's default) the gradient is
−A_i·s_i·(1/|y_i|)·Σ_t ∇ℓ^θ_t, the paper's. Its held-back fractions count the tokens of clipped
sequences: `clip_fraction_low` with A < 0 and s_i < 1 − clip_low, `clip_fraction_high` with
A > 0 and s_i > 1 + clip_high.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.trainer.loss.base import LossTerms, PolicyLossMetrics, TokenInputs, finish

_LOG_RATIO_MAX = 10.0
"""The sequence ratio's log is clamped above at 10 (verl's bound)."""


class GSPOLoss:
    """Sequence-level clipped surrogate with a length-normalized ratio (the module docstring)."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        """GSPO's sequence clip (`loss.gspo`); the paper's bounds 3e-4 and 4e-4."""

        clip_low: float = 3.0e-4
        """ε_lo: the sequence ratio is clipped below at 1 − clip_low."""
        clip_high: float = 4.0e-4
        """ε_hi: the sequence ratio is clipped above at 1 + clip_high."""

        def validate(self) -> None:
            """Raise ConfigError on inconsistent values."""
            if not 0 <= self.clip_low < 1 or self.clip_high < 0:
                raise ConfigError(
                    f"loss.gspo clip_low must be in [0, 1) and clip_high >= 0, got "
                    f"{self.clip_low}, {self.clip_high}"
                )

    def __init__(self, config: Config | None = None, terms: LossTerms | None = None) -> None:
        self.config = config if config is not None else GSPOLoss.Config()
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
        """Loss of one micro-batch; arguments as in `GRPOLoss.__call__` (whole sequences)."""
        cfg = self.config
        x = TokenInputs.of(logprobs, old_logprobs, advantages, loss_mask)
        lengths = x.valid.sum(dim=-1).clamp(min=1)  # [B]
        seq_log_ratio = (x.logprobs - x.old_logprobs).sum(dim=-1) / lengths  # [B], with grad
        log_ratio = x.logprobs - x.logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
        ratio = torch.exp(log_ratio.clamp(max=_LOG_RATIO_MAX))  # [B, T], value s_i
        adv = x.advantages
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        per_token = torch.maximum(unclipped, clipped)
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
