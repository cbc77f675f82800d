import math

import pytest
import torch

from tir_rl.mismatch import distance_from_tool_response, mismatch_metrics
from tir_rl.mismatch.metrics import METRIC_EXP_BOUND

NAN, INF = float("nan"), float("inf")


def mean(xs):
    return sum(xs) / len(xs)


def test_hand_computed_2x3_example_checks_every_formula():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 7.0]])
    sampler = torch.tensor([[-1.1, -1.8, -0.5], [-0.5, -1.2, NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    turns = torch.tensor([[0, 0, 1], [0, 0, 0]])
    cap = 1.1
    got = mismatch_metrics(trainer, sampler, mask, turns, cap=cap)

    t = [trainer[0, 0], trainer[0, 1], trainer[0, 2], trainer[1, 0], trainer[1, 1]]
    s = [sampler[0, 0], sampler[0, 1], sampler[0, 2], sampler[1, 0], sampler[1, 1]]
    d = [(a - b).item() for a, b in zip(t, s, strict=True)]  # ≈ [0.1, -0.2, 0, 0.2, 0]
    rho = [math.exp(x) for x in d]
    seqs = [[0, 1, 2], [3, 4]]
    big_s = [sum(d[i] for i in q) for q in seqs]
    lpd = [-big_s[k] / len(q) for k, q in enumerate(seqs)]
    train_lp = [-mean([t[i].item() for i in q]) for q in seqs]
    roll_lp = [-mean([s[i].item() for i in q]) for q in seqs]

    def weight_stats(w):
        c = [min(max(x, 1 / cap), cap) for x in w]
        mc = mean(c)
        return {
            "mean": mean(w),
            "min": min(w),
            "max": max(w),
            "std": math.sqrt(mean([x * x for x in c]) - mc * mc),
            "ess": 1 / mean([(x / mc) ** 2 for x in c]),
            "fraction_high": mean([x > cap for x in w]),
            "fraction_low": mean([x < 1 / cap for x in w]),
        }

    expected = {
        "kl": mean([-x for x in d]),
        "k3_kl": mean([r - x - 1 for r, x in zip(rho, d, strict=True)]),
        "chi2_token": mean([r * r for r in rho]) - 1,
        "abs_diff_mean": mean([abs(x) for x in d]),
        "abs_diff_max": max(abs(x) for x in d),
        "token_mult_prob_error": mean([math.exp(abs(x)) for x in d]),
        "training_log_ppl": mean(train_lp),
        "training_ppl": mean([math.exp(x) for x in train_lp]),
        "rollout_log_ppl": mean(roll_lp),
        "rollout_ppl": mean([math.exp(x) for x in roll_lp]),
        "log_ppl_diff": mean(lpd),
        "log_ppl_abs_diff": mean([abs(x) for x in lpd]),
        "log_ppl_diff_max": max(lpd),
        "log_ppl_diff_min": min(lpd),
        "ppl_ratio": mean([math.exp(x) for x in lpd]),
        "chi2_seq": mean([math.exp(2 * x) for x in big_s]) - 1,
        "num_tokens": 5,
        "num_seqs": 2,
        "nonfinite_tokens": 0,
        "top1pct_abs_diff_share": max(abs(x) for x in d) / sum(abs(x) for x in d),
        "turn_0/kl": mean([-d[0], -d[1], -d[3], -d[4]]),
        "turn_0/num_tokens": 4,
        "turn_1/kl": -d[2],
        "turn_1/abs_diff_mean": abs(d[2]),
        "turn_1/num_tokens": 1,
        "tool_dist_none/num_tokens": 4,
        "tool_dist_0-7/num_tokens": 1,
        "tool_dist_0-7/k3_kl": rho[2] - d[2] - 1,
    }
    for level, w in (("token", rho), ("seq", [math.exp(x) for x in big_s])):
        for name, value in weight_stats(w).items():
            expected[f"is_{level}_{name}"] = value
    assert expected["is_token_fraction_high"] == 0.4 and expected["is_seq_fraction_low"] == 0.5
    for key, value in expected.items():
        assert got[f"mismatch/{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert all(k.startswith("mismatch/") for k in got)


def test_identical_logprobs_give_zero_divergence_and_full_ess():
    lp = -torch.rand(4, 12, generator=torch.Generator().manual_seed(0)) * 4
    mask = (torch.rand(4, 12, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    turns = torch.arange(12).repeat(4, 1) // 4
    got = mismatch_metrics(lp, lp.clone(), mask, turns)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq", "abs_diff_max", "log_ppl_diff"):
        assert got[f"mismatch/{key}"] == 0.0, key
    for key in ("ppl_ratio", "is_token_ess", "is_seq_ess", "is_token_mean", "is_seq_max"):
        assert got[f"mismatch/{key}"] == 1.0, key
    assert got["mismatch/training_ppl"] == got["mismatch/rollout_ppl"]


def test_trainer_above_sampler_gives_ratio_above_one_and_negative_kl():
    sampler = torch.full((1, 4), -2.0)
    got = mismatch_metrics(sampler + 0.3, sampler, torch.ones(1, 4), torch.zeros(1, 4).long())
    assert got["mismatch/is_token_min"] > 1 and got["mismatch/is_seq_mean"] > 1
    assert got["mismatch/kl"] < 0 and got["mismatch/log_ppl_diff"] < 0


def test_overflowing_log_ratios_keep_every_metric_finite():
    sampler = torch.full((3, 10), -5.0)
    trainer = sampler.clone()
    trainer[0] += 50.0  # S = +500
    trainer[1] -= 50.0  # S = -500
    sampler[2, 3] = -INF  # a broken engine value on a model token
    got = mismatch_metrics(trainer, sampler, torch.ones(3, 10), torch.zeros(3, 10).long())
    assert all(math.isfinite(v) for v in got.values()), {k: v for k, v in got.items()}
    # Only exp's argument is clamped, and only where float64 would overflow.
    assert got["mismatch/is_seq_max"] == pytest.approx(math.exp(METRIC_EXP_BOUND), rel=1e-9)
    assert got["mismatch/is_token_min"] == pytest.approx(math.exp(-50), rel=1e-9)
    assert got["mismatch/abs_diff_max"] == pytest.approx(50)
    assert got["mismatch/nonfinite_tokens"] == 1


def _rows_with_tool_tokens(*, garbage: bool):
    """The same three trajectories, with garbage tool/pad tokens or with them deleted."""
    gen = torch.Generator().manual_seed(5)
    rows = []
    for length, turn_lengths in ((9, (4, 5)), (6, (6,)), (12, (3, 3, 6))):
        trainer = -torch.rand(length, generator=gen) * 3
        sampler = trainer + 0.2 * torch.randn(length, generator=gen)
        turns = torch.cat([torch.full((n,), k) for k, n in enumerate(turn_lengths)])
        rows.append((trainer, sampler, turns, turn_lengths))
    width = 30
    out = {k: [] for k in ("trainer", "sampler", "mask", "turns")}
    junk = [NAN, INF, -INF, 0.0, 3.0]
    for trainer, sampler, turns, turn_lengths in rows:
        tr, sa, ma, tu = [], [], [], []
        start = 0
        for k, n in enumerate(turn_lengths):
            if k > 0 and garbage:  # a tool response between turns, attributed to turn k-1
                for j in range(3):
                    tr.append(junk[j]), sa.append(junk[-1 - j]), ma.append(0), tu.append(k - 1)
            tr += trainer[start : start + n].tolist()
            sa += sampler[start : start + n].tolist()
            ma += [1] * n
            tu += turns[start : start + n].tolist()
            start += n
        pad = width - len(tr)
        filler = [NAN] * pad if garbage else [0.0] * pad
        tr += filler
        sa += filler[::-1] if garbage else filler
        ma += [0] * pad
        tu += [tu[-1]] * pad
        for key, values in zip(out, (tr, sa, ma, tu), strict=True):
            out[key].append(values)
    return (
        torch.tensor(out["trainer"]),
        torch.tensor(out["sampler"]),
        torch.tensor(out["mask"], dtype=torch.float32),
        torch.tensor(out["turns"]),
    )


def test_garbage_on_tool_and_pad_tokens_equals_deleting_them():
    clean = mismatch_metrics(*_rows_with_tool_tokens(garbage=False))
    dirty = mismatch_metrics(*_rows_with_tool_tokens(garbage=True))
    assert clean.keys() == dirty.keys()
    for key in clean:
        assert dirty[key] == pytest.approx(clean[key], rel=1e-6, abs=1e-7), key
    assert clean["mismatch/num_tokens"] == 27


def test_distance_counts_model_tokens_since_the_last_tool_response():
    # turn 0: 3 tokens | tool: 2 | turn 1: 10 | tool: 4 | turn 2: 40 | padding: 5
    segments = [(0, 1, 3), (0, 0, 2), (1, 1, 10), (1, 0, 4), (2, 1, 40), (2, 0, 5)]
    turns = torch.tensor([[t for t, _, n in segments for _ in range(n)]])
    mask = torch.tensor([[float(m) for _, m, n in segments for _ in range(n)]])
    distance = distance_from_tool_response(turns, mask > 0)[mask > 0]
    assert distance.tolist() == [-1] * 3 + list(range(10)) + list(range(40))
    got = mismatch_metrics(mask.clone(), mask.clone(), mask, turns, max_turns=2)
    assert got["mismatch/tool_dist_none/num_tokens"] == 3
    assert got["mismatch/tool_dist_0-7/num_tokens"] == 16
    assert got["mismatch/tool_dist_8-31/num_tokens"] == 2 + 24
    assert got["mismatch/tool_dist_32-127/num_tokens"] == 8
    assert "mismatch/tool_dist_128+/num_tokens" not in got
    assert got["mismatch/turn_1/num_tokens"] == 10
    assert got["mismatch/turn_2+/num_tokens"] == 40


def test_mismatch_right_after_a_tool_response_shows_in_the_first_bucket():
    turns = torch.tensor([[0] * 20 + [1] * 40])
    mask = torch.ones(1, 60)
    mask[0, 18:20] = 0  # the tool response
    sampler = torch.full((1, 60), -1.0)
    trainer = sampler.clone()
    trainer[0, 20:24] += 0.5  # the first tokens after the tool output diverge
    got = mismatch_metrics(trainer, sampler, mask, turns)
    assert got["mismatch/tool_dist_0-7/abs_diff_mean"] == pytest.approx(0.25)
    assert got["mismatch/tool_dist_8-31/abs_diff_mean"] == 0
    assert got["mismatch/tool_dist_none/abs_diff_mean"] == 0


def test_top_one_percent_share_of_total_abs_diff():
    sampler = torch.full((2, 100), -1.0)
    trainer = sampler + 0.01
    trainer[1, 7] = sampler[1, 7] + 1.0
    got = mismatch_metrics(trainer, sampler, torch.ones(2, 100), torch.zeros(2, 100).long())
    # 200 tokens: the top 1% are 2 tokens, 1.0 and 0.01, of a total 1.0 + 199 * 0.01
    assert got["mismatch/top1pct_abs_diff_share"] == pytest.approx(1.01 / 2.99, rel=1e-4)


def test_empty_sequences_are_left_out_of_sequence_means():
    trainer = torch.tensor([[-1.0, -2.0], [NAN, NAN]])
    sampler = torch.tensor([[-1.5, -2.0], [INF, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    got = mismatch_metrics(trainer, sampler, mask, torch.zeros(2, 2).long())
    assert all(math.isfinite(v) for v in got.values())
    assert got["mismatch/num_seqs"] == 1
    assert got["mismatch/log_ppl_diff"] == pytest.approx(-0.25)
    assert got["mismatch/is_seq_mean"] == pytest.approx(math.exp(0.5), rel=1e-6)


def _prob(logprob: float) -> float:
    """A sampled token's probability (a positive "logprob" from a broken engine reads as 1)."""
    return math.exp(min(logprob, 0.0))


def _binary_kl(q: float, p: float) -> float:
    first = q * (math.log(q) - math.log(p)) if q > 0 else 0.0
    return first + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


def _reference_metrics(trainer, sampler, mask, turns, *, cap=2.0, max_turns=8):
    """Every metric in plain float64 Python, δ never clamped (issue 12 item 6)."""
    rows = []  # per row: list of (δ, ℓ^old, ℓ^μ, turn, distance)
    for b in range(trainer.shape[0]):
        idx = [j for j in range(trainer.shape[1]) if mask[b, j] > 0]
        first_turn = min((int(turns[b, j]) for j in idx), default=0)
        seen: dict[int, int] = {}
        row = []
        for j in idx:
            t, s, k = float(trainer[b, j]), float(sampler[b, j]), int(turns[b, j])
            distance = -1 if k == first_turn else seen.get(k, 0)
            seen[k] = seen.get(k, 0) + 1
            row.append((t - s, t, s, k, distance))
        rows.append(row)
    tokens = [x for row in rows for x in row]
    seqs = [row for row in rows if row]
    d = [x[0] for x in tokens]
    rho = [math.exp(x) for x in d]
    out = {
        "kl": mean([-x for x in d]),
        "k3_kl": mean([r - x - 1 for r, x in zip(rho, d, strict=True)]),
        "chi2_token": mean([r * r for r in rho]) - 1,
        "abs_diff_mean": mean([abs(x) for x in d]),
        "abs_diff_max": max(abs(x) for x in d),
        "token_mult_prob_error": mean([math.exp(abs(x)) for x in d]),
        "binary_tv": mean([abs(_prob(x[1]) - _prob(x[2])) for x in tokens]),
        "binary_kl": mean([_binary_kl(_prob(x[2]), _prob(x[1])) for x in tokens]),
    }
    for name, col in (("training", 1), ("rollout", 2)):
        log_ppl = [-sum(x[col] for x in row) / len(row) for row in seqs]
        out[f"{name}_log_ppl"] = mean(log_ppl)
        out[f"{name}_ppl"] = mean([math.exp(v) for v in log_ppl])
    big_s = [sum(x[0] for x in row) for row in seqs]
    lpd = [-s / len(row) for s, row in zip(big_s, seqs, strict=True)]
    out["log_ppl_diff"] = mean(lpd)
    out["log_ppl_abs_diff"] = mean([abs(v) for v in lpd])
    out["log_ppl_diff_max"], out["log_ppl_diff_min"] = max(lpd), min(lpd)
    out["ppl_ratio"] = mean([math.exp(v) for v in lpd])
    rho_seq = [math.exp(s) for s in big_s]
    out["chi2_seq"] = mean([r * r for r in rho_seq]) - 1
    for prefix, w in (("is_token", rho), ("is_seq", rho_seq)):
        capped = [min(max(x, 1 / cap), cap) for x in w]
        mean_c = mean(capped)
        out[f"{prefix}_mean"], out[f"{prefix}_min"], out[f"{prefix}_max"] = mean(w), min(w), max(w)
        out[f"{prefix}_std"] = math.sqrt(mean([(c - mean_c) ** 2 for c in capped]))
        out[f"{prefix}_ess"] = 1 / mean([(c / mean_c) ** 2 for c in capped])
        out[f"{prefix}_fraction_high"] = mean([float(x > cap) for x in w])
        out[f"{prefix}_fraction_low"] = mean([float(x < 1 / cap) for x in w])
    out["num_tokens"], out["num_seqs"], out["nonfinite_tokens"] = len(d), len(seqs), 0
    abs_sorted = sorted((abs(x) for x in d), reverse=True)
    out["top1pct_abs_diff_share"] = sum(abs_sorted[: math.ceil(0.01 * len(d))]) / sum(abs_sorted)

    def bucket_of_distance(distance):
        if distance < 0:
            return "tool_dist_none"
        for lo, hi in ((0, 8), (8, 32), (32, 128)):
            if lo <= distance < hi:
                return f"tool_dist_{lo}-{hi - 1}"
        return "tool_dist_128+"

    buckets: dict[str, list[float]] = {}
    for x in tokens:
        turn_label = f"turn_{x[3]}" if x[3] < max_turns else f"turn_{max_turns}+"
        for label in (turn_label, bucket_of_distance(x[4])):
            buckets.setdefault(label, []).append(x[0])
    for label, ds in buckets.items():
        out[f"{label}/kl"] = mean([-x for x in ds])
        out[f"{label}/k3_kl"] = mean([math.exp(x) - x - 1 for x in ds])
        out[f"{label}/abs_diff_mean"] = mean([abs(x) for x in ds])
        out[f"{label}/num_tokens"] = len(ds)
    return {f"mismatch/{k}": float(v) for k, v in out.items()}


def _huge_gap_batch():
    """Mild noise, one token at δ = −30 and one at +25, multi-turn rows, an all-masked row
    (with garbage), a one-token row, and a long turn reaching every distance bucket."""
    gen = torch.Generator().manual_seed(12)
    batch, length = 5, 200
    sampler = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    trainer = sampler + 0.05 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.ones(batch, length)
    turns = torch.zeros(batch, length, dtype=torch.long)
    turns[:, 60:] = 1
    turns[:, 190:] = 9  # past max_turns: shares `turn_8+`
    mask[:, 55:60] = 0  # tool output between turns: garbage there must not leak
    trainer[:, 55:60], sampler[:, 55:60] = NAN, -INF
    trainer[0, 10] = sampler[0, 10] - 30.0
    trainer[2, 70] = sampler[2, 70] + 25.0
    mask[3] = 0  # all-masked row
    trainer[3, 0] = INF
    mask[4] = 0
    mask[4, 7] = 1  # a single model token
    return trainer.float(), sampler.float(), mask, turns


def test_metrics_match_an_unclamped_float64_reference_under_huge_gaps():
    trainer, sampler, mask, turns = _huge_gap_batch()
    got = mismatch_metrics(trainer, sampler, mask, turns)
    want = _reference_metrics(trainer, sampler, mask, turns)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # The symptoms the clamped δ produced (issue 12): kl's sign, a max of 20, a k3 too small.
    assert got["mismatch/abs_diff_max"] == pytest.approx(30.0, abs=1e-4)
    assert got["mismatch/kl"] > 0
    assert got["mismatch/k3_kl"] > math.exp(25) / mask.sum().item()


def test_log_ppl_diff_is_the_difference_of_the_reported_log_perplexities():
    trainer, sampler, mask, turns = _huge_gap_batch()
    got = mismatch_metrics(trainer, sampler, mask, turns)
    difference = got["mismatch/training_log_ppl"] - got["mismatch/rollout_log_ppl"]
    assert got["mismatch/log_ppl_diff"] == pytest.approx(difference, rel=1e-9)
