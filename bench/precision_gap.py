"""Precision gap: a run's own episodes scored under several numeric settings on one device.

Reads the episodes a run kept (`trajectories.jsonl`: token ids verbatim, the sampler's
logprobs), scores every model token with the trainer in IEEE float32 on `--device` (the
reference), then under each other setting, and prints one row per setting as if that
setting were the sampler beside a float32 trainer: k3 and mean/max |Δℓ| against the
reference (the mismatch metrics' own estimators) and the share of model tokens geo_rs's
default band would reject. The last row is the run's real sampler against the reference.

Settings:
  tf32           the trainer with `trainer.tf32` (CUDA only: TF32 matrix products)
  bf16-autocast  the trainer with bfloat16 compute over float32 master weights
  bf16-weights   the model's weights cast to bfloat16, as a bf16 sampler holds them,
                 scored by a plain transformers forward (not vLLM's kernels)
  fp32-plain     the same plain forward in float32: what the trainer's packed layout
                 changes on its own

    python bench/precision_gap.py --trajectories runs/RUN/trajectories.jsonl --model lab-sft
    python bench/precision_gap.py --device cuda --trajectories ... --model lab-sft
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mfu
import torch

from tir_rl.mismatch import MismatchCorrection, correction
from tir_rl.mismatch.metrics import mismatch_metrics
from tir_rl.models import resolve_model
from tir_rl.report.run_log import load_trajectories
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import TrainBatch

SETTINGS = ("tf32", "bf16-autocast", "bf16-weights", "fp32-plain")


def trainer_logprobs(model: str, device: torch.device, batch: TrainBatch, **config) -> torch.Tensor:
    trainer = Trainer(Trainer.Config(model=model, device=str(device), **config))
    logprobs = trainer.compute_logprobs(batch)
    del trainer
    return logprobs


@torch.no_grad()
def plain_logprobs(
    model: str, device: torch.device, batch: TrainBatch, dtype: torch.dtype
) -> torch.Tensor:
    """[B, T] logprobs of the completion tokens, one sequence per forward, weights in `dtype`."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    for i, prompt in enumerate(batch.prompt_ids):
        n = int(batch.completion_lens[i])
        ids = torch.cat([prompt, batch.completion_ids[i, :n]]).to(device)
        logits = net(ids[None]).logits[0, len(prompt) - 1 : -1].float()
        out[i, :n] = logits.log_softmax(-1).gather(-1, ids[len(prompt) :, None])[:, 0].cpu()
    return out


def gap_row(
    name: str, reference: torch.Tensor, other: torch.Tensor, batch: TrainBatch
) -> list[str]:
    """`other` plays the sampler beside the float32 trainer's `reference`."""
    mask = batch.loss_mask
    metrics = mismatch_metrics(reference, other, mask, batch.turn_ids)
    geo = MismatchCorrection.Config.preset("geo_rs")
    kept = correction(reference, other, mask, batch.turn_ids, geo).loss_mask
    rejected = 1 - float(kept.sum()) / float(mask.sum())
    return [
        name,
        f"{float(metrics['mismatch/k3_kl']):.2e}",
        f"{float(metrics['mismatch/abs_diff_mean']):.2e}",
        f"{float(metrics['mismatch/abs_diff_max']):.2e}",
        f"{100 * rejected:.1f}%",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=Path, required=True, nargs="+")
    parser.add_argument("--model", default="lab-sft", help="a named model or a path")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()

    device = mfu.pick_device(args.device)
    model = str(resolve_model(args.model))
    saved = [s for path in args.trajectories for s in load_trajectories(path)]
    batch = TrainBatch.from_trajectories([s.trajectory for s in saved])
    reference = trainer_logprobs(model, device, batch)
    rows = []
    for setting in args.settings.split(","):
        if setting == "tf32":
            if device.type != "cuda":
                continue
            other = trainer_logprobs(model, device, batch, tf32=True)
        elif setting == "bf16-autocast":
            other = trainer_logprobs(model, device, batch, dtype="bfloat16")
        elif setting == "bf16-weights":
            other = plain_logprobs(model, device, batch, torch.bfloat16)
        elif setting == "fp32-plain":
            other = plain_logprobs(model, device, batch, torch.float32)
        else:
            raise SystemExit(f"unknown setting {setting!r}: choose from {', '.join(SETTINGS)}")
        rows.append(gap_row(setting, reference, other, batch))
    rows.append(gap_row("the run's sampler", reference, batch.sampler_logprobs, batch))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"model={args.model} device={device} ({name}) torch={torch.__version__} "
        f"episodes={batch.num_sequences} model tokens={int(batch.loss_mask.sum())}"
    )
    mfu.print_table(
        ["as the sampler", "k3 vs fp32 trainer", "mean abs Δℓ", "max abs Δℓ", "geo_rs rejects"],
        rows,
    )


if __name__ == "__main__":
    main()
