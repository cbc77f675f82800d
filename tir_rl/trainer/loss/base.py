"""What every policy loss shares: its call, its metrics, the KL term and the normalizer.

A policy loss (`grpo`, `dppo`, `gspo`, `cispo` beside this module) is one class with one
formula for the per-token surrogate L_t. Everything around the formula is the same for all of
them and lives here:

    loss = Σ_{i,t} m_t · c_{i,t} · (w_t · L_t + β·k3(ℓ^ref_t − ℓ^θ_t)) / D

`w` are the detached mismatch-correction weights (`tir_rl.mismatch`), applied after the
loss's own clip or trust region and never to the KL term; c and D are the aggregation's
(`Aggregation`). Values at masked positions of every input (NaN, ±inf included) change
neither the loss nor the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.metric import ReduceOp
from tir_rl.mismatch.metrics import LOG_RATIO_BOUND


class Aggregation(StrEnum):
    """How the per-token losses of a batch are normalized (the formula is the same)."""

    TOKEN_MEAN = "token_mean"
    """Sum over all model tokens / number of model tokens in the global batch (DAPO)."""
    SEQUENCE_MEAN = "sequence_mean"
    """Mean over each sequence's tokens, then mean over the global batch's sequences (GRPO)."""


@dataclass(frozen=True)
class LossMetric:
    """One diagnostic of the loss, its column and how it combines over micro-batches and ranks."""

    name: str
    reduce: ReduceOp | None
    """SUM for counts, MEAN over the loss tokens, MAX or MIN; None for the loss itself, which
    the trainer normalizes and reports (`tir_rl.trainer.step_result.update_columns`)."""

    @property
    def key(self) -> str:
        """The metrics column, `train/<name>`."""
        return f"train/{self.name}"


LOSS_METRICS = (
    LossMetric("loss", None),
    LossMetric("num_tokens", ReduceOp.SUM),
    LossMetric("clip_fraction_low", ReduceOp.MEAN),
    LossMetric("clip_fraction_high", ReduceOp.MEAN),
    LossMetric("ratio_mean", ReduceOp.MEAN),
    LossMetric("ratio_min", ReduceOp.MIN),
    LossMetric("ratio_max", ReduceOp.MAX),
    LossMetric("policy_kl", ReduceOp.MEAN),
    LossMetric("ref_kl", ReduceOp.MEAN),
)
"""The values of `PolicyLossMetrics`, in their order."""

LOSS_TOKENS = LOSS_METRICS[1].key
"""The column counting the tokens the loss metrics are taken over."""

_NAMES = tuple(metric.name for metric in LOSS_METRICS)


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Diagnostics of one loss call, computed without gradients over the local tokens.

    The values stay in one tensor on the loss's device, so building them costs no host
    sync; reading a field copies it to the host.
    """

    values: Tensor
    """[len(LOSS_METRICS)] float32, in the order of `LOSS_METRICS`."""

    def _get(self, name: str) -> float:
        return float(self.values[_NAMES.index(name)])

    @property
    def loss(self) -> float:
        """The loss value of this call."""
        return self._get("loss")

    @property
    def num_tokens(self) -> int:
        """Model tokens in this call (after rejections)."""
        return int(self._get("num_tokens"))

    @property
    def clip_fraction_low(self) -> float:
        """Share of tokens whose step the loss holds back on the lower side.

        PPO's clip at 1 − clip_low, DPPO's trust region, GSPO's sequence clip, CISPO's weight
        floor: each loss's docstring says which tokens it counts.
        """
        return self._get("clip_fraction_low")

    @property
    def clip_fraction_high(self) -> float:
        """The same on the upper side (A > 0)."""
        return self._get("clip_fraction_high")

    @property
    def ratio_mean(self) -> float:
        """Mean ratio r over the tokens."""
        return self._get("ratio_mean")

    @property
    def ratio_min(self) -> float:
        """Smallest ratio r (1 without tokens)."""
        return self._get("ratio_min")

    @property
    def ratio_max(self) -> float:
        """Largest ratio r (1 without tokens)."""
        return self._get("ratio_max")

    @property
    def policy_kl(self) -> float:
        """k3 estimate of KL(old ‖ θ): how far this update moved the policy."""
        return self._get("policy_kl")

    @property
    def ref_kl(self) -> float:
        """k3 estimate of KL(θ ‖ ref); 0 without a reference."""
        return self._get("ref_kl")


