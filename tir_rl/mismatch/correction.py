"""Detached sampler/trainer mismatch corrections: IS weights and rejection masks (spec §3-§4).

Two mechanisms, both computed under no_grad from ℓ^old (ℓ^θ in bypass mode) and ℓ^μ:

- IS weights w (token, turn or sequence ratio, truncated at `is_cap`) multiply each token's
  clipped surrogate;
- rejections (token, turn, sequence and geometric-mean bounds; a catastrophic-token veto; the
  k2/k3 divergence filters) are combined with AND and folded into the loss mask.

Rejected tokens leave the loss normalizer (verl semantics): the trainer counts the global
number of tokens on the *corrected* mask and passes that mask to the policy loss. A
correction is per sequence (unless its weights are normalized over the batch), so the trainer
corrects each micro-batch's sequences once and builds the batch's result from those parts
(`CorrectionResult.assemble`): the mask the loss saw is the mask the normalizer counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from tir_rl.errors import ConfigError
from tir_rl.metric import Metric
from tir_rl.mismatch.metrics import clamped_exp, masked_log_ratio, turn_segments

Bounds = tuple[float, float]


class ISLevel(StrEnum):
    """Which likelihood ratio the IS weight of a token is."""

    NONE = "none"
    TOKEN = "token"
    """ρ_t of the token itself (Token-TIS)."""
    TURN = "turn"
    """Product of ρ over the token's assistant turn."""
    SEQUENCE = "sequence"
    """Product of ρ over the whole sequence (Seq-TIS)."""


class BypassMode(StrEnum):
    """Whether ℓ^old is recomputed (decoupled) or replaced by the sampler's ℓ^μ (bypass)."""

    OFF = "off"
    """Decoupled: PPO ratio against the trainer recompute, w from ℓ^old vs ℓ^μ."""
    PPO_CLIP = "ppo_clip"
    """ℓ^old := ℓ^μ; the policy loss with no extra weight (it would count the correction
    twice). Rejections still apply."""


_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "token_tis": {"is_level": ISLevel.TOKEN, "is_cap": 2.0},
    "token_mis": {"is_level": ISLevel.TOKEN, "is_cap": 5.0, "token_mask": (0.5, 5.0)},
    "seq_tis": {"is_level": ISLevel.SEQUENCE, "is_cap": 2.0},
    "seq_mis": {"is_level": ISLevel.SEQUENCE, "is_cap": 2.0, "seq_mask": (0.5, 2.0)},
    "geo_rs": {"geo_mask": (0.999, 1.001)},
    "turn_tis": {"is_level": ISLevel.TURN, "is_cap": 2.0},
    "turn_mis": {"is_level": ISLevel.TURN, "is_cap": 2.0, "turn_mask": (0.5, 2.0)},
    "geo_rs_token_tis": {"is_level": ISLevel.TOKEN, "is_cap": 2.0, "geo_mask": (0.999, 1.001)},
    "veto": {"veto_threshold": 1e-4},
}
_PRESETS["icepop"] = _PRESETS["token_mis"]
PRESET_NAMES = tuple(sorted(_PRESETS))
"""Names accepted by `MismatchCorrection.Config.preset`."""


