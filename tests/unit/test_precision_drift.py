"""bench/precision_drift.py: which episodes score which checkpoint."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from precision_drift import near  # noqa: E402

from tir_rl.report.run_log import SavedTrajectory  # noqa: E402


def _saved(steps: range, per_step: int = 2) -> list[SavedTrajectory]:
    # the trajectory is a label here: near() only selects, it never reads one
    return [SavedTrajectory(step=s, trajectory=f"s{s}e{e}") for s in steps for e in range(per_step)]


def test_a_checkpoint_is_scored_on_the_episodes_its_weights_sampled_next():
    picked, steps = near(_saved(range(1, 301)), 50, window=25)
    assert steps == "51-75"
    assert len(picked) == 50 and picked[0] == "s51e0" and picked[-1] == "s75e1"


def test_the_first_checkpoint_is_the_starting_model_on_the_first_steps():
    picked, steps = near(_saved(range(1, 301)), 0, window=25)
    assert steps == "1-25" and picked[0] == "s1e0" and len(picked) == 50


def test_the_last_checkpoint_looks_back_and_a_short_tail_is_named_as_short():
    picked, steps = near(_saved(range(1, 301)), 300, window=25)
    assert steps == "276-300" and len(picked) == 50
    tail, steps = near(_saved(range(1, 206)), 200, window=25)
    assert steps == "201-205" and len(tail) == 10
