import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "collapse"))

from report import REWARD_BLOCK, heldout_curves, load_runs, trajectories  # noqa: E402


def _write_run(root: Path, name: str, rewards: list[float], entropies: list[float]) -> None:
    folder = root / name
    folder.mkdir()
    rows = [
        {"step": i + 1, "rollout/reward_mean": r, "train/entropy": e}
        for i, (r, e) in enumerate(zip(rewards, entropies, strict=True))
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_run_lists_its_reward_at_every_step_and_its_entropy_first_to_last(tmp_path):
    _write_run(tmp_path, "uncorrected_s1", [0.5, 0.25, 0.0], [1.37, 3.0, 5.61])
    _write_run(tmp_path, "no_mismatch_s0", [0.4, 0.6], [1.2, 1.1])
    text = trajectories(load_runs(tmp_path))
    lines = text.splitlines()
    assert lines[2] == "| no_mismatch_s0 | 0.40, 0.60 | 1.20 → 1.10 |"
    assert lines[3] == "| uncorrected_s1 | 0.50, 0.25, 0.00 | 1.37 → 5.61 |"


def test_long_runs_show_block_means_of_the_reward(tmp_path):
    steps = 2 * REWARD_BLOCK + 1
    rewards = [0.0] * REWARD_BLOCK + [1.0] * REWARD_BLOCK + [0.5]
    _write_run(tmp_path, "uncorrected_s0", rewards, [1.0] * steps)
    lines = trajectories(load_runs(tmp_path)).splitlines()
    assert f"mean per {REWARD_BLOCK} steps" in lines[0]
    assert lines[2] == "| uncorrected_s0 | 0.00, 1.00, 0.50 | 1.00 → 1.00 |"


def test_heldout_curves_list_every_evaluation_with_the_clean_sampler_beside(tmp_path):
    folder = tmp_path / "uncorrected_s2"
    folder.mkdir()
    rows = [
        {"step": 0, "eval/pass_at_1": 0.25, "eval_clean/pass_at_1": 0.5},
        {"step": 1, "rollout/reward_mean": 0.1},
        {"step": 25, "eval/pass_at_1": 0.125, "eval_clean/pass_at_1": 0.375},
        {"step": 50, "eval/pass_at_1": 0.0},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = heldout_curves(load_runs(tmp_path)).splitlines()
    assert lines[2] == "| run | step 0 | step 25 | step 50 |"
    assert lines[4] == "| uncorrected_s2 | 0.250 / 0.500 | 0.125 / 0.375 | 0.000 |"


def test_no_heldout_curve_table_for_before_and_after_only(tmp_path):
    folder = tmp_path / "no_mismatch_s0"
    folder.mkdir()
    rows = [{"step": 0, "eval/pass_at_1": 0.25}, {"step": 8, "eval/pass_at_1": 0.5}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert heldout_curves(load_runs(tmp_path)) == ""
