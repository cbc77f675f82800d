"""What the KL penalty's reference policy costs: step time and memory, measured in one run.

Four variants, each in its own child process (peak RSS never goes down inside a process):
full fine-tuning and LoRA, each with `loss.kl_coef` 0 (no reference) and > 0 (a frozen
float32 copy; under LoRA the policy with its adapters disabled, no copy). Each builds the
`Trainer`, takes `--warmup` GRPO steps, times `--steps` more on the same random batch, and
reports the mean step time, the RSS after construction, the peak RSS and, on CUDA,
`torch.cuda.max_memory_allocated`. The table ends with kl ÷ no-kl ratios.

    python bench/reference_cost.py --model lab                  # the lab model, CPU fp32
    python bench/reference_cost.py                              # bundled SmolLM2-135M
    python bench/reference_cost.py --device cuda --dtype bfloat16 --num-seqs 32 --max-len 2048
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
from tir_rl.trainer.loss import GRPOLoss, LossTerms

VARIANTS = ("full", "full_kl", "lora", "lora_kl")


def measure(args: argparse.Namespace, variant: str) -> dict[str, float]:
    """Build one trainer in this process and time its steps."""
    config = Trainer.Config(
        model=args.model, lr=1e-5, device=args.device, dtype=args.dtype,
        lora=lora_config(args, variant.startswith("lora")),
        micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip
    kl_coef = args.kl_coef if variant.endswith("_kl") else 0.0
    trainer = Trainer(config, loss_fn=GRPOLoss(terms=LossTerms(kl_coef=kl_coef)))
    row, last = time_steps(trainer, args, rss_mib())
    return {**row, "ref_kl": last.metrics.get("train/ref_kl", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kl-coef", type=float, default=0.05)
    add_trainer_args(parser, VARIANTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return
    rows = run_children(__file__, VARIANTS)
    print(
        f"model {args.model}, {args.device} {args.dtype}, kl_coef {args.kl_coef}, LoRA r={args.r} "
        f"on every *_proj, {int(rows['full']['tokens'])} tokens per step, mean of {args.steps} "
        f"steps after {args.warmup}"
    )
    head = ["full", "full + ref", "ratio", "LoRA", "LoRA + ref", "ratio"]
    print("| " + " | ".join([f"{'':<14}", *[f"{h:>10}" for h in head]]) + " |")
    print("|" + "|".join(["-" * 16, *["-" * 12] * len(head)]) + "|")
    for key in memory_keys(args):
        cells = []
        for base, kl in (("full", "full_kl"), ("lora", "lora_kl")):
            a, b = rows[base][key], rows[kl][key]
            cells += [f"{a:>10.4g}", f"{b:>10.4g}", f"{b / a if a else float('nan'):>10.3f}"]
        print("| " + " | ".join([f"{key:<14}", *cells]) + " |")


if __name__ == "__main__":
    main()