class PolicyLoss(Protocol):
    """What the trainer needs from a loss (every loss of this package fits)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        *,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        num_global_tokens: int | None = None,
        num_global_sequences: int | None = None,
    ) -> tuple[torch.Tensor, PolicyLossMetrics]:
        """Return the globally normalized loss of a micro-batch and its metrics."""
        ...

    @property
    def needs_reference(self) -> bool:
        """Whether the loss takes `ref_logprobs` (a KL term to a frozen reference policy)."""
        ...

    def global_normalizer(self, *, num_tokens: int, num_sequences: int) -> int:
        """The global D the loss divides by, from the global token and sequence counts."""
        ...


def k3(log_ratio: Tensor) -> Tensor:
    """Per-token k3 estimator exp(x) − x − 1 (≥ 0) of x = log(q/p); clamped for safety."""
    x = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(x) - x - 1


def aggregate(
    per_token: Tensor,
    valid: Tensor,
    aggregation: Aggregation,
    *,
    num_global_tokens: int | None = None,
    num_global_sequences: int | None = None,
) -> Tensor:
    """Σ m·c·L / D for the chosen aggregation (see the module docstring).

    Args:
        per_token: [B, T] per-token losses (values at invalid positions are ignored).
        valid: [B, T] bool, tokens that enter the loss.
        aggregation: picks c and D.
        num_global_tokens: D for token-mean; None uses the local count.
        num_global_sequences: D for sequence-mean (non-empty sequences); None: local count.
    """
    num_tokens = valid.sum(dim=1)  # [B]
    if aggregation is Aggregation.TOKEN_MEAN:
        scaled = per_token
        denom = num_global_tokens if num_global_tokens is not None else int(num_tokens.sum())
    else:
        scaled = per_token / num_tokens.clamp(min=1).unsqueeze(1).to(per_token.dtype)
        denom = num_global_sequences
        if denom is None:
            denom = int((num_tokens > 0).sum())
    total = torch.where(valid, scaled, torch.zeros_like(scaled)).sum()
    return total / max(denom, 1)


def global_normalizer(aggregation: Aggregation, *, num_tokens: int, num_sequences: int) -> int:
    """D of `aggregate` for the global batch: tokens (token-mean) or sequences (seq-mean)."""
    return max(num_tokens if aggregation is Aggregation.TOKEN_MEAN else num_sequences, 1)


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] per-sequence or [B, T] per-token advantages as [B, T]."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand_as(like)
    assert advantages.shape == like.shape, f"advantages {advantages.shape} vs {like.shape}"
    return advantages


@dataclass(kw_only=True, frozen=True)
class LossTerms:
    """The objective's terms every policy loss shares: a KL penalty and the normalizer."""

    kl_coef: float = 0.0
    """β of the k3 KL to the reference policy (per model token, k3(ℓ^ref − ℓ^θ), never
    weighted by the mismatch correction); 0 (off) needs no reference. > 0 makes the trainer
    load a frozen reference (`trainer.reference_model`: the starting weights by default) and
    log `train/ref_kl`; degenerate groups then stay in the update (the KL term gives them
    gradient)."""
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    """Normalizer of the summed token losses; see `Aggregation`."""

    def validate(self) -> None:
        """Raise ConfigError on a negative KL coefficient."""
        if self.kl_coef < 0:
            raise ConfigError(f"loss kl_coef must be >= 0, got {self.kl_coef}")

    def global_normalizer(self, *, num_tokens: int, num_sequences: int) -> int:
        """The D a loss with these terms divides by, given the global counts (`aggregate`).

        A caller that sums unnormalized micro-batch losses (`num_global_tokens=1`,
        `num_global_sequences=1`) divides the summed gradient by this afterwards.
        """
        return global_normalizer(
            self.aggregation, num_tokens=num_tokens, num_sequences=num_sequences
        )


