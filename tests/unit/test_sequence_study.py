"""`collapse_lab.sequence_study`: failed and succeeded sequences, their log-ratios and masks."""

import json
import math
from pathlib import Path

from collapse_lab.report import load_runs
from collapse_lab.sequence_study import study
from tir_rl.report.sequences import SequenceRecord, append_sequences

MASKED = "correction:\n  geo_mask: [0.999, 1.001]\n"
UNCORRECTED = "correction: {}\n"


def record(step: int, advantage: float, log_ratio_mean: float, kept: int) -> SequenceRecord:
    return SequenceRecord(
        step=step, group_id=0, reward=float(advantage > 0), advantage=advantage,
        model_tokens=10, kept_tokens=kept, is_weight_mean=1.0 if kept else None,
        log_ratio_sum=10 * log_ratio_mean, log_ratio_mean=log_ratio_mean,
        log_ratio_min=log_ratio_mean, log_ratio_max=log_ratio_mean, lag_max=0,
    )  # fmt: skip


def write_run(root: Path, name: str, config: str, rewards: list[float], records) -> Path:
    folder = root / name
    folder.mkdir()
    rows = [{"step": i + 1, "rollout/reward_mean": r} for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.yaml").write_text(config)
    append_sequences(folder / "sequences.jsonl", records)
    return folder


def row_of(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_each_side_gets_its_count_mean_ratio_band_share_and_rejections(tmp_path):
    inside, below = 0.0, math.log(0.99)
    write_run(tmp_path, "geo_rs_s0", MASKED, [0.5] * 4, [
        record(1, -1.0, below, kept=0), record(1, -1.0, inside, kept=10),
        record(2, 1.0, inside, kept=10), record(2, 0.0, below, kept=0),  # A = 0: left out
    ])  # fmt: skip
    cells = row_of(study(load_runs(tmp_path)), "geo_rs_s0")
    assert cells[1:] == [
        "1-4", "2", f"{below / 2:+.1e}", "0.50", "0.50", "1", "+0.0e+00", "0.00", "0.00",
    ]  # fmt: skip


def test_a_run_without_a_mask_shows_no_rejections_and_stops_before_its_collapse(tmp_path):
    rewards = [0.8] * 10 + [0.0] * 10  # collapses at step 11 and stays down
    write_run(tmp_path, "uncorrected_s0", UNCORRECTED, rewards, [
        record(5, -1.0, math.log(0.9), kept=10),
        record(12, 1.0, math.log(0.9), kept=10),  # from the collapse on: not read
    ])  # fmt: skip
    (run,) = load_runs(tmp_path)
    assert run.verdict.persisting and run.verdict.collapse_step == 12
    cells = row_of(study([run]), "uncorrected_s0")
    assert cells[1] == "1-11"
    assert cells[2:6] == ["1", f"{math.log(0.9):+.1e}", "1.00", "–"]
    assert cells[6:] == ["0", "–", "–", "–"]


def test_runs_without_per_sequence_records_are_named_not_read(tmp_path):
    write_run(tmp_path, "with_s0", UNCORRECTED, [0.5], [record(1, 1.0, 0.0, kept=10)])
    bare = tmp_path / "bare_s0"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}))
    table = study(load_runs(tmp_path))
    assert table.splitlines()[0].startswith("1 runs with per-sequence records (1 without: bare_s0)")
    assert "| bare_s0 |" not in table
