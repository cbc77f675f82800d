"""The precision-drift study's episodes (`collapse_lab.drift_episodes`, used by
bench/precision_drift.py): which episodes score which checkpoint, and what a pack holds."""

import json
from pathlib import Path

import pytest

from collapse_lab.drift_episodes import kept_episodes, near, pack
from tir_rl.report.run_log import SavedTrajectory


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


def _run_folder(root: Path, last_step: int, checkpoint_steps: list[int]) -> Path:
    run = root / "h4_example_s0"
    run.mkdir()
    (run / "config.yaml").write_text("model: lab-sft\n")
    # pack() reads only each line's step; the rest of an episode travels as written
    lines = [json.dumps({"step": s, "episode": e}) for s in range(1, last_step + 1) for e in (0, 1)]
    (run / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    for step in checkpoint_steps:
        model = run / "checkpoints" / f"step_{step}" / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
    return run


def _packed_steps(packed: Path) -> list[int]:
    lines = (packed / "trajectories.jsonl").read_text().splitlines()
    return sorted({json.loads(line)["step"] for line in lines})


def test_a_pack_holds_the_chosen_models_and_only_the_episodes_they_are_scored_on(tmp_path):
    run = _run_folder(tmp_path, last_step=300, checkpoint_steps=[50, 100, 300])
    packed = pack(run, {0, 100, 300}, window=25, into=tmp_path / "pack")
    assert _packed_steps(packed) == [*range(1, 26), *range(101, 126), *range(276, 301)]
    models = sorted(p.parent.name for p in packed.glob("checkpoints/*/model"))
    assert models == ["step_100", "step_300"]  # step 0 is the run's own model, not copied
    assert (packed / "config.yaml").read_text() == "model: lab-sft\n"


def test_a_packed_last_checkpoint_keeps_its_look_back_window(tmp_path):
    run = _run_folder(tmp_path, last_step=205, checkpoint_steps=[200, 205])
    packed = pack(run, {205}, window=25, into=tmp_path / "pack")
    assert _packed_steps(packed) == list(range(181, 206))


def test_a_run_that_kept_no_episodes_is_refused_by_scoring_and_by_packing(tmp_path):
    run = _run_folder(tmp_path, last_step=0, checkpoint_steps=[0])
    (run / "trajectories.jsonl").write_text("\n")
    for read in (lambda: kept_episodes(run), lambda: pack(run, {0}, 25, tmp_path / "pack")):
        with pytest.raises(SystemExit, match="kept no episodes .run.save_trajectories was 0"):
            read()
    assert not (tmp_path / "pack").exists()
