"""GRPO: group-relative advantages and the token-level PPO-clip policy loss.

One step of the objective, per model token t of sequence i (mask m_t = 1):

    r_t = exp(ℓ^θ_t − ℓ^old_t)
    L_t = w_t · max(−A_i·r_t, −A_i·clip(r_t, 1 − clip_low, 1 + clip_high)) + β·k3(ℓ^ref_t, ℓ^θ_t)
    loss = Σ_{i,t} m_t · c_{i,t} · L_t / D

`w` are the detached mismatch-correction weights (`tir_rl.mismatch`), applied after the clip
and never to the KL term. The aggregation only picks the normalizer: token-mean uses
c = 1 and D = the number of model tokens in the global batch; sequence-mean uses c = 1/N_i
and D = the number of non-empty sequences in the global batch. D is passed in as a global
count so that gradient accumulation and any number of ranks give the update of one big batch.

Bypass mode (spec §4, ℓ^old := ℓ^μ) needs no new class for PPO-clip: call `GRPOLoss` with
`old_logprobs=sampler_logprobs` and `weights=None`. Its REINFORCE variant is `ReinforceLoss`.
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


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of N samples that come in groups of completions of the same task."""

    advantages: Tensor
    """[N] float; exactly 0 for every sample of a degenerate group."""
    degenerate: Tensor
    """[N] bool; the sample's group has all rewards equal (it contributes no gradient)."""
    num_groups: int
    num_degenerate_groups: int
    """Groups whose rewards are all equal (including groups of one sample)."""


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    episode_ids: Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> GroupAdvantages:
    """Group-relative advantages: reward minus the group mean, optionally over the group std.

    Args:
        rewards: [N] rewards.
        group_ids: [N] integer ids; samples with the same id are completions of one task.
        episode_ids: [N] integer ids, or None (every row is an episode). Rows of one group
            with the same id are samples of one episode (an agent whose history was not
            append-only): they share its reward and advantage, and the episode counts once
            in the group's mean and std.
        normalize_std: divide by the group's (Bessel-corrected) standard deviation + eps,
            as in the GRPO paper; False gives the plain mean baseline (Dr. GRPO).
        eps: added to the std before dividing.
    """
    rewards = rewards.to(torch.float32)
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max().item()) + 1 if group.numel() else 0
    dev = rewards.device
    weight = _first_of_each_episode(group, episode_ids).to(device=dev, dtype=torch.float32)
    counts = torch.zeros(num_groups, device=dev).index_add_(0, group, weight)
    mean = torch.zeros(num_groups, device=dev).index_add_(0, group, rewards * weight) / counts
    centered = rewards - mean[group]
    lo = torch.full((num_groups,), torch.inf, device=dev).scatter_reduce(0, group, rewards, "amin")
    hi = torch.full((num_groups,), -torch.inf, device=dev).scatter_reduce(0, group, rewards, "amax")
    degenerate_group = lo == hi
    if normalize_std:
        sq = torch.zeros(num_groups, device=dev).index_add_(0, group, centered.square() * weight)
        std = (sq / (counts - 1).clamp(min=1)).sqrt()
        centered = centered / (std[group] + eps)
    degenerate = degenerate_group[group]
    advantages = torch.where(degenerate, torch.zeros_like(centered), centered)
    return GroupAdvantages(
        advantages=advantages,
        degenerate=degenerate,
        num_groups=num_groups,
        num_degenerate_groups=int(degenerate_group.sum().item()),
    )


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
        """Share of tokens where the lower clip is active (A < 0 and r < 1 − clip_low)."""
        return self._get("clip_fraction_low")

    @property
    def clip_fraction_high(self) -> float:
        """Share of tokens where the upper clip is active (A > 0 and r > 1 + clip_high)."""
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
    """What the trainer needs from a loss (`tir_rl.trainer.loss.GRPOLoss` fits)."""

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


