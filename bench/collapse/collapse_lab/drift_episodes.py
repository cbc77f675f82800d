"""The precision-drift study's episodes: which ones score which checkpoint, and the pack.

bench/precision_drift.py scores each kept checkpoint of a run (and the run's starting model as
step 0) on the episodes the run sampled near that step. Episodes for checkpoint N are those of
steps N+1 .. N+window (the steps its weights sampled in a synchronous run); the last
checkpoint, with no later steps, takes N-window+1 .. N. A pack copies what scoring some
checkpoints needs (the run's config, those models, the episodes near them) to another folder,
small enough to travel to a GPU machine and be scored there on the same episodes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tir_rl.config import load
from tir_rl.models import resolve_model
from tir_rl.report.run_log import SavedTrajectory, load_trajectories
from tir_rl.run_config import RunConfig


def checkpoints(run: Path) -> list[tuple[int, str]]:
    """(step, model folder) for step 0 (the run's `model`) and every kept checkpoint."""
    start = str(resolve_model(load(RunConfig, run / "config.yaml", []).model))
    found = [(0, start)]
    for folder in (run / "checkpoints").glob("step_*"):
        match = re.fullmatch(r"step_(\d+)", folder.name)
        if match and (folder / "model" / "config.json").is_file():
            found.append((int(match.group(1)), str(folder / "model")))
    return sorted(found)


def scored_steps(last: int, step: int, window: int) -> tuple[int, int]:
    """First and last step of the episodes checkpoint `step` is scored on: those its weights
    sampled next, or, for a checkpoint at the `last` step, the `window` steps up to it."""
    lo, hi = (step + 1, step + window) if step < last else (step - window + 1, step)
    return lo, min(hi, last)


def near(saved: list[SavedTrajectory], step: int, window: int) -> tuple[list, str]:
    """The episodes checkpoint `step` is scored on, and their steps as text."""
    lo, hi = scored_steps(max(s.step for s in saved), step, window)
    return [s.trajectory for s in saved if lo <= s.step <= hi], f"{lo}-{hi}"


def _refuse_empty(run: Path, kept: list) -> None:
    """Stop with the reason when `run` kept no episodes: there is nothing to score."""
    if not kept:
        raise SystemExit(f"{run} kept no episodes (run.save_trajectories was 0)")


def kept_episodes(run: Path) -> list[SavedTrajectory]:
    """The episodes `run` saved (`run.save_trajectories`); a run that saved none is refused."""
    saved = load_trajectories(run / "trajectories.jsonl")
    _refuse_empty(run, saved)
    return saved


def pack(run: Path, steps: set[int], window: int, into: Path) -> Path:
    """Copy `run`'s config, the models of its checkpoints in `steps` and the episodes they
    are scored on into `into / run.name`; scoring the copy gives the same rows."""
    text = (run / "trajectories.jsonl").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines(keepends=True) if line.strip()]
    line_steps = [json.loads(line)["step"] for line in lines]
    _refuse_empty(run, line_steps)
    chosen = [(step, model) for step, model in checkpoints(run) if step in steps]
    if not chosen:
        raise SystemExit(f"{run} has no checkpoint at steps {sorted(steps)}")
    wanted = set()
    for step, _ in chosen:
        lo, hi = scored_steps(max(line_steps), step, window)
        wanted |= set(range(lo, hi + 1))
    out = into / run.name
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(run / "config.yaml", out / "config.yaml")
    kept = [line for line, step in zip(lines, line_steps, strict=True) if step in wanted]
    (out / "trajectories.jsonl").write_text("".join(kept), encoding="utf-8")
    for step, model in chosen:
        if step:
            shutil.copytree(model, out / "checkpoints" / f"step_{step}" / "model")
    return out