@dataclass(frozen=True)
class CorrectionStats:
    """What a correction did to one batch (fractions over non-empty units)."""

    num_tokens: int
    """Model tokens before rejection."""
    num_tokens_kept: int
    masked_token_fraction: float
    masked_turn_fraction: float
    """Assistant turns with at least one rejected token."""
    masked_seq_fraction: float
    """Sequences with at least one rejected token."""
    veto_fraction: float
    """Sequences rejected by the catastrophic-token veto."""
    weight_mean: float
    """Stats of the final weights (after truncation, normalization) over kept tokens."""
    weight_std: float
    weight_min: float
    weight_max: float

    def to_dict(self, prefix: str = "mismatch/correction") -> dict[str, Metric]:
        """Flat metrics for the logger, keys `prefix/name`, declared for the rank reduction.

        The fractions are over the batch's model tokens (a rank's share weighs by its
        tokens), the weight statistics over the kept tokens.
        """
        tokens, kept = f"{prefix}/num_tokens", f"{prefix}/num_tokens_kept"
        return {
            tokens: Metric.count(self.num_tokens),
            kept: Metric.count(self.num_tokens_kept),
            f"{prefix}/masked_token_fraction": Metric.mean(self.masked_token_fraction, tokens),
            f"{prefix}/masked_turn_fraction": Metric.mean(self.masked_turn_fraction, tokens),
            f"{prefix}/masked_seq_fraction": Metric.mean(self.masked_seq_fraction, tokens),
            f"{prefix}/veto_fraction": Metric.mean(self.veto_fraction, tokens),
            f"{prefix}/weight_mean": Metric.mean(self.weight_mean, kept),
            f"{prefix}/weight_std": Metric.mean(self.weight_std, kept),
            f"{prefix}/weight_min": Metric.min(self.weight_min, kept),
            f"{prefix}/weight_max": Metric.max(self.weight_max, kept),
        }


@dataclass(frozen=True)
class CorrectionResult:
    """Detached weights and the loss mask with every rejection folded in, for some sequences."""

    weights: Tensor
    """[B, T] float32, no grad; 0 where the corrected mask is 0."""
    loss_mask: Tensor
    """[B, T], the input mask AND every rejection (same dtype as the input mask)."""
    vetoed: Tensor
    """[B] bool, sequences the catastrophic-token veto rejected."""
    model_mask: Tensor
    """[B, T], the mask before the correction (1 for model-sampled tokens)."""
    turn_ids: Tensor
    """[B, T] long, assistant turn index of each token."""

    @cached_property
    def stats(self) -> CorrectionStats:
        """What the correction did to these sequences (reads the values to the host)."""
        valid = self.model_mask > 0
        seg, num_segments = turn_segments(self.turn_ids, valid)
        return _stats(
            valid, self.loss_mask > 0, self.vetoed, self.weights, seg.flatten(), num_segments
        )

    @classmethod
    def assemble(
        cls,
        parts: list[tuple[Tensor, CorrectionResult]],
        model_mask: Tensor,
        turn_ids: Tensor,
    ) -> CorrectionResult:
        """One batch's result from the results of its sequences, corrected in parts.

        Args:
            parts: (sequence indices [b] long, the result of those sequences [b, ≤T]).
            model_mask: [B, T] the batch's mask before the correction.
            turn_ids: [B, T] the batch's turn indices.

        Sequences in no part get weight 0 and mask 0 (nothing of them entered the loss).
        """
        weights = torch.zeros(model_mask.shape, dtype=torch.float32)
        mask = torch.zeros_like(model_mask)
        vetoed = torch.zeros(model_mask.shape[0], dtype=torch.bool)
        for seqs, part in parts:
            seqs = seqs.cpu()
            width = part.weights.shape[1]
            weights[seqs, :width] = part.weights.detach().float().cpu()
            mask[seqs, :width] = part.loss_mask.cpu().to(mask.dtype)
            vetoed[seqs] = part.vetoed.cpu()
        return cls(weights, mask, vetoed, model_mask, turn_ids)


def _in(x: Tensor, bounds: Bounds) -> Tensor:
    return (x >= bounds[0]) & (x <= bounds[1])


