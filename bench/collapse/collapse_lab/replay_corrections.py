"""What each correction preset would have done to the episodes a run actually sampled.

    python bench/collapse/replay_corrections.py runs/collapse/uncorrected_s0

Reads the run's `trajectories.jsonl` (sampled episodes saved with the sampler's and the
trainer's logprobs), applies every `MismatchCorrection` preset to them offline (no model,
no training) and prints, per preset: the fraction of model tokens, turns and sequences it
rejects and the spread of its weights. A preset that rejects almost everything would stall
learning at this mismatch; one whose weights are ≈ 1 changes little.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tir_rl.mismatch import MismatchCorrection
from tir_rl.mismatch.correction import PRESET_NAMES
from tir_rl.report.run_log import load_trajectories


def batch_from(run_dir: Path) -> tuple[torch.Tensor, ...]:
    """[B, T] trainer logprobs, sampler logprobs, loss mask and turn ids (right-padded)."""
    saved = [s for s in load_trajectories(run_dir / "trajectories.jsonl") if s.trainer_logprobs]
    if not saved:
        raise SystemExit(f"{run_dir}/trajectories.jsonl holds no episode with trainer logprobs")
    width = max(len(s.trajectory.completion_ids) for s in saved)
    shape = (len(saved), width)
    trainer, sampler = torch.zeros(shape), torch.zeros(shape)
    mask, turns = torch.zeros(shape), torch.zeros(shape, dtype=torch.long)
    for row, s in enumerate(saved):
        n = len(s.trajectory.completion_ids)
        trainer[row, :n] = torch.tensor(s.trainer_logprobs[:n])
        sampler[row, :n] = torch.tensor(s.trajectory.sampler_logprobs[:n])
        mask[row, :n] = torch.tensor(s.trajectory.loss_mask[:n], dtype=torch.float32)
        turns[row, :n] = torch.tensor(s.trajectory.turn_ids[:n])
    finite = torch.isfinite(trainer) & torch.isfinite(sampler)
    mask = mask * finite
    return trainer.nan_to_num(0.0), sampler.nan_to_num(0.0), mask, turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    trainer, sampler, mask, turns = batch_from(args.run_dir)
    tokens = int(mask.sum())
    print(f"{args.run_dir}: {mask.shape[0]} episodes, {tokens} model tokens\n")
    print("| preset | tokens rejected | turns rejected | sequences rejected | "
          "weight mean | weight min | weight max |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in PRESET_NAMES:
        stats = MismatchCorrection(MismatchCorrection.Config.preset(name))(
            trainer, sampler, mask, turns
        ).stats
        print(
            f"| {name} | {stats.masked_token_fraction:.3f} | {stats.masked_turn_fraction:.3f} "
            f"| {stats.masked_seq_fraction:.3f} | {stats.weight_mean:.3f} "
            f"| {stats.weight_min:.3f} | {stats.weight_max:.3f} |"
        )


if __name__ == "__main__":
    main()
