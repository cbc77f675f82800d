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

from trainer_cost import (
    add_trainer_args,
    lora_config,
    memory_keys,
    rss_mib,
    run_children,
    time_steps,
)

from tir_rl.trainer import Trainer

VARIANTS = ("full", "lora")


def measure(args: argparse.Namespace, variant: str) -> dict[str, float]:
    """Build one trainer in this process and time its steps."""
    config = Trainer.Config(
        model=args.model, lr=1e-5, device=args.device, dtype=args.dtype,
        lora=lora_config(args, variant == "lora"), micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip
    trainer = Trainer(config)
    built_mib = rss_mib()
    num_trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    row, _ = time_steps(trainer, args, built_mib)
    return {**row, "trainable_params": float(num_trainable)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trainer_args(parser, VARIANTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return
    rows = run_children(__file__, VARIANTS)
    full, lora = rows["full"], rows["lora"]
    print(
        f"model {args.model}, {args.device} {args.dtype}, LoRA r={args.r} on every *_proj, "
        f"{int(full['tokens'])} tokens per step, mean of {args.steps} steps after {args.warmup}"
    )
    print(f"| {'':<22} | {'full':>12} | {'LoRA':>12} | {'LoRA / full':>11} |")
    print(f"|{'-' * 24}|{'-' * 14}|{'-' * 14}|{'-' * 13}|")
    for key in ["trainable_params", *memory_keys(args)]:
        ratio = lora[key] / full[key] if full[key] else float("nan")
        print(f"| {key:<22} | {full[key]:>12.4g} | {lora[key]:>12.4g} | {ratio:>11.3f} |")


if __name__ == "__main__":
    main()
