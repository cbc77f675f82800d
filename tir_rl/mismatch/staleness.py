"""Staleness: how many policy versions a token lags the weights it is trained from.

A token sampled by the weights of version v and trained from version V has lag V − v. Lag 0
is on-policy up to numerics; lag > 0 adds the policy's own drift to the gap between ℓ^old
(the trainer's recompute, at V) and the sampler's ℓ^μ (at v). Reporting the mismatch metrics
apart for the two tells numerical mismatch from staleness: with lag 0 the gap is the
engine's and trainer's numerics alone.

Keys: `staleness/lag_mean`, `staleness/lag_max`, `staleness/stale_token_fraction` over model
tokens with a recorded version, the same per assistant turn (`staleness/turn_K/...`), and
`mismatch/lag_0/...`, `mismatch/lag_1+/...` (kl, k3_kl, abs_diff_mean, abs_diff_max,
num_tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tir_rl.mismatch.metrics import masked_log_ratio, metric_exp
from tir_rl.types import UNVERSIONED

_LAG_BUCKETS = (("lag_0", 0, 0), ("lag_1+", 1, None))


def token_lags(policy_versions: Tensor, trained_version: int) -> Tensor:
    """[B, T] long: `trained_version` − each token's version; −1 where none is recorded."""
    recorded = policy_versions != UNVERSIONED
    lag = trained_version - policy_versions
    return torch.where(recorded, lag, torch.full_like(lag, -1))


def staleness_metrics(
    lags: Tensor, loss_mask: Tensor, turn_ids: Tensor, *, max_turns: int = 8
) -> dict[str, float]:
    """Lag statistics over model tokens with a recorded version (none: an empty dict).

    Args:
        lags: [B, T] long from `token_lags` (−1: no version recorded).
        loss_mask: [B, T], 1 for model-sampled tokens.
        turn_ids: [B, T] long, assistant turn of each token.
        max_turns: turns 0..max_turns−1 get their own keys, later ones `turn_{max}+`.
    """
    valid = (loss_mask > 0) & (lags >= 0)
    values = lags[valid].double()
    if values.numel() == 0:
        return {}
    out = {
        "staleness/lag_mean": float(values.mean()),
        "staleness/lag_max": float(values.max()),
        "staleness/stale_token_fraction": float((values > 0).double().mean()),
        "staleness/num_tokens": float(values.numel()),
    }
    turns = turn_ids[valid].clamp(0, max_turns)
    for turn in torch.unique(turns).tolist():
        label = f"turn_{turn}" if turn < max_turns else f"turn_{max_turns}+"
        in_turn = values[turns == turn]
        out[f"staleness/{label}/lag_mean"] = float(in_turn.mean())
        out[f"staleness/{label}/lag_max"] = float(in_turn.max())
    return out


def mismatch_by_lag(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, lags: Tensor
) -> dict[str, float]:
    """The mismatch's main divergences over lag-0 tokens and over stale ones, apart.

    Buckets without tokens are left out. δ = ℓ^trainer − ℓ^sampler as in `mismatch_metrics`.
    """
    out: dict[str, float] = {}
    for label, low, high in _LAG_BUCKETS:
        in_bucket = (loss_mask > 0) & (lags >= low)
        if high is not None:
            in_bucket &= lags <= high
        count = int(in_bucket.sum())
        if count == 0:
            continue
        delta = masked_log_ratio(trainer_logprobs, sampler_logprobs, in_bucket, torch.float64)
        delta = delta[in_bucket]
        k3 = metric_exp(delta) - delta - 1
        prefix = f"mismatch/{label}"
        out[f"{prefix}/kl"] = float((-delta).mean())
        out[f"{prefix}/k3_kl"] = float(k3.mean())
        out[f"{prefix}/abs_diff_mean"] = float(delta.abs().mean())
        out[f"{prefix}/abs_diff_max"] = float(delta.abs().max())
        out[f"{prefix}/num_tokens"] = float(count)
    return out
