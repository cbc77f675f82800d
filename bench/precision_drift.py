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
"""

from __future__ import annotations

import argparse
import re
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


def near(saved: list[SavedTrajectory], step: int, window: int) -> tuple[list, str]:
    """The episodes its weights sampled after `step`, else the `window` steps up to it."""
    last = max(s.step for s in saved)
    lo, hi = (step + 1, step + window) if step < last else (step - window + 1, step)
    picked = [s.trajectory for s in saved if lo <= s.step <= hi]
    return picked, f"{lo}-{min(hi, last)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders with checkpoints/")
    parser.add_argument("--window", type=int, default=25, help="steps of episodes per point")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    args = parser.parse_args()

    device = mfu.pick_device(args.device)
    rows = []
    for run in args.runs:
        saved = load_trajectories(run / "trajectories.jsonl")
        if not saved:
            raise SystemExit(f"{run} kept no episodes (run.save_trajectories was 0)")
        for step, model in checkpoints(run):
            episodes, steps = near(saved, step, args.window)
            batch = TrainBatch.from_trajectories(episodes)
            reference = trainer_logprobs(model, device, batch)
            bf16 = plain_logprobs(model, device, batch, torch.bfloat16)
            _, *gap = gap_row("", reference, bf16, batch)
            tokens = str(int(batch.loss_mask.sum()))
            rows.append([run.name, str(step), steps, str(len(episodes)), tokens, *gap])
    print(f"device={device} torch={torch.__version__} window={args.window}")
    mfu.print_table(
        ["run", "weights after step", "episodes of steps", "episodes", "model tokens",
         "bf16 k3", "mean abs Δℓ", "max abs Δℓ", "geo_rs rejects"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
