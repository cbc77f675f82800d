"""Metrics reduced across ranks are the whole batch's, not averages of per-rank ratios.

Two real gloo ranks each compute `mismatch_metrics` on their share of one batch (unequal
token counts, or no tokens at all: the masked copy a rank without a sequence trains on);
after `all_reduce_metrics` every rank must hold what one process computes on the whole
batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tir_rl.distributed import all_reduce_metrics, free_port
from tir_rl.metric import Metric, ReduceOp

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from tir_rl import distributed as tdist
    from tir_rl.mismatch import CorrectionStats, mismatch_metrics
    from tir_rl.mismatch.failure_tilt import failure_tilt

    rank, port, split = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    gen = torch.Generator().manual_seed(0)
    num_seqs, length = 4, 12
    sampler = -torch.rand(num_seqs, length, generator=gen) * 3
    trainer = sampler + torch.randn(num_seqs, length, generator=gen) * 0.3
    lengths = torch.tensor([12, 9, 3, 6])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    turns = (torch.arange(length)[None, :] // 4).expand(num_seqs, length).clone()
    if split == "unequal":  # rank 0: 24 tokens in 3 sequences, rank 1: 6 tokens in 1
        rows = [0, 1, 2] if rank == 0 else [3]
        shard_mask = mask[rows]
    else:  # rank 1 trains on a masked copy of sequence 3: no tokens
        rows = [0, 1, 2, 3] if rank == 0 else [3]
        shard_mask = mask[rows] * (rank == 0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    local = mismatch_metrics(trainer[rows], sampler[rows], shard_mask, turns[rows])
    local |= failure_tilt(trainer[rows], sampler[rows], shard_mask, advantages[rows], None)
    kept = int(shard_mask.sum().item())
    local |= CorrectionStats(
        num_tokens=kept,
        num_tokens_kept=max(kept - rank, 0),
        masked_token_fraction=rank / max(kept, 1),
        masked_turn_fraction=0.0,
        masked_seq_fraction=0.0,
        veto_fraction=0.0,
        weight_mean=1.0 + rank,
        weight_std=0.0,
        weight_min=1.0 + rank,
        weight_max=1.0 + rank,
    ).to_dict()
    tdist.init_process_group(rank=rank, world_size=2, master_port=port, timeout_s=60)
    reduced = tdist.all_reduce_metrics(local)
    tdist.destroy_process_group()
    whole = mismatch_metrics(trainer, sampler, mask, turns)
    whole |= failure_tilt(trainer, sampler, mask, advantages, None)
    print("RESULT " + json.dumps({"reduced": reduced, "whole": whole, "local": local}))
    """
)

# Means over unit counts are exact; these are nonlinear in the tokens (std, ESS, a top-1%
# share) and only exact when one rank holds every token.
NONLINEAR = ("_std", "_ess", "abs_diff_share")


