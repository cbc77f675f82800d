import json
from pathlib import Path

import pytest

from collapse_lab.report import (
    EARLY_STEPS,
    REWARD_BLOCK,
    breaking_point_map,
    corrections_table,
    early_gap,
    early_mismatch_by_position,
    heldout_curves,
    load_runs,
    outcome,
    paired_change,
    plot,
    trajectories,
)


def _write_run(
    root: Path, name: str, rewards: list[float], entropies: list[float], k3: float = 2e-3
) -> None:
    folder = root / name
    folder.mkdir()
    rows = [
        {"step": i + 1, "rollout/reward_mean": r, "train/entropy": e, "mismatch/k3_kl": k3 * i}
        for i, (r, e) in enumerate(zip(rewards, entropies, strict=True))
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_run_lists_its_reward_at_every_step_and_its_entropy_first_to_last(tmp_path):
    _write_run(tmp_path, "uncorrected_s1", [0.5, 0.25, 0.0], [1.37, 3.0, 5.61])
    _write_run(tmp_path, "no_mismatch_s0", [0.4, 0.6], [1.2, 1.1])
    text = trajectories(load_runs(tmp_path))
    lines = text.splitlines()
    assert lines[2] == "| no_mismatch_s0 | 0.40, 0.60 | 1.20 → 1.10 | 0.0e+00, 2.0e-03 |"
    assert lines[3] == (
        "| uncorrected_s1 | 0.50, 0.25, 0.00 | 1.37 → 5.61 | 0.0e+00, 2.0e-03, 4.0e-03 |"
    )


def test_long_runs_show_block_means_of_the_reward(tmp_path):
    steps = 2 * REWARD_BLOCK + 1
    rewards = [0.0] * REWARD_BLOCK + [1.0] * REWARD_BLOCK + [0.5]
    _write_run(tmp_path, "uncorrected_s0", rewards, [1.0] * steps, k3=0.0)
    lines = trajectories(load_runs(tmp_path)).splitlines()
    assert f"mean per {REWARD_BLOCK} steps" in lines[0]
    assert lines[2] == (
        "| uncorrected_s0 | 0.00, 1.00, 0.50 | 1.00 → 1.00 | 1.00, 1.00, 1.00 | "
        "0.0e+00, 0.0e+00, 0.0e+00 | – |"
    )


def test_long_runs_show_the_drift_of_entropy_k3_and_masked_sequences_block_by_block(tmp_path):
    folder = tmp_path / "h8_bypass_noise_0.2_s0"
    folder.mkdir()
    steps = 2 * REWARD_BLOCK
    rows = [
        {
            "step": i + 1,
            "rollout/reward_mean": 0.1,
            "train/entropy": 1.0 if i < REWARD_BLOCK else 2.0,
            "mismatch/k3_kl": 3e-3 if i < REWARD_BLOCK else 5e-3,
            "mismatch/correction/masked_seq_fraction": 0.5 if i < REWARD_BLOCK else 0.1,
        }
        for i in range(steps)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = trajectories(load_runs(tmp_path)).splitlines()
    assert "k3 KL (mean per" in lines[0] and lines[1].count("|---") == 6
    assert lines[2].endswith("| 1.00, 2.00 | 3.0e-03, 5.0e-03 | 0.50, 0.10 |")


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


TASKS = 64


def _solved(fraction: float) -> list[float]:
    """Per-task pass@1 with the first `fraction` of the tasks solved."""
    solved = round(fraction * TASKS)
    return [1.0] * solved + [0.0] * (TASKS - solved)


def _write_task_scores(folder: Path, prefix: str, step: int, scores: list[float]) -> None:
    (folder / f"{prefix}_step_{step}.json").write_text(json.dumps({"task_pass_at_1": scores}))


def _write_eval_run(root: Path, name: str, before: float, after: tuple[float, float, float],
                    *, updates: bool = True, clean: bool = True) -> None:  # fmt: skip
    folder = root / name
    folder.mkdir()
    prefix = "eval_clean" if clean else "eval"
    point, low, high = after
    rows = [
        {"step": 0, f"{prefix}/pass_at_1": before, "eval/pass_at_1": before},
        {"step": 1, "rollout/reward_mean": 0.5, "mismatch/k3_kl": 6e-3,
         "mismatch/abs_diff_max": 2.1, **({"train/grad_norm": 0.02} if updates else {})},
        {"step": 8, f"{prefix}/pass_at_1": point, f"{prefix}/pass_at_1_low": low,
         f"{prefix}/pass_at_1_high": high, "eval/pass_at_1": 0.0},
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_task_scores(folder, prefix, 0, _solved(before))
    _write_task_scores(folder, prefix, 8, _solved(point))


def test_outcome_judges_the_trained_policy_by_its_paired_change_from_its_own_start(tmp_path):
    _write_eval_run(tmp_path, "h8_decoupled_noise_0.3_s0", 0.25, (0.8, 0.7, 0.9))
    _write_eval_run(tmp_path, "h8_decoupled_noise_1_s0", 0.25, (0.3, 0.2, 0.4))
    _write_eval_run(tmp_path, "h8_bypass_noise_0.3_s0", 0.25, (0.0, 0.0, 0.0))
    _write_eval_run(tmp_path, "h8_bypass_noise_1_s0", 0.25, (0.1, 0.05, 0.2))
    _write_eval_run(tmp_path, "h8_bypass_noise_3_s0", 0.0, (0.0, 0.0, 0.0), updates=False)
    judged = {r.setting: outcome(r) for r in load_runs(tmp_path)}
    assert judged == {
        "h8_decoupled_noise_0.3": "learned",
        "h8_decoupled_noise_1": "no change",
        "h8_bypass_noise_0.3": "collapsed",
        "h8_bypass_noise_1": "degraded",
        "h8_bypass_noise_3": "no signal",
    }


def test_the_same_tasks_are_each_others_control(tmp_path):
    """Six more tasks solved and none lost is a gain; the same mean on other tasks is not.

    The final interval (0.19-0.41 here) contains the start (0.25), so judging it against the
    start's point estimate would call both runs "no change"."""
    gained = tmp_path / "seq_mis_s0"
    _write_eval_run(tmp_path, gained.name, 0.25, (0.344, 0.19, 0.41))
    reshuffled = tmp_path / "seq_mis_s1"
    _write_eval_run(tmp_path, reshuffled.name, 0.25, (0.344, 0.19, 0.41))
    other_tasks = [0.0] * 16 + [1.0] * 22 + [0.0] * (TASKS - 38)
    _write_task_scores(reshuffled, "eval_clean", 8, other_tasks)
    judged = {r.seed: (outcome(r), paired_change(r)) for r in load_runs(tmp_path)}
    assert judged[0][0] == "learned" and judged[0][1].low > 0
    assert judged[1][0] == "no change" and judged[1][1].low < 0 < judged[1][1].high


def test_a_run_without_per_task_scores_is_unpaired_not_judged(tmp_path):
    _write_eval_run(tmp_path, "uncorrected_s0", 0.25, (0.0, 0.0, 0.0))
    (tmp_path / "uncorrected_s0" / "eval_clean_step_0.json").unlink()
    assert outcome(load_runs(tmp_path)[0]) == "unpaired"


def test_a_run_without_its_final_evaluation_is_unfinished_not_judged(tmp_path):
    folder = tmp_path / "h8_bypass_noise_0.1_s0"
    folder.mkdir()
    rows = [{"step": 0, "eval/pass_at_1": 0.25}, {"step": 1, "rollout/reward_mean": 0.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert outcome(load_runs(tmp_path)[0]) == "unfinished"


def test_outcome_uses_the_own_sampler_when_no_clean_evaluation_ran(tmp_path):
    _write_eval_run(tmp_path, "h4_bypass_bf16_sampler_s0", 0.25, (0.8, 0.7, 0.9), clean=False)
    assert outcome(load_runs(tmp_path)[0]) == "learned"


def test_the_map_puts_each_run_in_its_mismatch_row_and_horizon_mode_column(tmp_path):
    _write_eval_run(tmp_path, "h8_no_mismatch_s0", 0.25, (0.8, 0.7, 0.9))
    _write_eval_run(tmp_path, "h8_bypass_noise_0.3_s0", 0.25, (0.0, 0.0, 0.0))
    _write_eval_run(tmp_path, "h4_decoupled_noise_0.3_s0", 0.5, (0.8, 0.7, 0.9))
    lines = breaking_point_map(load_runs(tmp_path)).splitlines()
    assert lines[2] == "| mismatch | h8 bypass | h8 decoupled | h4 bypass | h4 decoupled |"
    none_row, noise_row = lines[4], lines[5]
    assert none_row.startswith(
        "| none | **learned** 0.25 → 0.80; k3 6.0e-03, max 2.1 | **learned**"
    )
    cells = [c.strip() for c in noise_row.split("|")[1:-1]]
    assert cells[0] == "noise_0.3"
    assert cells[1].startswith("**collapsed** 0.25 → 0.00")
    assert cells[2] == "–" and cells[3] == "–"
    assert cells[4].startswith("**learned** 0.50 → 0.80")


def test_map_runs_get_a_map_plot_and_other_runs_do_not(tmp_path):
    _write_eval_run(tmp_path, "h8_bypass_noise_0.3_s0", 0.25, (0.0, 0.0, 0.0))
    written = plot(load_runs(tmp_path), tmp_path / "plots")
    assert [p.name for p in written][-1] == "breaking_point_map.png"
    assert (tmp_path / "plots" / "breaking_point_map.png").stat().st_size > 0
    other = tmp_path / "other"
    other.mkdir()
    _write_eval_run(other, "uncorrected_s0", 0.25, (0.0, 0.0, 0.0))
    names = [p.name for p in plot(load_runs(other), other / "plots")]
    assert "breaking_point_map.png" not in names


def test_the_map_sizes_a_mismatch_over_the_first_steps_only(tmp_path):
    folder = tmp_path / "h8_decoupled_stale_4_s0"
    folder.mkdir()
    k3 = [0.0, 4e-3, 4e-3, 4e-3, 1.0]  # in sync at step 1; the last step would inflate it
    rows = [
        {"step": i + 1, "mismatch/k3_kl": v, "mismatch/abs_diff_max": 10 * v}
        for i, v in enumerate(k3)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert EARLY_STEPS == 4
    mean_k3, max_gap = early_gap(load_runs(tmp_path)[0])
    assert mean_k3 == pytest.approx(3e-3) and max_gap == pytest.approx(0.04)


def test_a_map_cell_lists_each_seed(tmp_path):
    _write_eval_run(tmp_path, "h8_bypass_noise_0.2_s0", 0.25, (0.0, 0.0, 0.0))
    _write_eval_run(tmp_path, "h8_bypass_noise_0.2_s1", 0.25, (0.8, 0.7, 0.9))
    line = breaking_point_map(load_runs(tmp_path)).splitlines()[4]
    cell = line.split("|")[2].strip()
    assert cell.startswith("s0: **collapsed**") and "<br>s1: **learned**" in cell


START_TASKS = [1.0, 0.0, 0.0, 0.0] * 4


def _write_judged_run(
    root: Path,
    name: str,
    start: float,
    end: float,
    tasks: list[float],
    masked: float,
    start_tasks: list[float] = START_TASKS,
) -> None:
    folder = root / name
    folder.mkdir()
    rows = [
        {"step": 0, "eval/pass_at_1": start, "eval_clean/pass_at_1": start},
        {"step": 1, "rollout/reward_mean": 0.5, "train/grad_norm": 0.1,
         "mismatch/correction/masked_token_fraction": masked,
         "mismatch/correction/masked_turn_fraction": 2 * masked,
         "mismatch/correction/masked_seq_fraction": 3 * masked},
        {"step": 8, "eval/pass_at_1": end, "eval_clean/pass_at_1": end,
         "eval_clean/pass_at_1_low": end - 0.1, "eval_clean/pass_at_1_high": end + 0.1},
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_task_scores(folder, "eval_clean", 0, start_tasks)
    _write_task_scores(folder, "eval_clean", 8, tasks)
    (folder / "DONE").write_text("600.0 s\n")


def test_the_corrections_table_pools_seeds_and_tasks_per_setting(tmp_path):
    good, bad = [1.0, 1.0, 0.0, 1.0] * 4, [0.0] * 16
    _write_judged_run(tmp_path, "token_tis_s0", 0.25, 0.75, good, 0.01)
    _write_judged_run(tmp_path, "token_tis_s1", 0.25, 0.0, bad, 0.03)
    _write_judged_run(tmp_path, "token_tis_s2", 0.25, 0.75, good, 0.02)
    lines = corrections_table(load_runs(tmp_path)).splitlines()
    assert len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "token_tis" and cells[1] == "0, 1, 2"
    assert cells[2] == "1 collapsed, 2 learned" and cells[4] == "1/3"
    assert cells[3].startswith("s0 +0.500 [+") and "; s1 -0.250 [-" in cells[3]
    assert cells[6].startswith("0.500 [")  # (0.75 + 0 + 0.75) / 3, from the per-task scores
    low, high = (float(x) for x in cells[6].split("[")[1].rstrip("]").split(","))
    assert low < 0.3 and high > 0.7  # one of three seeds scoring nothing widens it
    assert cells[7] == "0.25"
    assert cells[8] == "0.02 / 0.04 / 0.06"
    assert cells[9] == "10.0"


def test_the_corrections_table_says_when_a_seed_lacks_per_task_scores(tmp_path):
    _write_judged_run(tmp_path, "veto_s0", 0.25, 0.75, [1.0, 0.0, 1.0, 1.0] * 4, 0.0)
    _write_judged_run(tmp_path, "veto_s1", 0.25, 0.75, [1.0, 0.0, 1.0, 1.0] * 4, 0.0)
    (tmp_path / "veto_s1" / "eval_clean_step_8.json").write_text("{}")
    cells = corrections_table(load_runs(tmp_path)).splitlines()[2].split("|")
    assert "(1 of 2 seeds)" in cells[7]
    assert "1 learned, 1 unpaired" in cells[3]


def test_kept_records_give_the_same_report_as_the_run_folders(tmp_path):
    from collapse_lab.keep import keep

    runs = tmp_path / "runs"
    runs.mkdir()
    _write_judged_run(runs, "token_tis_s0", 0.4, 0.75, [1.0, 1.0, 0.0, 1.0], 0.01)
    (runs / "token_tis_s0" / "checkpoints").mkdir()
    (runs / "token_tis_s0" / "trajectories.jsonl").write_text("{}\n")
    kept = keep(runs, tmp_path / "kept")
    assert [p.name for p in kept] == ["token_tis_s0"]
    assert sorted(p.name for p in kept[0].iterdir()) == [
        "DONE", "eval_clean_step_0.json", "eval_clean_step_8.json", "metrics.jsonl.gz",
    ]  # fmt: skip
    assert corrections_table(load_runs(tmp_path / "kept")) == corrections_table(load_runs(runs))
    first = (kept[0] / "metrics.jsonl.gz").read_bytes()
    keep(runs, tmp_path / "kept")
    assert (kept[0] / "metrics.jsonl.gz").read_bytes() == first  # a re-keep shows no diff


def test_long_runs_get_the_early_mismatch_by_turn_and_tool_distance(tmp_path):
    folder = tmp_path / "h4_bypass_noise_0.2_s0"
    folder.mkdir()
    rows = [
        {"step": i + 1, "rollout/reward_mean": 0.5, "mismatch/turn_1/k3_kl": 2e-3 * (i < 15),
         "mismatch/turn_0/k3_kl": 1e-3, "mismatch/tool_dist_8-31/k3_kl": 3e-3,
         "mismatch/tool_dist_0-7/k3_kl": 4e-3, "mismatch/tool_dist_none/k3_kl": 5e-3}
        for i in range(REWARD_BLOCK + 1)
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = early_mismatch_by_position(load_runs(tmp_path)).splitlines()
    assert lines[2] == (
        "| run | turn_0 | turn_1 | tool_dist_0-7 | tool_dist_8-31 | tool_dist_none |"
    )
    assert lines[4] == (
        "| h4_bypass_noise_0.2_s0 | 1.0e-03 | 2.0e-03 | 4.0e-03 | 3.0e-03 | 5.0e-03 |"
    )  # turn 1: only steps 1-15 count
    short = tmp_path / "short"
    short.mkdir()
    _write_run(short, "uncorrected_s0", [0.5, 0.5], [1.0, 1.0])
    assert early_mismatch_by_position(load_runs(short)) == ""


def test_the_longest_stretch_near_zero_reward_is_found_and_a_gap_in_the_steps_breaks_it(tmp_path):
    from collapse_lab.stabilizers_report import longest_low_stretch

    rewards = [0.5, 0.0, 0.0, 0.5, 0.05, 0.0, 0.09, 0.5]  # steps 1-8: stretches of 2 and 3
    _write_run(tmp_path, "raw_preset_s1", rewards, [1.0] * len(rewards))
    (run,) = load_runs(tmp_path)
    assert longest_low_stretch(run) == (5, 3)
    run.rows = [r for r in run.rows if r["step"] != 6]  # steps 5 and 7, not consecutive
    assert longest_low_stretch(run) == (2, 2)
    run.rows = [r for r in run.rows if r["rollout/reward_mean"] >= 0.1]
    assert longest_low_stretch(run) is None