def _first_of_each_episode(group: Tensor, episode_ids: Tensor | None) -> Tensor:
    """[N] 1 at the first row of each (group, episode), 0 at the episode's other samples."""
    n = group.numel()
    if episode_ids is None or n == 0:
        return torch.ones(n)
    pairs = torch.stack([group.cpu(), episode_ids.cpu().to(torch.long)])
    _, episode = torch.unique(pairs, dim=1, return_inverse=True)
    rows = torch.arange(n)
    first = torch.full((int(episode.max()) + 1,), n).scatter_reduce(0, episode, rows, "amin")
    return torch.zeros(n).index_fill_(0, first, 1.0)


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand_as(like)
    assert advantages.shape == like.shape, f"advantages {advantages.shape} vs {like.shape}"
    return advantages


class GRPOLoss:
    """Token-level PPO-clip surrogate with asymmetric clip, optional k3 KL to a reference."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        """Configuration of the policy loss."""

        clip_low: float = 0.2
        """ε_lo: the ratio is clipped below at 1 − clip_low."""
        clip_high: float = 0.28
        """ε_hi: the ratio is clipped above at 1 + clip_high ("clip-higher", DAPO): a larger
        upper bound lets low-probability tokens with positive advantage grow, which keeps
        entropy from collapsing. Set 0.2 for the symmetric clip of the GRPO paper."""
        dual_clip: float | None = None
        """c > 1: for A < 0 the loss is also capped at −A·c (verl's dual clip uses 3)."""
        kl_coef: float = 0.0
        """β of the k3 KL to the reference policy (per model token, k3(ℓ^ref − ℓ^θ), never
        weighted by the mismatch correction); 0 (off) needs no reference. > 0 makes the
        trainer load a frozen reference (`trainer.reference_model`: the starting weights by
        default) and log `train/ref_kl`; degenerate groups then stay in the update (the KL
        term gives them gradient)."""
        aggregation: Aggregation = Aggregation.TOKEN_MEAN
        """Normalizer of the summed token losses; see `Aggregation`."""

        def validate(self) -> None:
            """Raise ConfigError on inconsistent values."""
            if not 0 <= self.clip_low < 1 or self.clip_high < 0:
                raise ConfigError(
                    f"loss clip_low must be in [0, 1) and clip_high >= 0, got "
                    f"{self.clip_low}, {self.clip_high}"
                )
            if self.dual_clip is not None and self.dual_clip <= 1:
                raise ConfigError(f"loss dual_clip must be > 1 (e.g. 3.0), got {self.dual_clip}")
            if self.kl_coef < 0:
                raise ConfigError(f"loss kl_coef must be >= 0, got {self.kl_coef}")

    def __init__(self, config: Config | None = None) -> None:
        self.config = config if config is not None else GRPOLoss.Config()
        self.config.validate()

    @property
    def needs_reference(self) -> bool:
        """Whether the loss has a KL term, so that its caller must pass `ref_logprobs`."""
        return self.config.kl_coef > 0

    def global_normalizer(self, *, num_tokens: int, num_sequences: int) -> int:
        """The D this loss divides by, given the global counts (see `aggregate`).

        A caller that sums unnormalized micro-batch losses (`num_global_tokens=1`,
        `num_global_sequences=1`) divides the summed gradient by this afterwards.
        """
        return global_normalizer(
            self.config.aggregation, num_tokens=num_tokens, num_sequences=num_sequences
        )

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
            The scalar loss and its metrics. Values at masked positions of every input (NaN,
            ±inf included) change neither the loss nor the gradient.
        """
        cfg = self.config
        valid = loss_mask > 0
        zero = torch.zeros_like(logprobs)
        lp = torch.where(valid, logprobs, zero)
        old = torch.where(valid, old_logprobs.detach(), zero)
        log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        adv = _broadcast_advantages(advantages.detach(), lp)
        adv = torch.where(valid, adv, zero)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        per_token = torch.maximum(unclipped, clipped)
        if cfg.dual_clip is not None:
            capped = torch.minimum(per_token, -adv * cfg.dual_clip)
            per_token = torch.where(adv < 0, capped, per_token)
        if weights is not None:
            per_token = per_token * torch.where(valid, weights.detach(), zero)
        ref_kl = None
        if cfg.kl_coef > 0:
            if ref_logprobs is None:
                raise ConfigError("loss.kl_coef > 0 needs ref_logprobs; pass them or set kl_coef 0")
            ref = torch.where(valid, ref_logprobs.detach(), zero)
            ref_kl = k3(ref - lp)
            per_token = per_token + cfg.kl_coef * ref_kl
        loss = aggregate(
            per_token,
            valid,
            cfg.aggregation,
            num_global_tokens=num_global_tokens,
            num_global_sequences=num_global_sequences,
        )
        with torch.no_grad():
            metrics = _metrics(loss, ratio, log_ratio, adv, valid, ref_kl, cfg)
        return loss, metrics


def _metrics(
    loss: Tensor,
    ratio: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    valid: Tensor,
    ref_kl: Tensor | None,
    cfg: GRPOLoss.Config,
) -> PolicyLossMetrics:
    n = valid.sum()
    denom = n.clamp(min=1)
    low = valid & (adv < 0) & (ratio < 1 - cfg.clip_low)
    high = valid & (adv > 0) & (ratio > 1 + cfg.clip_high)
    inf = torch.full_like(ratio, torch.inf)
    policy_kl = torch.where(valid, k3(-log_ratio), torch.zeros_like(ratio)).sum() / denom
    ref = (
        torch.where(valid, ref_kl, torch.zeros_like(ratio)).sum() / denom
        if ref_kl is not None
        else None
    )
    has = n > 0
    values = torch.stack(
        [
            loss.detach().float(),
            n.float(),
            low.sum() / denom,
            high.sum() / denom,
            torch.where(valid, ratio, torch.zeros_like(ratio)).sum() / denom,
            torch.where(has, torch.where(valid, ratio, inf).min(), ratio.new_ones(())),
            torch.where(has, torch.where(valid, ratio, -inf).max(), ratio.new_ones(())),
            policy_kl,
            ref if ref is not None else ratio.new_zeros(()),
        ]
    ).float()
    return PolicyLossMetrics(values)


class ReinforceLoss:
    """Bypass-mode REINFORCE (spec §4): L_t = −sg(w_t)·A·ℓ^θ_t, no ratio, no clip.

    The weights come from `tir_rl.mismatch.correction(ℓ^θ, ℓ^μ, ...)`, i.e. from the current
    policy against the sampler, and are detached here again: without the detach autograd
    would add ℓ^θ·∇w and bias the gradient.
    """

    @dataclass(kw_only=True, frozen=True)
    class Config:
        """Configuration of the bypass REINFORCE loss."""

        aggregation: Aggregation = Aggregation.TOKEN_MEAN
        """Normalizer of the summed token losses; see `Aggregation`."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config if config is not None else ReinforceLoss.Config()

    def global_normalizer(self, *, num_tokens: int, num_sequences: int) -> int:
        """The D this loss divides by, given the global counts (see `aggregate`).

        A caller that sums unnormalized micro-batch losses (`num_global_tokens=1`,
        `num_global_sequences=1`) divides the summed gradient by this afterwards.
        """
        return global_normalizer(
            self.config.aggregation, num_tokens=num_tokens, num_sequences=num_sequences
        )

    def __call__(
        self,
        logprobs: Tensor,
        *,
        advantages: Tensor,
        loss_mask: Tensor,
        weights: Tensor | None = None,
        num_global_tokens: int | None = None,
        num_global_sequences: int | None = None,
    ) -> Tensor:
        """Loss of one micro-batch; arguments as in `GRPOLoss.__call__`."""
        valid = loss_mask > 0
        zero = torch.zeros_like(logprobs)
        lp = torch.where(valid, logprobs, zero)
        adv = torch.where(valid, _broadcast_advantages(advantages.detach(), lp), zero)
        per_token = -adv * lp
        if weights is not None:
            per_token = per_token * torch.where(valid, weights.detach(), zero)
        return aggregate(
            per_token,
            valid,
            self.config.aggregation,
            num_global_tokens=num_global_tokens,
            num_global_sequences=num_global_sequences,
        )
