"""Sampler/trainer logprob mismatch metrics over model tokens (spec `docs/mismatch.md` §2).

δ_t = ℓ^trainer_t − ℓ^sampler_t on model tokens (m_t = 1), 0 elsewhere; ρ_t = exp(δ_t).
Garbage at masked positions (0.0, NaN, ±inf) is replaced with `torch.where` before any
reduction, so it can never leak. Metrics are computed in float64 on the unclamped δ, so a
huge gap (|δ| = 30) is reported as it is; only the argument of `exp` is clamped, to
±`METRIC_EXP_BOUND`, where float64 would overflow. The ±20 bound of the IS weights belongs to
the correction (`correction.py`), never to these statistics.

Besides the usual batch metrics this reports the same divergences per assistant turn and by
distance (in model tokens) from the end of the last tool response, and the share of the total
|δ| carried by the top 1% of tokens: in multi-turn tool use, mismatch concentrates in the first
tokens after a surprising tool output.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tir_rl.metric import Metric, ReduceOp

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to [−20, 20] before `exp` (verl `SAFETY_BOUND`), here and in the
policy loss (`tir_rl.trainer.loss`)."""
METRIC_EXP_BOUND = 300.0
"""Metrics clamp log-ratios to this before `exp`: exp(2 · 300) is still finite in float64."""
LOG_PPL_BOUND = 50.0
"""Log-perplexities are clamped to this before `exp` (a perplexity of 5e21 means garbage)."""
DEFAULT_DISTANCE_EDGES = (8, 32, 128)
"""Distance buckets 0-7, 8-31, 32-127, 128+ model tokens after the last tool response."""


