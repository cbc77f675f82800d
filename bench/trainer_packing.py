"""Trainer tokens/s with and without padding-free packing, on a realistic length spread.

Episodes get lengths drawn uniformly from [--min-len, --max-len] (prompt 10%, completion 90%,
one model-token turn and tool tokens in between). For each layout (packed, bucketed, padded)
the script times `Trainer.compute_logprobs` (the no-grad recompute) and, with `--train`, a
full `train_step` (recompute + forward/backward + AdamW), and prints real (unpadded)
tokens per second and the ratio to the padded baseline, measured in one run.

    python bench/trainer_packing.py                      # bundled SmolLM2-135M, CPU fp32
    python bench/trainer_packing.py --model tiny --num-seqs 32 --train
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tir_rl.batch import Packing, TrainBatch, plan_micro_batches
from tir_rl.trainer import Trainer
from tir_rl.types import Trajectory


def make_batch(num_seqs: int, min_len: int, max_len: int, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    trajectories = []
    for _ in range(num_seqs):
        total = rng.randint(min_len, max_len)
        prompt = max(1, total // 10)
        n = total - prompt
        mask = [1] * (n // 2) + [0] * 8 + [1] * (n - n // 2 - 8)
        trajectories.append(
            Trajectory(
                prompt_ids=[rng.randrange(1, 40000) for _ in range(prompt)],
                completion_ids=[rng.randrange(1, 40000) for _ in range(n)],
                loss_mask=mask[:n],
                sampler_logprobs=[-5.0] * n,
                turn_ids=[0] * (n // 2) + [1] * (n - n // 2),
            )
        )
    return TrainBatch.from_trajectories(trajectories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--train", action="store_true", help="also time a full train_step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layouts", default="padded,bucketed,packed", help="order to time them in (first = base)"
    )
    args = parser.parse_args()

    batch = make_batch(args.num_seqs, args.min_len, args.max_len, args.seed)
    lens = batch.total_lens
    print(
        f"model={args.model} sequences={batch.num_sequences} tokens={batch.num_tokens} "
        f"lengths min/mean/max={int(lens.min())}/{float(lens.float().mean()):.0f}/"
        f"{int(lens.max())} budget={args.micro_batch_tokens} threads={torch.get_num_threads()}"
    )
    trainer = Trainer(Trainer.Config(model=args.model, micro_batch_tokens=args.micro_batch_tokens))
    advantages = torch.linspace(-1, 1, batch.num_sequences)
    rows = []
    for packing in [Packing(name) for name in args.layouts.split(",")]:
        trainer.config.packing = packing
        plan = plan_micro_batches(batch, args.micro_batch_tokens, packing)
        computed = sum(mb.num_padded_tokens for mb in plan)
        trainer.compute_logprobs(batch.select([0]))  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            trainer.compute_logprobs(batch)
        fwd_s = (time.perf_counter() - t0) / args.repeats
        step_s = float("nan")
        if args.train:
            t0 = time.perf_counter()
            trainer.train_step(batch, advantages)
            step_s = time.perf_counter() - t0
        rows.append((packing.value, len(plan), computed, fwd_s, step_s))

    base = next((r for r in rows if r[0] == Packing.PADDED.value), rows[0])
    base_fwd, base_step = base[3], base[4]
    print(
        f"{'layout':<10}{'passes':>7}{'computed tok':>14}{'recompute tok/s':>17}"
        f"{'ratio':>7}{'train_step tok/s':>18}{'ratio':>7}"
    )
    for name, passes, computed, fwd_s, step_s in rows:
        print(
            f"{name:<10}{passes:>7}{computed:>14}{batch.num_tokens / fwd_s:>17.0f}"
            f"{base_fwd / fwd_s:>7.2f}{batch.num_tokens / step_s:>18.0f}{base_step / step_s:>7.2f}"
        )


if __name__ == "__main__":
    main()
