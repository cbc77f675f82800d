"""Policy losses and the advantages they weigh; `loss.name` picks one (`choice`).

- `base`: what every loss shares (the call, its metrics, the KL term, the normalizer);
- `grpo`: PPO's ratio clip (the default);
- `dppo`: DPPO's trust region on the binary total variation or KL divergence;
- `gspo`: GSPO's length-normalized sequence ratio and sequence clip;
- `cispo`: CISPO's clipped, stop-gradient importance weight that drops no token;
- `choice`: the `loss` section of a run config and the one place a loss is built from it;
- `advantages`: group-relative advantages.
"""

from tir_rl.trainer.loss.advantages import GroupAdvantages, group_advantages
from tir_rl.trainer.loss.base import (
    LOSS_METRICS,
    LOSS_TOKENS,
    Aggregation,
    LossTerms,
    PolicyLoss,
    PolicyLossMetrics,
    k3,
)
from tir_rl.trainer.loss.choice import LossName, PolicyLossConfig, build_policy_loss
from tir_rl.trainer.loss.cispo import CISPOLoss
from tir_rl.trainer.loss.dppo import DPPOBinaryKLLoss, DPPOBinaryTVLoss
from tir_rl.trainer.loss.grpo import GRPOLoss
from tir_rl.trainer.loss.gspo import GSPOLoss

__all__ = [
    "LOSS_METRICS",
    "LOSS_TOKENS",
    "Aggregation",
    "CISPOLoss",
    "DPPOBinaryKLLoss",
    "DPPOBinaryTVLoss",
    "GRPOLoss",
    "GSPOLoss",
    "GroupAdvantages",
    "LossName",
    "LossTerms",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossMetrics",
    "build_policy_loss",
    "group_advantages",
    "k3",
]
