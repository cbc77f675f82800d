import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "collapse"))

from report import load_runs, trajectories  # noqa: E402


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