def masked_log_ratio(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    valid: Tensor,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """δ = trainer − sampler on valid tokens, exactly 0 elsewhere, not clamped.

    A non-finite difference on a valid token (a NaN or −inf logprob from a broken engine)
    becomes 0 for NaN and ±20 for ±inf; `count_nonfinite` reports how many there were.
    Callers clamp before `exp` (`clamped_exp`), never δ itself.
    """
    zero = torch.zeros_like(trainer_logprobs, dtype=dtype)
    t = torch.where(valid, trainer_logprobs.detach().to(dtype), zero)
    s = torch.where(valid, sampler_logprobs.detach().to(dtype), zero)
    return torch.nan_to_num(t - s, nan=0.0, posinf=LOG_RATIO_BOUND, neginf=-LOG_RATIO_BOUND)


def count_nonfinite(trainer_logprobs: Tensor, sampler_logprobs: Tensor, valid: Tensor) -> Tensor:
    """Number of valid tokens whose trainer or sampler logprob is not finite (0-d tensor)."""
    bad = ~torch.isfinite(trainer_logprobs.detach()) | ~torch.isfinite(sampler_logprobs.detach())
    return (bad & valid).sum()


def clamped_exp(x: Tensor) -> Tensor:
    """exp(clamp(x, −20, 20)): the guard of IS weights."""
    return torch.exp(x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def metric_exp(x: Tensor) -> Tensor:
    """exp(x) clamped only where float64 would overflow (see `METRIC_EXP_BOUND`)."""
    return torch.exp(x.clamp(-METRIC_EXP_BOUND, METRIC_EXP_BOUND))


def binary_divergences(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor]:
    """DPPO's per-token divergences of the trainer from the sampler, float64, 0 where not valid.

    Each token's distribution is taken as two outcomes, the sampled token (probability
    p = exp(ℓ^trainer), q = exp(ℓ^sampler)) and any other: the binary total variation |p − q|
    and the binary KL(q ‖ p) = q·log(q/p) + (1 − q)·log((1 − q + 1e-8)/(1 − p + 1e-8)), the
    divergences DPPO's trust region bounds (`tir_rl.trainer.loss.dppo`).
    """
    zero = torch.zeros_like(trainer_logprobs, dtype=torch.float64)
    lp = torch.where(valid, trainer_logprobs.detach().double(), zero)
    ls = torch.where(valid, sampler_logprobs.detach().double(), zero)
    lp = torch.nan_to_num(lp, nan=0.0, neginf=-LOG_PPL_BOUND).clamp(max=0.0)
    ls = torch.nan_to_num(ls, nan=0.0, neginf=-LOG_PPL_BOUND).clamp(max=0.0)
    p, q = torch.exp(lp), torch.exp(ls)
    kl = q * (ls - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return torch.where(valid, (p - q).abs(), zero), torch.where(valid, kl, zero)


def turn_segments(turn_ids: Tensor, valid: Tensor) -> tuple[Tensor, int]:
    """Index of each token's (sequence, assistant turn) segment.

    Returns:
        [B, T] long segment ids in [0, B·K) with K = 1 + the largest turn id of a valid token
        (invalid positions get segment 0 of their row and must stay masked), and B·K.
    """
    batch = turn_ids.shape[0]
    turns = torch.where(valid, turn_ids, torch.zeros_like(turn_ids)).clamp(min=0)
    num_turns = int(turns.max()) + 1 if turns.numel() else 1
    rows = torch.arange(batch, device=turn_ids.device).unsqueeze(1)
    return rows * num_turns + turns, batch * num_turns


def distance_from_tool_response(turn_ids: Tensor, valid: Tensor) -> Tensor:
    """Model tokens since the end of the last tool response, −1 before any tool response.

    A sequence's first assistant turn follows no tool response (−1); every later turn does,
    and its first sampled token has distance 0. Counted in model tokens only, so the length
    of the tool output and of the chat-format tokens in between does not matter.
    """
    seg, num_segments = turn_segments(turn_ids, valid)
    before = torch.cumsum(valid.long(), dim=1) - 1  # [B, T] model tokens before this one
    big = torch.iinfo(torch.long).max
    fill = torch.full_like(before, big)
    start = torch.full((num_segments,), big, dtype=torch.long, device=seg.device)
    start = start.scatter_reduce(
        0, seg.flatten(), torch.where(valid, before, fill).flatten(), "amin"
    )
    distance = before - start[seg]
    turns = torch.where(valid, turn_ids, torch.full_like(turn_ids, big))
    first_turn = turns.min(dim=1, keepdim=True).values
    return torch.where(valid & (turn_ids != first_turn), distance, torch.full_like(distance, -1))


_TOKENS, _SEQS = "num_tokens", "num_seqs"
"""The counts (keys under the prefix) the metrics are taken over."""


class _Row:
    """The batch's metrics, each declared with how it combines across ranks where it is set.

    The values stay tensors until `declared` reads them all in one host copy.
    """

    def __init__(self) -> None:
        self.values: dict[str, tuple[Tensor, ReduceOp, str | None]] = {}

    def mean(self, name: str, value: Tensor, over: str = _TOKENS) -> None:
        self.values[name] = (value, ReduceOp.MEAN, over)

    def max(self, name: str, value: Tensor, over: str = _TOKENS) -> None:
        self.values[name] = (value, ReduceOp.MAX, over)

    def min(self, name: str, value: Tensor, over: str = _TOKENS) -> None:
        self.values[name] = (value, ReduceOp.MIN, over)

    def count(self, name: str, value: Tensor) -> None:
        self.values[name] = (value, ReduceOp.SUM, None)

    def declared(self, prefix: str) -> dict[str, Metric]:
        """`{prefix}/name: Metric`, the counts they are over under the same prefix."""
        if not self.values:
            return {}
        floats = torch.stack([v.double().reshape(()) for v, _, _ in self.values.values()])
        out: dict[str, Metric] = {}
        for (name, (_, reduce, over)), value in zip(
            self.values.items(), floats.tolist(), strict=True
        ):
            out[f"{prefix}/{name}"] = Metric(value, reduce, f"{prefix}/{over}" if over else None)
        return out


def _moment_stats(w: Tensor, cap: float, name: str, over: str, row: _Row) -> None:
    """IS weight stats of the 1-D weights `w`: mean/min/max raw; std/ESS on [1/C, C]."""
    n = w.numel()
    if n == 0:
        w = torch.ones(1, dtype=w.dtype, device=w.device)
    capped = w.clamp(1.0 / cap, cap)
    mean_c = capped.mean()
    normalized = capped / mean_c
    row.mean(f"{name}_mean", w.mean(), over)
    row.mean(f"{name}_std", (capped - mean_c).square().mean().sqrt(), over)
    row.min(f"{name}_min", w.min(), over)
    row.max(f"{name}_max", w.max(), over)
    row.mean(f"{name}_ess", 1.0 / normalized.square().mean(), over)
    high = (w > cap).double().mean() if n else w.new_zeros(())
    low = (w < 1.0 / cap).double().mean() if n else w.new_zeros(())
    row.mean(f"{name}_fraction_high", high, over)
    row.mean(f"{name}_fraction_low", low, over)


def _bucket_table(bucket: Tensor, num_buckets: int, columns: Tensor) -> Tensor:
    """Per-bucket sums of `columns` [n, k] plus a count column: [num_buckets, k + 1]."""
    ones = torch.ones(columns.shape[0], 1, dtype=columns.dtype, device=columns.device)
    table = torch.zeros(
        num_buckets, columns.shape[1] + 1, dtype=columns.dtype, device=columns.device
    )
    return table.index_add_(0, bucket, torch.cat([columns, ones], dim=1))


def _emit_buckets(table: Tensor, labels: list[str], prefix: str, out: dict[str, Metric]) -> None:
    for label, (neg_delta, k3_sum, abs_sum, count) in zip(labels, table.tolist(), strict=True):
        if count == 0:
            continue
        tokens = f"{prefix}/{label}/num_tokens"
        out[f"{prefix}/{label}/kl"] = Metric.mean(neg_delta / count, tokens)
        out[f"{prefix}/{label}/k3_kl"] = Metric.mean(k3_sum / count, tokens)
        out[f"{prefix}/{label}/abs_diff_mean"] = Metric.mean(abs_sum / count, tokens)
        out[tokens] = Metric.count(count)


def mismatch_metrics(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    tool_response_distance: Tensor | None = None,
    cap: float = 2.0,
    max_turns: int = 8,
    distance_edges: tuple[int, ...] = DEFAULT_DISTANCE_EDGES,
    top_fraction: float = 0.01,
    prefix: str = "mismatch",
) -> dict[str, Metric]:
    """Every §2 metric of the spec, plus per-turn, per-distance and concentration metrics.

    Args:
        trainer_logprobs: [B, T] ℓ^old (or ℓ^θ, to measure mismatch plus policy drift).
        sampler_logprobs: [B, T] ℓ^μ; any value where `loss_mask` is 0.
        loss_mask: [B, T], 1 for model-sampled tokens (not the corrected mask).
        turn_ids: [B, T] long, assistant turn index of each token.
        tool_response_distance: [B, T] long, overrides the distance derived from
            `turn_ids` (negative: no tool response before the token).
        cap: C of the IS weight stats (std/ESS on weights clamped to [1/C, C];
            fraction_high/low count ρ > C and ρ < 1/C).
        max_turns: turns 0..max_turns−1 get their own keys, later turns share `turn_{max}+`.
        distance_edges: bucket edges of the distance metrics.
        top_fraction: the concentration metric's share of tokens (0.01: top 1%).
        prefix: namespace of every key.

    Returns:
        `{prefix}/name: value`, all finite, each a `Metric` that declares how it combines
        across ranks. Per-turn/per-distance keys exist only for buckets with tokens.
    """
    valid = loss_mask > 0
    delta = masked_log_ratio(trainer_logprobs, sampler_logprobs, valid, torch.float64)  # [B, T]
    rho = metric_exp(delta)
    k3 = rho - delta - 1
    num_tokens = valid.sum(dim=1)  # [B]
    has_tokens = num_tokens > 0
    n_total = num_tokens.sum().clamp(min=1)
    row = _Row()

    def token_mean(x: Tensor) -> Tensor:
        return torch.where(valid, x, torch.zeros_like(x)).sum() / n_total

    row.mean("kl", token_mean(-delta))
    row.mean("k3_kl", token_mean(k3))
    row.mean("chi2_token", token_mean(metric_exp(2 * delta)) - 1)
    abs_delta = delta.abs()
    row.mean("abs_diff_mean", token_mean(abs_delta))
    row.max("abs_diff_max", abs_delta.max() if abs_delta.numel() else abs_delta.new_zeros(()))
    row.mean("token_mult_prob_error", token_mean(metric_exp(abs_delta)))
    tv, kl = binary_divergences(trainer_logprobs, sampler_logprobs, valid)
    row.mean("binary_tv", token_mean(tv))
    row.mean("binary_kl", token_mean(kl))

    # Sequence level: means over sequences with at least one model token.
    n_seq = has_tokens.sum().clamp(min=1)
    per_seq_n = num_tokens.clamp(min=1).double()

    def seq_mean(x: Tensor) -> Tensor:
        return torch.where(has_tokens, x, torch.zeros_like(x)).sum() / n_seq

    for name, logprobs in (("training", trainer_logprobs), ("rollout", sampler_logprobs)):
        lp = torch.where(valid, logprobs.detach().double(), torch.zeros_like(delta))
        lp = torch.nan_to_num(lp, nan=0.0, posinf=0.0, neginf=-1e4)
        log_ppl = (-lp.sum(dim=1) / per_seq_n).clamp(-LOG_PPL_BOUND, LOG_PPL_BOUND)
        row.mean(f"{name}_log_ppl", seq_mean(log_ppl), _SEQS)
        row.mean(f"{name}_ppl", seq_mean(torch.exp(log_ppl)), _SEQS)
    seq_sum = delta.sum(dim=1)  # S
    log_ppl_diff = -seq_sum / per_seq_n  # mean ℓ^μ − mean ℓ^old, per sequence
    row.mean("log_ppl_diff", seq_mean(log_ppl_diff), _SEQS)
    row.mean("log_ppl_abs_diff", seq_mean(log_ppl_diff.abs()), _SEQS)
    kept = log_ppl_diff[has_tokens]
    row.max("log_ppl_diff_max", kept.max() if kept.numel() else kept.new_zeros(()), _SEQS)
    row.min("log_ppl_diff_min", kept.min() if kept.numel() else kept.new_zeros(()), _SEQS)
    row.mean("ppl_ratio", seq_mean(metric_exp(log_ppl_diff)), _SEQS)
    rho_seq = metric_exp(seq_sum)
    row.mean("chi2_seq", seq_mean(metric_exp(2 * seq_sum)) - 1, _SEQS)

    _moment_stats(rho[valid], cap, "is_token", _TOKENS, row)
    _moment_stats(rho_seq[has_tokens], cap, "is_seq", _SEQS, row)
    row.count(_TOKENS, num_tokens.sum())
    row.count(_SEQS, has_tokens.sum())
    row.count("nonfinite_tokens", count_nonfinite(trainer_logprobs, sampler_logprobs, valid))

    flat_abs = abs_delta[valid]
    num_top = max(1, math.ceil(top_fraction * flat_abs.numel())) if flat_abs.numel() else 0
    total_abs = flat_abs.sum()
    top = torch.topk(flat_abs, num_top).values.sum() if num_top else flat_abs.new_zeros(())
    share = torch.where(total_abs > 0, top / total_abs.clamp(min=1e-30), total_abs.new_zeros(()))
    row.mean(f"top{_percent(top_fraction)}pct_abs_diff_share", share)
    result = row.declared(prefix)

    columns = torch.stack([-delta[valid], k3[valid], abs_delta[valid]], dim=1)  # [n, 3]
    turn = turn_ids[valid].clamp(0, max_turns)
    turn_labels = [f"turn_{k}" for k in range(max_turns)] + [f"turn_{max_turns}+"]
    _emit_buckets(_bucket_table(turn, max_turns + 1, columns), turn_labels, prefix, result)

    if tool_response_distance is None:
        tool_response_distance = distance_from_tool_response(turn_ids, valid)
    distance = tool_response_distance[valid]
    edges = torch.tensor(distance_edges, dtype=distance.dtype, device=distance.device)
    bucket = torch.where(distance < 0, 0, torch.bucketize(distance, edges, right=True) + 1)
    lows = (0, *distance_edges)
    dist_labels = ["tool_dist_none"] + [
        f"tool_dist_{lo}-{hi - 1}" for lo, hi in zip(lows[:-1], distance_edges, strict=True)
    ]
    dist_labels.append(f"tool_dist_{distance_edges[-1]}+")
    _emit_buckets(_bucket_table(bucket, len(dist_labels), columns), dist_labels, prefix, result)
    return result


def _percent(fraction: float) -> str:
    value = fraction * 100
    return f"{value:g}"
