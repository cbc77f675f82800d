"""The guard signal study (`collapse_lab.guard_signal`) on records, and the guard's default.

The default limit of the failure tilt is what the study's fixed rule chooses on the kept
collapse-lab runs; a scripted set of runs checks the rule, the scoring and leave-one-out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collapse_lab import guard_signal
from collapse_lab.report import Run
from collapse_lab.verdict import judge_run
from tir_rl.mismatch.failure_tilt import TILT_KEY
from tir_rl.mismatch.guard import DEFAULT_TILT_LIMIT, CollapseGuard

REPO = Path(__file__).resolve().parents[2]


def scripted_run(name: str, tilt: list[float], rewards: list[float]) -> guard_signal.Signals:
    rows = [
        {"step": s, "rollout/reward_mean": r, "train/grad_norm": 1.0, "mismatch/k3_kl": 1e-3}
        for s, r in enumerate(rewards, start=1)
    ]
    run = Run(name, 0, rows, judge_run(rows), Path(name))
    by_step = dict(enumerate(tilt, start=1))
    return guard_signal.Signals(run, {TILT_KEY: by_step, guard_signal.K3_KEY: {}})


def test_the_rule_picks_the_largest_limit_that_warns_every_collapse_without_alarming_holds():
    collapse = scripted_run("stale_a", [0.05] * 20 + [0.06] * 10, [0.8] * 20 + [0.0] * 10)
    hold = scripted_run("raw_T_b", [0.004] * 30, [0.8] * 30)
    assert collapse.run.verdict.persisting and collapse.run.verdict.collapse_step == 22
    limit, found = guard_signal.choose_limit([collapse, hold], TILT_KEY, smooth=5, min_lead=5)
    assert limit == 0.03 and (found.warned, found.false_alarms) == (1, 0)
    judged = guard_signal.judge(collapse, TILT_KEY, limit, smooth=5)
    assert judged.first_firing == 5 and judged.lead == 17  # the first full 5-step mean
    # held out, the hold is judged with the limit the collapse alone chose
    table = "\n".join(guard_signal.loco_table([collapse, hold], smooth=5, min_lead=5))
    assert "| failure tilt | raw logprobs | 0.03 | 0/0 | 0/1 |" in table


def test_the_guards_default_tilt_limit_is_the_one_the_kept_runs_choose():
    kept = REPO / "bench" / "collapse" / "results" / "sft_long"
    if not kept.is_dir():
        pytest.skip("the collapse lab's kept runs are not in this checkout")
    sigs = [guard_signal.signals(run) for run in guard_signal._runs([kept])]
    limit, _ = guard_signal.choose_limit(sigs, TILT_KEY, smooth=5, min_lead=5)
    assert limit == DEFAULT_TILT_LIMIT
    default = CollapseGuard.Config()
    assert default.failure_tilt_limit == DEFAULT_TILT_LIMIT and default.smooth == 5


def test_the_ess_deficit_is_vcpos_ratio_of_each_steps_trained_sequences(tmp_path):
    """The study's ESS signal from a run's per-sequence records: 1 − ρ per update step."""
    import gzip
    import json
    import math

    from tir_rl.report.sequences import SEQUENCES_FILE

    def record(step: int, log_ratio_sum: float, advantage: float | None = 1.0) -> dict:
        return {
            "step": step, "group_id": 0, "reward": 1.0, "advantage": advantage,
            "model_tokens": 4, "kept_tokens": None, "is_weight_mean": None,
            "log_ratio_sum": log_ratio_sum, "log_ratio_mean": log_ratio_sum / 4,
            "log_ratio_min": 0.0, "log_ratio_max": 0.0, "lag_max": -1,
        }  # fmt: skip

    records = [
        record(1, 0.0), record(1, 0.0),  # equal weights: ρ = 1
        record(2, math.log(0.5)), record(2, math.log(2.0)),
        record(2, 5.0, advantage=None),  # a scored-only batch's sequence: not trained, left out
    ]  # fmt: skip
    with gzip.open(tmp_path / f"{SEQUENCES_FILE}.gz", "wt") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    run = Run("stale_x", 0, [], judge_run([]), tmp_path)
    deficit = guard_signal.ess_deficit_by_step(guard_signal.trained_sequences(run))
    assert deficit[1] == pytest.approx(0.0, abs=1e-8)
    assert deficit[2] == pytest.approx(1 - 2.5**2 / (4.25 * 2), rel=1e-6)
    # and a guard on it fires where the deficit stays above its limit
    fired = guard_signal.firing_steps(deficit, guard_signal.ESS_DEFICIT_KEY, 0.1, smooth=1)
    assert fired == [2]
