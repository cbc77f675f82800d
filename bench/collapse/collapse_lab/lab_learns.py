"""The lab model's learning run: GRPO on a less confident lab model (configs/lab_learns.yaml).

The asynchronous learning test's run until 2026-12-02 (tests/integration/train/
test_train_learns.py, since merged into the asynchronous LoRA test); one definition for the
benches that measure it: how often it
learns, seed after seed (bench/lab_learns_async.py), and LoRA adapters in place of the final
norm's weight (bench/lora_lab_learning.py). The run starts from the lab model with its logits
scaled down (`START_SCALE`) and trains MultiHop at horizon 1, 6 steps of 6 tasks x 4 samples,
with held-out pass@1 on 64 tasks before and after.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tir_rl.rl_loop import TrainSummary

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "lab_learns.yaml"
"""The run's config, in the repository's configs/ (this file is bench/collapse/collapse_lab/)."""

START_SCALE = 0.36
"""Logit scale of the starting model: held-out pass@1 about 0.2-0.3 at horizon 1."""

ASYNCHRONOUS = ("run.max_staleness=2", "correction_preset=token_tis")
"""Rollouts two policy versions ahead of the trainer (docs/async.md); the correction is
token-level truncated IS, since geo_rs's band rejects every stale sequence. The config's six
steps: with four, 2 of 17 runs missed the bar of 0.25 (one in CI at -0.125), while the six-step
runs of `python bench/lab_learns_async.py --report bench/lab_learns_records` all cleared it
(bench/lab_learns_records/README.md has the counts)."""


def train_lab_model(out_dir: Path, *overrides: str) -> tuple[TrainSummary, list[float]]:
    """Train the run in `out_dir` with `overrides`; the summary and the reward per step.

    The starting model is written into `out_dir / "lab"`; the run folder is
    `out_dir / run.name`. The training reward per step is what a failing test shows. Torch
    is imported here, not with this module, so that a bench pins its cores first
    (`collapse_lab.run.pin_to_core`).
    """
    from tir_rl.config import load
    from tir_rl.lab.model import LabModelSpec
    from tir_rl.models import prepare_lab_model
    from tir_rl.report.run_log import read_metrics
    from tir_rl.rl_loop import run_train
    from tir_rl.run_config import RunConfig

    model = prepare_lab_model(LabModelSpec(logit_scale=START_SCALE), out_dir / "lab")
    config = load(RunConfig, CONFIG, [f"model={model}", f"run.out_dir={out_dir}", *overrides])
    summary = run_train(config)
    rows = read_metrics(summary.run_dir)
    return summary, [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
