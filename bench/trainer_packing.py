"""Trainer tokens/s and MFU per layout (packed, bucketed, padded) on a realistic length spread.

Episodes get lengths drawn uniformly from [--min-len, --max-len] (prompt 10%, completion 90%,
one model-token turn and tool tokens in between). For each layout the script times
`Trainer.compute_logprobs` (the no-grad recompute) and, with `--train`, the update pass
(`train_step` with ℓ^old given: forward + backward + AdamW, no recompute inside), the
one-pass step (`train_step` alone: ℓ^old = ℓ^θ detached) and the two-pass step (recompute,
then the update). It prints real (unpadded) tokens/s, model FLOPs utilisation (bench/mfu.py)
and ratios, all measured in one run.

    python bench/trainer_packing.py                      # bundled SmolLM2-135M, CPU fp32
    python bench/trainer_packing.py --model tiny --num-seqs 32 --train
    python bench/trainer_packing.py --device cuda --dtype bfloat16 --num-seqs 64 \\
        --min-len 256 --max-len 2048 --micro-batch-tokens 8192 --train
"""

from __future__ import annotations

import argparse
import random
import time

import mfu
import torch

from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.types import Trajectory


def make_batch(
    num_seqs: int, min_len: int, max_len: int, seed: int, *, tool_gap: int = 8
) -> TrainBatch:
    """Random sequences: prompt 10%, then a model turn, `tool_gap` tool tokens, a second turn."""
    rng = random.Random(seed)
    trajectories = []
    for _ in range(num_seqs):
        total = rng.randint(min_len, max_len)
        prompt = max(1, total // 10)
        n = total - prompt
        mask = [1] * (n // 2) + [0] * tool_gap + [1] * (n - n // 2 - tool_gap)
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


def timed(fn, repeats: int) -> float:
    """Mean seconds of `fn` (each call ends with a host read, so no extra sync is needed)."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="bundled", help="bundled, tiny, small8m, llama-0.5b or a path"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=list(mfu.DTYPES), default="float32")
    parser.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--warm-shapes",
        action="store_true",
        help="run each timed pass once on the whole batch first: its micro-batch shapes are "
        "then warm (cuDNN attention plans a new shape on first use); default: fresh shapes, "
        "as each training step's new lengths give",
    )
    parser.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="CUDA: trainer.cudnn_attention (let sdpa use cuDNN; off by default)",
    )
    parser.add_argument("--train", action="store_true", help="also time the training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layouts", default="padded,bucketed,packed", help="order to time them in (first = base)"
    )
    args = parser.parse_args()

    device = mfu.pick_device(args.device)
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, args.seed)
    lens = batch.total_lens
    config = Trainer.Config(
        model=mfu.resolve_bench_model(args.model),
        micro_batch_tokens=args.micro_batch_tokens,
        device=str(device),
        dtype=args.dtype,
        cudnn_attention=args.cudnn_attention,
    )
    trainer = Trainer(config)
    peak, peak_source = mfu.peak_tflops(device, args.dtype, args.peak_tflops)
    print(
        f"model={args.model} device={device} dtype={args.dtype} sequences={batch.num_sequences} "
        f"tokens={batch.num_tokens} lengths min/mean/max={int(lens.min())}/"
        f"{float(lens.float().mean()):.0f}/{int(lens.max())} budget={args.micro_batch_tokens} "
        f"threads={torch.get_num_threads()} peak={peak:.3g} TFLOP/s ({peak_source}) "
        f"shapes={'warm' if args.warm_shapes else 'fresh'} "
        f"cudnn_attention={args.cudnn_attention}"
    )
    seq_lens = lens.tolist()
    forward_flops = mfu.model_flops(trainer.model, seq_lens, backward=False)
    train_flops = mfu.model_flops(trainer.model, seq_lens, backward=True)
    advantages = torch.linspace(-1, 1, batch.num_sequences)
    results = []
    for packing in [Packing(name) for name in args.layouts.split(",")]:
        trainer.config.packing = packing
        plan = plan_micro_batches(batch, args.micro_batch_tokens, packing)
        computed = sum(mb.num_padded_tokens for mb in plan)
        trainer.compute_logprobs(batch.select([0]))  # warm-up
        mfu.reset_peak_memory(device)
        old = trainer.compute_logprobs(batch)
        recompute_s = timed(lambda: trainer.compute_logprobs(batch), args.repeats)
        timings = {"recompute": recompute_s}
        if args.train:
            trainer.train_step(batch.select([0]), advantages[:1])  # warm-up of backward/AdamW
            if args.warm_shapes:
                trainer.train_step(batch, advantages, old_logprobs=old)
            timings["update"] = timed(
                lambda old=old: trainer.train_step(batch, advantages, old_logprobs=old),
                args.repeats,
            )
            timings["one_pass"] = timed(lambda: trainer.train_step(batch, advantages), args.repeats)
            timings["two_pass"] = recompute_s + timings["update"]
        results.append((packing.value, len(plan), computed, timings, mfu.peak_memory_gib(device)))

    base = next((r for r in results if r[0] == Packing.PADDED.value), results[0])[3]
    tokens = batch.num_tokens

    def rate(seconds: float, flops: float) -> list[str]:
        return [f"{tokens / seconds:.0f}", f"{100 * flops / seconds / (peak * 1e12):.1f}%"]

    header = ["layout", "passes", "computed tok", "recompute tok/s", "MFU", "÷ base"]
    if args.train:
        header += ["update tok/s", "MFU", "÷ base", "one-pass step tok/s", "two-pass ÷ one-pass"]
    header.append("peak GiB")
    rows = []
    for name, passes, computed, timings, memory in results:
        row = [name, str(passes), str(computed), *rate(timings["recompute"], forward_flops)]
        row.append(f"{base['recompute'] / timings['recompute']:.2f}")
        if args.train:
            row += rate(timings["update"], train_flops)
            row.append(f"{base['update'] / timings['update']:.2f}")
            row.append(f"{tokens / timings['one_pass']:.0f}")
            row.append(f"{timings['two_pass'] / timings['one_pass']:.2f}")
        rows.append([*row, memory])
    mfu.print_table(header, rows)


if __name__ == "__main__":
    main()
