"""Precision drift: does a bf16 sampler's gap grow as RL moves the weights?

For each kept checkpoint of a run (and the run's starting model as step 0), scores the
episodes the run sampled near that step twice: by the float32 trainer (the reference) and by
the same weights cast to bfloat16 (`precision_gap.py`'s `bf16-weights`, a plain transformers
forward, not vLLM's kernels). Prints k3, mean |Δℓ| and geo_rs's rejected share per
checkpoint, as if a bf16 sampler had held those weights.

Episodes for checkpoint N are those of steps N+1 .. N+window (the steps its weights
sampled in a synchronous run); the last checkpoint, with no later steps, takes N-window+1
.. N (`collapse_lab.drift_episodes` chooses them, and makes the pack). Logprobs are at
temperature 1 whatever the run sampled at: the gap of the weights, on the text they wrote.

    python bench/precision_drift.py runs/sft-long/RUN [more runs] --window 25

`--steps` scores only the named checkpoints. `--pack DIR` scores nothing: it copies what
scoring the named checkpoints needs (each run's config, those models, the episodes near
them) into DIR, small enough to travel to a GPU machine and be scored there with
`--device cuda`, on the same episodes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mfu
import torch
from precision_gap import gap_row, plain_logprobs, trainer_logprobs

from collapse_lab.drift_episodes import checkpoints, kept_episodes, near, pack
from tir_rl.trainer.batch import TrainBatch


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
