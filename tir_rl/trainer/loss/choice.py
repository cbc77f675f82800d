"""The `loss` section of a run config, and the one place a policy loss is built from it.

`loss.name` picks the loss; each loss's own settings sit in the section named for it
(`loss.grpo`, `loss.dppo_tv`, ...), and the terms every loss shares (the KL penalty, the
aggregation) at the top. A setting in the section of a loss the run does not use is refused
at load, so it can never be silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from tir_rl.errors import ConfigError
from tir_rl.trainer.loss.base import Aggregation, LossTerms, PolicyLoss
from tir_rl.trainer.loss.cispo import CISPOLoss
from tir_rl.trainer.loss.dppo import DPPOBinaryKLLoss, DPPOBinaryTVLoss
from tir_rl.trainer.loss.grpo import GRPOLoss
from tir_rl.trainer.loss.gspo import GSPOLoss


class LossName(StrEnum):
    """The policy losses a run can train with."""

    GRPO = "grpo"
    """PPO's token ratio clip (`GRPOLoss`)."""
    DPPO_TV = "dppo_tv"
    """DPPO's trust region on the binary total variation (`DPPOBinaryTVLoss`)."""
    DPPO_KL = "dppo_kl"
    """DPPO's trust region on the binary KL divergence (`DPPOBinaryKLLoss`)."""
    GSPO = "gspo"
    """GSPO's length-normalized sequence ratio with a sequence clip (`GSPOLoss`)."""
    CISPO = "cispo"
    """CISPO's clipped, stop-gradient importance weight (`CISPOLoss`)."""


_DEFAULT_AGGREGATION = {LossName.GSPO: Aggregation.SEQUENCE_MEAN}
"""A loss whose paper defines another normalizer than token-mean (GSPO's objective is a mean
over sequences of each sequence's token mean)."""


@dataclass(kw_only=True)
class PolicyLossConfig:
    """The policy loss: which one (`name`), its own settings, and the shared terms."""

    name: LossName = LossName.GRPO
    """grpo, dppo_tv, dppo_kl, gspo or cispo (docs/mismatch.md has each formula)."""
    kl_coef: float = 0.0
    """β of the k3 KL to the reference policy (per model token, k3(ℓ^ref − ℓ^θ), never
    weighted by the mismatch correction); 0 (off) needs no reference. > 0 makes the trainer
    load a frozen reference (`trainer.reference_model`: the starting weights by default) and
    log `train/ref_kl`; degenerate groups then stay in the update (the KL term gives them
    gradient)."""
    aggregation: Aggregation | None = None
    """Normalizer of the summed token losses (token_mean or sequence_mean, see
    `Aggregation`). null: the loss's own, sequence_mean for gspo (its paper's objective) and
    token_mean for the others."""
    grpo: GRPOLoss.Config = field(default_factory=GRPOLoss.Config)
    """PPO's clip, used with name grpo."""
    dppo_tv: DPPOBinaryTVLoss.Config = field(default_factory=DPPOBinaryTVLoss.Config)
    """The binary-TV trust region, used with name dppo_tv."""
    dppo_kl: DPPOBinaryKLLoss.Config = field(default_factory=DPPOBinaryKLLoss.Config)
    """The binary-KL trust region, used with name dppo_kl."""
    gspo: GSPOLoss.Config = field(default_factory=GSPOLoss.Config)
    """GSPO's sequence clip, used with name gspo."""
    cispo: CISPOLoss.Config = field(default_factory=CISPOLoss.Config)
    """CISPO's weight clip, used with name cispo."""

    MOVED_KEYS: ClassVar[dict[str, tuple[str, str]]] = {
        "clip_low": ("grpo", "clip_low"),
        "clip_high": ("grpo", "clip_high"),
        "dual_clip": ("grpo", "dual_clip"),
    }
    """Keys that were at the top of `loss` before each loss had a section: a saved config
    of an older run still loads (`tir_rl.config.loading`)."""

    def validate(self) -> None:
        """Refuse bad values and settings made for a loss this run does not use."""
        self.terms.validate()
        for other in LossName:
            if other is self.name:
                continue
            given, default = getattr(self, other.value), type(getattr(self, other.value))()
            changed = [
                f.name
                for f in dataclasses.fields(given)
                if getattr(given, f.name) != getattr(default, f.name)
            ]
            if changed:
                keys = ", ".join(f"loss.{other.value}.{key}" for key in changed)
                raise ConfigError(
                    f"{keys} set, but loss.name is {self.name.value!r}: those settings belong "
                    f"to the {other.value} loss. Set loss.name={other.value} to use it, or drop "
                    "them."
                )
        self.section.validate()

    @property
    def section(self) -> object:
        """The chosen loss's own settings."""
        return getattr(self, self.name.value)

    @property
    def terms(self) -> LossTerms:
        """The shared terms, with the loss's own aggregation where none is given."""
        aggregation = self.aggregation
        if aggregation is None:
            aggregation = _DEFAULT_AGGREGATION.get(self.name, Aggregation.TOKEN_MEAN)
        return LossTerms(kl_coef=self.kl_coef, aggregation=aggregation)


def build_policy_loss(config: PolicyLossConfig) -> PolicyLoss:
    """The policy loss a run config names: the one place a loss is chosen."""
    terms = config.terms
    if config.name is LossName.GRPO:
        return GRPOLoss(config.grpo, terms)
    if config.name is LossName.DPPO_TV:
        return DPPOBinaryTVLoss(config.dppo_tv, terms)
    if config.name is LossName.DPPO_KL:
        return DPPOBinaryKLLoss(config.dppo_kl, terms)
    if config.name is LossName.GSPO:
        return GSPOLoss(config.gspo, terms)
    if config.name is LossName.CISPO:
        return CISPOLoss(config.cispo, terms)
    raise AssertionError(f"no loss built for {config.name}")
