"""Precision drift: does a bf16 sampler's gap grow as RL moves the weights?

For each kept checkpoint of a run (and the run's starting model as step 0), scores the
episodes the run sampled near that step twice: by the float32 trainer (the reference) and by
the same weights cast to bfloat16 (`precision_gap.py`'s `bf16-weights`, a plain transformers
forward, not vLLM's kernels). Prints k3, mean |Δℓ| and geo_rs's rejected share per
checkpoint, as if a bf16 sampler had held those weights.

Episodes for checkpoint N are those of steps N+1 .. N+window (the steps its weights
sampled in a synchronous run); the last checkpoint, with no later steps, takes N-window+1
.. N. Logprobs are at temperature 1 whatever the run sampled at: the gap of the weights, on
the text they wrote.

    python bench/precision_drift.py runs/sft-long/RUN [more runs] --window 25

`--steps` scores only the named checkpoints. `--pack DIR` scores nothing: it copies what
scoring the named checkpoints needs (each run's config, those models, the episodes near
them) into DIR, small enough to travel to a GPU machine and be scored there with
`--device cuda`, on the same episodes.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import mfu
import torch
from precision_gap import gap_row, plain_logprobs, trainer_logprobs

from tir_rl.config import load
from tir_rl.models import resolve_model
from tir_rl.report.run_log import SavedTrajectory, load_trajectories
from tir_rl.run_config import RunConfig
from tir_rl.trainer.batch import TrainBatch


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
    if not kept:
        raise SystemExit(f"{run} kept no episodes (run.save_trajectories was 0)")


def kept_episodes(run: Path) -> list[SavedTrajectory]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders with checkpoints/")
    parser.add_argument("--window", type=int, default=25, help="steps of episodes per point")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--steps", help="comma-separated checkpoint steps (default: all)")
    parser.add_argument("--pack", type=Path, help="copy the inputs into this folder instead")
    args = parser.parse_args()
    steps = {int(s) for s in args.steps.split(",")} if args.steps else None

    if args.pack:
        for run in args.runs:
            wanted = steps if steps is not None else {step for step, _ in checkpoints(run)}
            print(pack(run, wanted, args.window, args.pack))
        return
    device = mfu.pick_device(args.device)
    rows = []
    for run in args.runs:
        saved = kept_episodes(run)
        for step, model in checkpoints(run):
            if steps is not None and step not in steps:
                continue
            episodes, episode_steps = near(saved, step, args.window)
            batch = TrainBatch.from_trajectories(episodes)
            reference = trainer_logprobs(model, device, batch)
            bf16 = plain_logprobs(model, device, batch, torch.bfloat16)
            _, *gap = gap_row("", reference, bf16, batch)
            tokens = str(int(batch.loss_mask.sum()))
            rows.append([run.name, str(step), episode_steps, str(len(episodes)), tokens, *gap])
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"device={device}{gpu} torch={torch.__version__} window={args.window}")
    mfu.print_table(
        ["run", "weights after step", "episodes of steps", "episodes", "model tokens",
         "bf16 k3", "mean abs Δℓ", "max abs Δℓ", "geo_rs rejects"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