def _run_two_ranks(split: str) -> list[dict]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(r), str(port), split],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    results = []
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
        line = next(x for x in log.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


@pytest.mark.parametrize("split", ["unequal", "one_rank_empty"])
def test_reduced_mismatch_metrics_equal_the_whole_batch(split):
    results = _run_two_ranks(split)
    assert results[0]["reduced"] == results[1]["reduced"]
    reduced, whole = results[0]["reduced"], results[0]["whole"]
    assert set(whole) <= set(reduced)
    checked = [k for k in whole if split == "one_rank_empty" or not k.endswith(NONLINEAR)]
    assert "mismatch/k3_kl" in checked and "mismatch/training_log_ppl" in checked
    assert "mismatch/failure_tilt" in checked
    wrong = {
        k: (reduced[k], whole[k])
        for k in checked
        if not reduced[k] == pytest.approx(whole[k], rel=1e-9, abs=1e-12)
    }
    assert not wrong, wrong
    names = ("num_tokens", "num_tokens_kept", "weight_mean", "masked_token_fraction")
    correction = {k: reduced[f"mismatch/correction/{k}"] for k in names}
    if split == "unequal":  # rank 0: 24 tokens kept of 24; rank 1: 5 of 6, weight 2
        assert correction == pytest.approx(
            {
                "num_tokens": 30,
                "num_tokens_kept": 29,
                "weight_mean": (24 + 2 * 5) / 29,
                "masked_token_fraction": 1 / 30,
            }  # fmt: skip
        )
    else:  # rank 1 has no tokens: its weight_mean and fraction do not count
        assert correction == pytest.approx(
            {
                "num_tokens": 30,
                "num_tokens_kept": 30,
                "weight_mean": 1.0,
                "masked_token_fraction": 0.0,
            }  # fmt: skip
        )


def test_a_rank_average_would_differ_from_the_whole_batch():
    """The batch above really does tell a per-rank average from the global ratio."""
    results = _run_two_ranks("unequal")
    rank0, rank1 = (r["local"] for r in results)
    whole = results[0]["whole"]
    keys = ("mismatch/k3_kl", "mismatch/abs_diff_mean", "mismatch/training_log_ppl")
    for key in (*keys, "mismatch/failure_tilt"):
        average = (rank0[key] + rank1[key]) / 2
        assert abs(average - whole[key]) > 1e-3 * abs(whole[key]), key


def test_each_metric_declares_how_it_combines_across_ranks():
    import torch

    from tir_rl.mismatch import CorrectionStats, mismatch_metrics
    from tir_rl.mismatch.failure_tilt import failure_tilt

    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sampler = torch.tensor([[-1.2, -1.9, -0.5, 0.0]])
    mask, turns = torch.tensor([[1, 1, 1, 0]]), torch.tensor([[0, 0, 1, 1]])
    row = mismatch_metrics(trainer, sampler, mask, turns)
    row |= failure_tilt(trainer, sampler, mask, torch.tensor([-1.0]), None)
    expected = {
        "mismatch/failure_tilt": (ReduceOp.MEAN, "mismatch/failure_tilt_mass"),
        "mismatch/failure_tilt_mass": (ReduceOp.SUM, None),
        "mismatch/kl": (ReduceOp.MEAN, "mismatch/num_tokens"),
        "mismatch/is_token_ess": (ReduceOp.MEAN, "mismatch/num_tokens"),
        "mismatch/chi2_seq": (ReduceOp.MEAN, "mismatch/num_seqs"),
        "mismatch/rollout_ppl": (ReduceOp.MEAN, "mismatch/num_seqs"),
        "mismatch/log_ppl_diff_max": (ReduceOp.MAX, "mismatch/num_seqs"),
        "mismatch/is_token_min": (ReduceOp.MIN, "mismatch/num_tokens"),
        "mismatch/abs_diff_max": (ReduceOp.MAX, "mismatch/num_tokens"),
        "mismatch/num_tokens": (ReduceOp.SUM, None),
        "mismatch/nonfinite_tokens": (ReduceOp.SUM, None),
        "mismatch/turn_1/k3_kl": (ReduceOp.MEAN, "mismatch/turn_1/num_tokens"),
    }
    assert {k: (row[k].reduce, row[k].over) for k in expected} == expected
    assert all(isinstance(v, Metric) for v in row.values())
    stats = CorrectionStats(3, 2, 1 / 3, 0.5, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0).to_dict()
    kept = "mismatch/correction/num_tokens_kept"
    assert (
        stats["mismatch/correction/weight_std"].reduce,
        stats["mismatch/correction/weight_std"].over,
    ) == (ReduceOp.MEAN, kept)
    assert stats["mismatch/correction/veto_fraction"].over == "mismatch/correction/num_tokens"
    assert stats[kept].reduce is ReduceOp.SUM


def test_the_loss_metrics_are_declared_once_and_combine_over_micro_batches_as_declared():
    import torch

    from tir_rl.trainer.loss import LOSS_METRICS, LOSS_TOKENS
    from tir_rl.trainer.step_result import combine_loss_metrics

    names = [metric.name for metric in LOSS_METRICS]
    assert len(names) == len(set(names))
    column = {metric.name: i for i, metric in enumerate(LOSS_METRICS)}

    def micro_batch(tokens: float, ratio_mean: float, ratio_max: float) -> torch.Tensor:
        values = torch.zeros(len(LOSS_METRICS))
        values[column["ratio_mean"]], values[column["ratio_max"]] = ratio_mean, ratio_max
        return torch.cat([torch.tensor([tokens]), values])

    combined = combine_loss_metrics(
        [micro_batch(3, 1.0, 1.5), micro_batch(1, 2.0, 1.2), micro_batch(0, 9.0, 9.0)]
    )
    assert combined[LOSS_TOKENS] == 4.0 and combined[LOSS_TOKENS].reduce is ReduceOp.SUM
    mean, top = combined["train/ratio_mean"], combined["train/ratio_max"]
    assert mean == pytest.approx(1.25) and (mean.reduce, mean.over) == (ReduceOp.MEAN, LOSS_TOKENS)
    assert top == pytest.approx(1.5) and (top.reduce, top.over) == (ReduceOp.MAX, LOSS_TOKENS)
    assert "train/loss" not in combined  # the trainer normalizes and reports the loss itself


def test_a_metric_that_does_not_declare_its_reduction_is_refused():
    with pytest.raises(TypeError, match="declares how it combines"):
        all_reduce_metrics({"mismatch/kl": 0.5})


def test_without_a_process_group_metrics_pass_through():
    metrics = {
        "mismatch/kl": Metric.mean(0.5, "mismatch/num_tokens"),
        "mismatch/num_tokens": Metric.count(3.0),
    }
    assert all_reduce_metrics(metrics) == {"mismatch/kl": 0.5, "mismatch/num_tokens": 3.0}
