"""The plain training loop of issue 13 beside the trainer's update pass, measured in one run.

The plain loop is what a short script does: a transformers causal LM (sdpa attention) with
float32 weights under autocast in `--dtype`, rows of `--rows-per-step` sequences right-padded
to the longest, full-vocabulary float32 log-softmax, a policy-gradient loss over the loss
mask, backward, AdamW (fused on CUDA), one optimizer step per row group. The trainer runs
`train_step` with ℓ^old given (the update pass: forward + backward + AdamW, no recompute) on
the same sequences, under `--packing`. Both report real (unpadded) tokens/s and model FLOPs
utilisation (bench/mfu.py); the last column is trainer ÷ plain.

    python bench/plain_loop.py --model tiny --dtype float32
    python bench/plain_loop.py --model small8m --dtype float32
    python bench/plain_loop.py --device cuda --dtype bfloat16 --model PATH --num-seqs 64 \\
        --min-len 256 --max-len 2048 --micro-batch-tokens 8192
"""

from __future__ import annotations

import argparse
import contextlib
import time

import mfu
import torch
from trainer_packing import make_batch

from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing, TrainBatch


def plain_rows(batch: TrainBatch, rows_per_step: int):
    """Per step: [R, L] input ids, [R, L-1] targets, [R, L-1] loss mask, [R] sequence ids."""
    for start in range(0, batch.num_sequences, rows_per_step):
        seqs = list(range(start, min(start + rows_per_step, batch.num_sequences)))
        width = int(batch.total_lens[seqs].max())
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for r, i in enumerate(seqs):
            prompt, n = batch.prompt_ids[i], int(batch.completion_lens[i])
            ids[r, : len(prompt) + n] = torch.cat([prompt, batch.completion_ids[i, :n]])
            mask[r, len(prompt) : len(prompt) + n] = batch.loss_mask[i, :n]
        yield ids, ids[:, 1:], mask[:, 1:], torch.tensor(seqs)


def run_plain_loop(model_path: str, batch: TrainBatch, args, device: torch.device) -> float:
    """Seconds of one pass of the plain loop over `batch` (after a one-step warm-up)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    advantages = torch.linspace(-1, 1, batch.num_sequences, device=device)
    compute = mfu.DTYPES[args.dtype]
    autocast = (
        contextlib.nullcontext()
        if compute == torch.float32
        else torch.autocast(device_type=device.type, dtype=compute)
    )

    def step(ids, targets, mask, seqs) -> None:
        ids, targets, mask = ids.to(device), targets.to(device), mask.to(device)
        with autocast:
            logits = model(input_ids=ids).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
        weights = mask.float() * advantages[seqs.to(device)][:, None]
        loss = -(logprobs * weights).sum() / mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(*next(plain_rows(batch.select([0]), 1)))  # warm-up
    mfu.synchronize(device)
    start = time.perf_counter()
    for rows in plain_rows(batch, args.rows_per_step):
        step(*rows)
    mfu.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny, small8m, llama-0.5b, bundled or a path"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=list(mfu.DTYPES), default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--rows-per-step", type=int, default=4, help="plain loop rows per step")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="trainer budget")
    parser.add_argument("--packing", choices=[p.value for p in Packing], default="packed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = mfu.pick_device(args.device)
    model_path = mfu.resolve_bench_model(args.model)
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, args.seed)
    trainer = Trainer(
        Trainer.Config(
            model=model_path,
            micro_batch_tokens=args.micro_batch_tokens,
            device=str(device),
            dtype=args.dtype,
            packing=Packing(args.packing),
        )
    )
    peak, peak_source = mfu.peak_tflops(device, args.dtype, args.peak_tflops)
    flops = mfu.model_flops(trainer.model, batch.total_lens.tolist(), backward=True)
    num_params = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"model={args.model} ({num_params / 1e6:.1f}M parameters) device={device} "
        f"dtype={args.dtype} sequences={batch.num_sequences} tokens={batch.num_tokens} "
        f"threads={torch.get_num_threads()} peak={peak:.3g} TFLOP/s ({peak_source})"
    )
    advantages = torch.linspace(-1, 1, batch.num_sequences)
    old = trainer.compute_logprobs(batch)
    trainer.train_step(batch.select([0]), advantages[:1])  # warm-up
    mfu.reset_peak_memory(device)
    start = time.perf_counter()
    trainer.train_step(batch, advantages, old_logprobs=old)
    trainer_s = time.perf_counter() - start
    trainer_memory = mfu.peak_memory_gib(device)
    model_path = str(trainer.model_path)  # `tiny`/`bundled` resolved to a folder
    del trainer
    mfu.reset_peak_memory(device)
    if device.type == "cuda":  # the plain loop runs with torch's default attention kernels
        torch.backends.cuda.enable_cudnn_sdp(True)
    plain_s = run_plain_loop(model_path, batch, args, device)
    plain_memory = mfu.peak_memory_gib(device)

    def row(name: str, seconds: float, memory: str) -> list[str]:
        mfu_pct = 100 * flops / seconds / (peak * 1e12)
        ratio = f"{plain_s / seconds:.2f}"
        return [name, f"{batch.num_tokens / seconds:.0f}", f"{mfu_pct:.1f}%", memory, ratio]

    mfu.print_table(
        ["loop", "tokens/s", "MFU", "peak GiB", "speed ÷ plain"],
        [
            row(f"plain ({args.rows_per_step} padded rows/step)", plain_s, plain_memory),
            row(f"trainer update pass ({args.packing})", trainer_s, trainer_memory),
        ],
    )


if __name__ == "__main__":
    main()
