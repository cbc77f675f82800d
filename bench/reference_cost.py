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
import resource
import subprocess
import sys
import time

import torch
from trainer_packing import make_batch

from tir_rl.trainer import Trainer
from tir_rl.trainer.lora import LoRAConfig
from tir_rl.trainer.loss import GRPOLoss

VARIANTS = ("full", "full_kl", "lora", "lora_kl")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def measure(args: argparse.Namespace, variant: str) -> dict[str, float]:
    """Build one trainer in this process and time its steps."""
    lora = (
        LoRAConfig(enabled=True, r=args.r, alpha=2.0 * args.r)
        if variant.startswith("lora")
        else LoRAConfig()
    )
    config = Trainer.Config(
        model=args.model, lr=1e-5, device=args.device, dtype=args.dtype, lora=lora,
        micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip
    kl_coef = args.kl_coef if variant.endswith("_kl") else 0.0
    trainer = Trainer(config, loss_fn=GRPOLoss(GRPOLoss.Config(kl_coef=kl_coef)))
    built_mib = rss_mib()
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, seed=0, tool_gap=0)
    advantages = torch.linspace(-1.0, 1.0, batch.num_sequences)
    for _ in range(args.warmup):
        trainer.train_step(batch, advantages)
    start = time.perf_counter()
    for _ in range(args.steps):
        result = trainer.train_step(batch, advantages)
    step_s = (time.perf_counter() - start) / args.steps
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    return {
        "step_s": step_s,
        "rss_built_mib": built_mib,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": cuda_peak,
        "ref_kl": result.metrics.get("train/ref_kl", 0.0),
        "tokens": float(batch.num_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2r), all *_proj")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return
    rows = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child", variant],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"model {args.model}, {args.device} {args.dtype}, kl_coef {args.kl_coef}, LoRA r={args.r} "
        f"on every *_proj, {int(rows['full']['tokens'])} tokens per step, mean of {args.steps} "
        f"steps after {args.warmup}"
    )
    head = ["full", "full + ref", "ratio", "LoRA", "LoRA + ref", "ratio"]
    print("| " + " | ".join([f"{'':<14}", *[f"{h:>10}" for h in head]]) + " |")
    print("|" + "|".join(["-" * 16, *["-" * 12] * len(head)]) + "|")
    keys = ["step_s", "rss_built_mib", "peak_rss_mib"]
    if args.device.startswith("cuda"):
        keys.append("cuda_peak_mib")
    for key in keys:
        cells = []
        for base, kl in (("full", "full_kl"), ("lora", "lora_kl")):
            a, b = rows[base][key], rows[kl][key]
            cells += [f"{a:>10.4g}", f"{b:>10.4g}", f"{b / a if a else float('nan'):>10.3f}"]
        print("| " + " | ".join([f"{key:<14}", *cells]) + " |")


if __name__ == "__main__":
    main()
