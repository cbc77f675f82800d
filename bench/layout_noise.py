"""Trainer layout noise: packed vs padded recompute of the same weights, per compute dtype.

Recomputes ℓ of one batch (bench/trainer_packing.py's length spread) with the packed and
the padded layout and reports the per-token difference and how many model tokens geo_rs's
default band (0.999-1.001 on the per-sequence geometric-mean ratio) would mask if one
layout played the sampler: the part of a rejection band the trainer's own layout eats.

    python bench/layout_noise.py --model tiny --dtype bfloat16
"""

from __future__ import annotations

import argparse

import mfu
from trainer_packing import make_batch

from tir_rl.mismatch import MismatchCorrection, correction
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny, small8m, llama-0.5b, bundled or a path"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = mfu.pick_device(args.device)
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, args.seed)
    mask = batch.loss_mask
    geo = MismatchCorrection.Config.preset("geo_rs")
    rows = []
    for dtype in args.dtypes.split(","):
        config = Trainer.Config(
            model=mfu.resolve_bench_model(args.model), device=str(device), dtype=dtype
        )
        trainer = Trainer(config)
        logprobs = {}
        for packing in (Packing.PACKED, Packing.PADDED):
            trainer.config.packing = packing
            logprobs[packing] = trainer.compute_logprobs(batch)
        diff = (logprobs[Packing.PACKED] - logprobs[Packing.PADDED])[mask].abs()
        fixed = correction(
            logprobs[Packing.PADDED], logprobs[Packing.PACKED], mask, batch.turn_ids, geo
        )
        masked = 1 - float(fixed.loss_mask.sum()) / float(mask.sum())
        rows.append(
            [
                dtype,
                f"{float(diff.mean()):.2e}",
                f"{float(diff.max()):.2e}",
                f"{100 * masked:.1f}%",
            ]
        )
        del trainer
    print(
        f"model={args.model} device={device} sequences={batch.num_sequences} "
        f"model tokens={int(mask.sum())}"
    )
    mfu.print_table(
        ["compute dtype", "mean |Δℓ| packed−padded", "max |Δℓ|", "geo_rs masks (tokens)"], rows
    )


if __name__ == "__main__":
    main()
