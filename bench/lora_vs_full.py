"""Trainer step time and peak memory: full fine-tuning against LoRA, measured in one run.

Each variant runs in its own child process (peak RSS never goes down inside a process):
it builds the `Trainer`, takes `--warmup` GRPO steps, then times `--steps` more on the same
random batch, and reports the mean step time, the RSS after construction, the peak RSS
(`ru_maxrss`, the whole process: model, gradients, AdamW state, activations) and, on CUDA,
`torch.cuda.max_memory_allocated`. The table ends with LoRA ÷ full ratios.

    python bench/lora_vs_full.py                                 # bundled SmolLM2-135M, CPU fp32
    python bench/lora_vs_full.py --model tiny --steps 3
    python bench/lora_vs_full.py --device cuda --dtype bfloat16 --num-seqs 32 --max-len 2048
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from trainer_packing import make_batch

from tir_rl.trainer import Trainer
from tir_rl.trainer.lora import LoRAConfig


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(args: argparse.Namespace, variant: str) -> dict[str, float]:
    """Build one trainer in this process and time its steps."""
    lora = (
        LoRAConfig(enabled=True, r=args.r, alpha=2.0 * args.r)
        if variant == "lora"
        else LoRAConfig()
    )
    config = Trainer.Config(
        model=args.model, lr=1e-5, device=args.device, dtype=args.dtype, lora=lora,
        micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip
    trainer = Trainer(config)
    built_mib = rss_mib()
    num_trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    # every completion token a model token (no tool gap)
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, seed=0, tool_gap=0)
    advantages = torch.linspace(-1.0, 1.0, batch.num_sequences)
    for _ in range(args.warmup):
        trainer.train_step(batch, advantages)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(batch, advantages)
    step_s = (time.perf_counter() - start) / args.steps
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    return {
        "step_s": step_s,
        "rss_built_mib": built_mib,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": cuda_peak,
        "trainable_params": float(num_trainable),
        "tokens": float(batch.num_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r), all *_proj")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return
    rows = {}
    for variant in ("full", "lora"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child", variant],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora = rows["full"], rows["lora"]
    print(
        f"model {args.model}, {args.device} {args.dtype}, LoRA r={args.r} on every *_proj, "
        f"{int(full['tokens'])} tokens per step, mean of {args.steps} steps after {args.warmup}"
    )
    print(f"| {'':<22} | {'full':>12} | {'LoRA':>12} | {'LoRA / full':>11} |")
    print(f"|{'-' * 24}|{'-' * 14}|{'-' * 14}|{'-' * 13}|")
    keys = ["trainable_params", "step_s", "rss_built_mib", "peak_rss_mib"]
    if args.device.startswith("cuda"):
        keys.append("cuda_peak_mib")
    for key in keys:
        ratio = lora[key] / full[key] if full[key] else float("nan")
        print(f"| {key:<22} | {full[key]:>12.4g} | {lora[key]:>12.4g} | {ratio:>11.3f} |")


if __name__ == "__main__":
    main()
