"""`make train` itself learns: GRPO on every weight of the trained lab model (configs/lab_sft.yaml).

The trained lab model (`model: lab-sft`, docs/lab_model.md) answers before the last hop one
time in ten at each hop, a habit from its second SFT stage. `make train`'s config trains every
weight with AdamW at 1e-4 for 10 steps of 8 tasks x 8 samples at horizon 4; held-out pass@1
over 64 test-split tasks must rise by 0.15 or more with the paired interval above 0. Measured
(bench/lab_sft_train.py --report): +0.312 [+0.188, +0.438] and +0.391 [+0.250, +0.516] with
run.seed 0 and 1; 20 steps rose +0.328, +0.312, +0.375 with seeds 0-2 (bench/lab_full_weight.py
--report, rows sft1200both-ea0.1-*). The same run with trainer.lr=0, the control
(`seed0-trainer.lr0`), read +0.016 [-0.141, +0.188]: without the updates the test fails.
"""

from pathlib import Path

import pytest

from tir_rl.config import load
from tir_rl.report.run_log import read_metrics
from tir_rl.rl_loop import TrainSummary, run_train
from tir_rl.run_config import RunConfig

pytestmark = [pytest.mark.vllm]

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "lab_sft.yaml"


def train_trained_lab_model(
    tmp_path: Path, *overrides: str
) -> tuple[RunConfig, TrainSummary, list[float]]:
    """`make train`'s run with `overrides`: its config, summary and training reward per step."""
    sets = [f"run.out_dir={tmp_path}", "run.save_trajectories=0", "run.plot_every=0", *overrides]
    config = load(RunConfig, CONFIG, sets)
    summary = run_train(config)
    rows = read_metrics(summary.run_dir)
    return config, summary, [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]


def test_make_trains_config_raises_held_out_pass_at_1_of_the_trained_lab_model(tmp_path):
    config, summary, rewards = train_trained_lab_model(tmp_path)
    assert not config.trainer.train_only and config.trainer.lr == 1e-4  # every weight, 1e-4
    change = summary.accuracy_change
    assert change is not None
    why = (str(summary.accuracy_before), str(summary.accuracy_after), str(change), rewards)
    assert change.value >= 0.15, why
    assert change.low > 0.0, why
