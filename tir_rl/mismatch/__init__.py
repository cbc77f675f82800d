"""Sampler/trainer logprob mismatch: detection metrics and detached corrections.

The public names live in two modules and are re-exported here:

- `tir_rl.mismatch.metrics`: `mismatch_metrics(...)`, logged every step under `mismatch/`;
- `tir_rl.mismatch.correction`: `MismatchCorrection` (with its `Config` and presets),
  `correction(...)` and `CorrectionResult`.

Typical decoupled use inside the trainer (ℓ^old recomputed, no grad)::

    metrics = mismatch_metrics(old_logprobs, sampler_logprobs, loss_mask, turn_ids)
    result = correction(old_logprobs, sampler_logprobs, loss_mask, turn_ids, config)
    num_global_tokens = all_reduce_sum(result.loss_mask.sum())   # the corrected mask
    loss, loss_metrics = GRPOLoss()(logprobs, old_logprobs=old_logprobs,
                                    advantages=advantages, loss_mask=result.loss_mask,
                                    weights=result.weights, num_global_tokens=num_global_tokens)

See `docs/mismatch.md` for what each metric means and which correction to pick.
"""

from tir_rl.mismatch.correction import (
    PRESET_NAMES,
    BypassMode,
    CorrectionPlan,
    CorrectionResult,
    CorrectionStats,
    ISLevel,
    MismatchCorrection,
    correction,
)
from tir_rl.mismatch.metrics import (
    distance_from_tool_response,
    masked_log_ratio,
    mismatch_metrics,
)

__all__ = [
    "BypassMode",
    "CorrectionPlan",
    "CorrectionResult",
    "CorrectionStats",
    "ISLevel",
    "MismatchCorrection",
    "PRESET_NAMES",
    "correction",
    "distance_from_tool_response",
    "masked_log_ratio",
    "mismatch_metrics",
]