class MismatchCorrection:
    """Computes `CorrectionResult`s for one configuration; see `Config.preset` for recipes."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        """One block configures the whole correction; the default only measures."""

        is_level: ISLevel = ISLevel.NONE
        """Ratio used as IS weight: none, token, turn (per assistant turn) or sequence."""
        is_cap: float = 2.0
        """C: weights are truncated to min(ρ, C) (verl's 2.0)."""
        is_cap_low: float | None = None
        """Optional lower truncation: w = max(w, is_cap_low) (TRL's clip_min); None: none."""
        token_mask: Bounds | None = None
        """Keep a token iff lo <= ρ_t <= hi (IcePop: 0.5, 5)."""
        turn_mask: Bounds | None = None
        """Keep a turn iff lo <= ∏_turn ρ <= hi; rejects only that turn's tokens."""
        seq_mask: Bounds | None = None
        """Keep a sequence iff lo <= ρ_seq <= hi."""
        geo_mask: Bounds | None = None
        """Keep a sequence iff lo <= ρ_geo = exp(mean δ) <= hi (length-invariant)."""
        veto_threshold: float | None = None
        """Reject a sequence with any token ρ_t < threshold (verl 0.6 used 1e-4)."""
        seq_max_k2: float | None = None
        """Reject a sequence with any token ½δ² above this (trust-region veto)."""
        seq_mean_k3: float | None = None
        """Reject a sequence whose mean k3 = ρ − δ − 1 is above this (verl 0.01)."""
        batch_normalize: bool = False
        """Divide the truncated weights by their mean over kept tokens/turns/sequences."""
        bypass: BypassMode = BypassMode.OFF
        """Decoupled (recompute ℓ^old) or bypass (ℓ^old := ℓ^μ); see `BypassMode`."""

        @classmethod
        def preset(cls, name: str, **overrides: Any) -> MismatchCorrection.Config:
            """A named recipe, optionally with some fields overridden.

            Names: none (metrics only), token_tis, token_mis (= icepop), seq_tis, seq_mis,
            geo_rs, turn_tis, turn_mis, veto (reject sequences holding a token with
            ρ < 1e-4), geo_rs_token_tis (recommended for long-horizon tool use, see
            docs/mismatch.md).
            """
            if name not in _PRESETS:
                raise ConfigError(
                    f"Unknown mismatch correction preset {name!r}; choose one of "
                    f"{', '.join(sorted(_PRESETS))}"
                )
            config = cls(**{**_PRESETS[name], **overrides})
            config.validate()
            return config

        def validate(self) -> None:
            """Raise ConfigError on inconsistent values."""
            if self.is_cap <= 0:
                raise ConfigError(f"correction is_cap must be > 0, got {self.is_cap}")
            if self.is_cap_low is not None and not 0 <= self.is_cap_low <= self.is_cap:
                raise ConfigError(
                    f"correction is_cap_low must be in [0, is_cap={self.is_cap}], "
                    f"got {self.is_cap_low}"
                )
            for name in ("token_mask", "turn_mask", "seq_mask", "geo_mask"):
                bounds = getattr(self, name)
                if bounds is not None and not (len(bounds) == 2 and 0 <= bounds[0] <= bounds[1]):
                    raise ConfigError(
                        f"correction {name} must be [lo, hi] with 0 <= lo <= hi, got {bounds}"
                    )

        @property
        def rejects(self) -> bool:
            """Whether this correction rejects a token of some sequence (`probe_effects`)."""
            return self.probe_effects()[1]

        @property
        def weighs(self) -> bool:
            """Whether this correction gives a kept token a weight other than 1."""
            return self.probe_effects()[0]

        def probe_effects(self) -> tuple[bool, bool]:
            """(weighs, rejects): what this correction does to a probe batch.

            Derived from what the correction does, not from a list of its fields: the probe's
            sequences have three turns each and per-token log-ratios from −12 to 12 (uniform,
            one turn off, one spike, alternating), which every weight and bound a correction
            can set reacts to.
            """
            delta = _probe_log_ratios()
            turns = torch.arange(delta.shape[1]).div(delta.shape[1] // 3, rounding_mode="floor")
            turns = turns.unsqueeze(0).expand_as(delta).contiguous()
            mask = torch.ones_like(delta)
            result = MismatchCorrection(self)(delta, torch.zeros_like(delta), mask, turns)
            weighs = bool((result.weights[result.loss_mask > 0] != 1).any())
            return weighs, bool((result.loss_mask == 0).any())

        def plan(self) -> CorrectionPlan:
            """How an update applies this correction (see `CorrectionPlan`)."""
            return CorrectionPlan(
                self,
                whole_batch_first=self.batch_normalize,
                proximal_is_sampler=self.bypass is BypassMode.PPO_CLIP,
            )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config if config is not None else MismatchCorrection.Config()
        self.config.validate()

    @torch.no_grad()
    def __call__(
        self,
        trainer_logprobs: Tensor,
        sampler_logprobs: Tensor,
        loss_mask: Tensor,
        turn_ids: Tensor,
    ) -> CorrectionResult:
        """Weights and corrected mask of a [B, T] batch.

        Args:
            trainer_logprobs: [B, T] ℓ^old (decoupled) or ℓ^θ (bypass; detached here).
            sampler_logprobs: [B, T] ℓ^μ; any value (NaN, ±inf) where the mask is 0.
            loss_mask: [B, T], 1 for model-sampled tokens.
            turn_ids: [B, T] long, assistant turn index of each token.
        """
        cfg = self.config
        valid = loss_mask > 0
        delta = masked_log_ratio(trainer_logprobs, sampler_logprobs, valid)  # [B, T], unclamped
        rho = clamped_exp(delta)
        num_tokens = valid.sum(dim=1)  # [B]
        seq_sum = delta.sum(dim=1)  # [B]
        rho_seq = clamped_exp(seq_sum)
        per_turn = cfg.turn_mask is not None or self._weight_level is ISLevel.TURN
        seg, rho_turn = None, None
        if per_turn:  # the segments read the number of turns on the host: only when used
            seg, num_segments = turn_segments(turn_ids, valid)
            turn_sum = torch.zeros(num_segments, device=delta.device).index_add_(
                0, seg.flatten(), delta.flatten()
            )
            rho_turn = clamped_exp(turn_sum)  # [B·K]

        keep = valid.clone()
        if cfg.token_mask is not None:
            keep &= _in(rho, cfg.token_mask)
        if cfg.turn_mask is not None:
            assert seg is not None and rho_turn is not None
            keep &= _in(rho_turn, cfg.turn_mask)[seg]
        seq_ok = torch.ones_like(num_tokens, dtype=torch.bool)
        if cfg.seq_mask is not None:
            seq_ok &= _in(rho_seq, cfg.seq_mask)
        if cfg.geo_mask is not None:
            rho_geo = clamped_exp(seq_sum / num_tokens.clamp(min=1))
            seq_ok &= _in(rho_geo, cfg.geo_mask)
        vetoed = torch.zeros_like(seq_ok)
        if cfg.veto_threshold is not None:
            vetoed |= (valid & (rho < cfg.veto_threshold)).any(dim=1)
        if cfg.seq_max_k2 is not None:
            seq_ok &= ~(valid & (0.5 * delta.square() > cfg.seq_max_k2)).any(dim=1)
        if cfg.seq_mean_k3 is not None:
            # True k3 (exp unclamped: an overflow to inf rejects the sequence, as it should).
            k3_token = torch.exp(delta) - delta - 1
            k3_sum = torch.where(valid, k3_token, torch.zeros_like(delta)).sum(dim=1)
            seq_ok &= k3_sum / num_tokens.clamp(min=1) <= cfg.seq_mean_k3
        keep &= (seq_ok & ~vetoed).unsqueeze(1)

        weights = self._weights(rho, rho_seq, rho_turn, seg, keep)
        return CorrectionResult(
            weights=weights,
            loss_mask=keep.to(loss_mask.dtype),
            vetoed=vetoed & valid.any(dim=1),
            model_mask=loss_mask,
            turn_ids=turn_ids,
        )

    @property
    def _weight_level(self) -> ISLevel:
        """The level the weights are taken at: none in bypass mode (the ratio already is one)."""
        cfg = self.config
        return ISLevel.NONE if cfg.bypass is BypassMode.PPO_CLIP else cfg.is_level

    def _weights(
        self,
        rho: Tensor,
        rho_seq: Tensor,
        rho_turn: Tensor | None,
        seg: Tensor | None,
        keep: Tensor,
    ) -> Tensor:
        cfg = self.config
        level = self._weight_level
        if level is ISLevel.NONE:
            return keep.float()

        def truncate(w: Tensor) -> Tensor:
            w = w.clamp(max=cfg.is_cap)
            return w.clamp(min=cfg.is_cap_low) if cfg.is_cap_low is not None else w

        if level is ISLevel.TOKEN:
            unit_w, unit_keep, per_token = truncate(rho), keep, None
        elif level is ISLevel.TURN:
            assert rho_turn is not None and seg is not None
            unit_keep = torch.zeros(rho_turn.shape, dtype=torch.bool, device=rho.device)
            unit_keep.index_put_((seg[keep],), torch.ones((), dtype=torch.bool, device=rho.device))
            unit_w, per_token = truncate(rho_turn), seg
        else:
            unit_w, unit_keep, per_token = truncate(rho_seq), keep.any(dim=1), None
        if cfg.batch_normalize and unit_keep.any():
            unit_w = unit_w / unit_w[unit_keep].mean()
        if level is ISLevel.TURN:
            weights = unit_w[per_token]
        elif level is ISLevel.SEQUENCE:
            weights = unit_w.unsqueeze(1).expand_as(rho)
        else:
            weights = unit_w
        return torch.where(keep, weights, torch.zeros_like(weights))


@dataclass(frozen=True)
class CorrectionPlan:
    """How an update applies a correction: what the trainer asks, so it decides nothing itself.

    The trainer's update runs per micro-batch; a correction is per sequence, so it runs there
    too, once per micro-batch, unless its weights are normalized over the whole batch
    (`whole_batch_first`).
    """

    config: MismatchCorrection.Config
    whole_batch_first: bool
    """The weights are normalized over the batch (`batch_normalize`): correct the whole
    batch, from a no-grad recompute of ℓ^old, before the update's micro-batches."""
    proximal_is_sampler: bool
    """Bypass `ppo_clip`: the loss's ℓ^old is the sampler's ℓ^μ, not the recompute."""

    def proximal(self, old: Tensor, sampler: Tensor) -> Tensor:
        """The ℓ^old the policy loss's ratio is taken against."""
        return sampler if self.proximal_is_sampler else old


def _probe_log_ratios() -> Tensor:
    """[S, 12] per-token log-ratios that cross every bound a correction can set."""
    levels = torch.tensor([-12.0, -6.0, -2.0, -0.5, -0.01, -1e-4, 0.0, 1e-4, 0.01, 0.5, 2.0, 6.0])
    rows = [torch.full((12,), float(v)) for v in levels]
    for v in levels:
        one_turn = torch.zeros(12)
        one_turn[4:8] = v
        spike = torch.zeros(12)
        spike[5] = v
        alternating = torch.tensor([v if i % 2 else -v for i in range(12)])
        rows += [one_turn, spike, alternating]
    return torch.stack(rows)


def _stats(
    valid: Tensor,
    keep: Tensor,
    vetoed: Tensor,
    weights: Tensor,
    flat_seg: Tensor,
    num_segments: int,
) -> CorrectionStats:
    num_valid = valid.sum()
    num_kept = keep.sum()
    rejected = valid & ~keep
    seq_has = valid.any(dim=1)
    num_seqs = seq_has.sum().clamp(min=1)
    seg_valid = torch.zeros(num_segments, device=valid.device).index_add_(
        0, flat_seg, valid.flatten().float()
    )
    seg_rejected = torch.zeros(num_segments, device=valid.device).index_add_(
        0, flat_seg, rejected.flatten().float()
    )
    num_turns = (seg_valid > 0).sum().clamp(min=1)
    w = weights[keep]
    if w.numel() == 0:
        w = torch.zeros(1, device=weights.device)
    values = torch.stack(
        [
            rejected.sum() / num_valid.clamp(min=1),
            (seg_rejected > 0).sum() / num_turns,
            rejected.any(dim=1).sum() / num_seqs,
            (vetoed & seq_has).sum() / num_seqs,
            w.mean(),
            (w - w.mean()).square().mean().sqrt(),
            w.min(),
            w.max(),
        ]
    ).tolist()
    return CorrectionStats(
        int(num_valid),
        int(num_kept),
        *values,
    )


def correction(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    config: MismatchCorrection.Config | None = None,
) -> CorrectionResult:
    """Functional form of `MismatchCorrection(config)(...)`; the default config only measures."""
    return MismatchCorrection(config)(trainer_logprobs, sampler_logprobs, loss_mask, turn_ids)