@dataclass(frozen=True)
class TokenInputs:
    """A micro-batch's inputs with every masked position made harmless (see the module)."""

    valid: Tensor
    """[B, T] bool, tokens that enter the loss."""
    logprobs: Tensor
    """[B, T] ℓ^θ with grad, 0 where not valid."""
    old_logprobs: Tensor
    """[B, T] ℓ^old detached, 0 where not valid."""
    advantages: Tensor
    """[B, T] detached, 0 where not valid."""
    log_ratio: Tensor
    """[B, T] ℓ^θ − ℓ^old clamped to ±`LOG_RATIO_BOUND`, with grad."""
    ratio: Tensor
    """[B, T] r = exp(log_ratio), with grad."""

    @classmethod
    def of(
        cls, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor
    ) -> TokenInputs:
        """Mask, detach and broadcast the loss's inputs; the ratio against ℓ^old."""
        valid = loss_mask > 0
        zero = torch.zeros_like(logprobs)
        lp = torch.where(valid, logprobs, zero)
        old = torch.where(valid, old_logprobs.detach(), zero)
        log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        adv = torch.where(valid, broadcast_advantages(advantages.detach(), lp), zero)
        return cls(valid, lp, old, adv, log_ratio, torch.exp(log_ratio))


def finish(
    per_token: Tensor,
    inputs: TokenInputs,
    terms: LossTerms,
    *,
    held_low: Tensor,
    held_high: Tensor,
    weights: Tensor | None,
    ref_logprobs: Tensor | None,
    num_global_tokens: int | None,
    num_global_sequences: int | None,
) -> tuple[Tensor, PolicyLossMetrics]:
    """The loss of a micro-batch from its per-token surrogate, and its metrics.

    Args:
        per_token: [B, T] the loss's surrogate L_t (with grad).
        inputs: the masked inputs the surrogate was computed from.
        terms: the KL coefficient and the aggregation.
        held_low: [B, T] bool, tokens whose step the loss held back on the lower side.
        held_high: [B, T] bool, the same on the upper side.
        weights: [B, T] detached correction weights, or None.
        ref_logprobs: [B, T] reference-policy logprobs; needed when kl_coef > 0.
        num_global_tokens: D for token-mean; None uses the local count.
        num_global_sequences: D for sequence-mean; None uses the local count.
    """
    valid, zero = inputs.valid, torch.zeros_like(inputs.logprobs)
    if weights is not None:
        per_token = per_token * torch.where(valid, weights.detach(), zero)
    ref_kl = None
    if terms.kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError("loss.kl_coef > 0 needs ref_logprobs; pass them or set kl_coef 0")
        ref = torch.where(valid, ref_logprobs.detach(), zero)
        ref_kl = k3(ref - inputs.logprobs)
        per_token = per_token + terms.kl_coef * ref_kl
    loss = aggregate(
        per_token,
        valid,
        terms.aggregation,
        num_global_tokens=num_global_tokens,
        num_global_sequences=num_global_sequences,
    )
    with torch.no_grad():
        metrics = _metrics(loss, inputs, ref_kl, held_low & valid, held_high & valid)
    return loss, metrics


def _metrics(
    loss: Tensor,
    inputs: TokenInputs,
    ref_kl: Tensor | None,
    held_low: Tensor,
    held_high: Tensor,
) -> PolicyLossMetrics:
    valid, ratio = inputs.valid, inputs.ratio.detach()
    n = valid.sum()
    denom = n.clamp(min=1)
    inf = torch.full_like(ratio, torch.inf)
    zeros = torch.zeros_like(ratio)
    policy_kl = torch.where(valid, k3(-inputs.log_ratio.detach()), zeros).sum() / denom
    ref = torch.where(valid, ref_kl, zeros).sum() / denom if ref_kl is not None else None
    has = n > 0
    values = torch.stack(
        [
            loss.detach().float(),
            n.float(),
            held_low.sum() / denom,
            held_high.sum() / denom,
            torch.where(valid, ratio, zeros).sum() / denom,
            torch.where(has, torch.where(valid, ratio, inf).min(), ratio.new_ones(())),
            torch.where(has, torch.where(valid, ratio, -inf).max(), ratio.new_ones(())),
            policy_kl,
            ref if ref is not None else ratio.new_zeros(()),
        ]
    ).float()
    return PolicyLossMetrics(values)
