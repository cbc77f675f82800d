"""Shared by the trainer cost benches: their common flags, one timed variant, the child runs.

A variant runs in its own child process because peak RSS never goes down inside a process:
the parent re-runs its own script with `--child VARIANT` and reads the JSON line it prints.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from trainer_packing import make_batch

if TYPE_CHECKING:
    from tir_rl.trainer import StepResult, Trainer
    from tir_rl.trainer.lora import LoRAConfig


def add_trainer_args(parser: argparse.ArgumentParser, variants: Sequence[str]) -> None:
    """The model, device, LoRA rank, batch and timing flags every trainer bench takes."""
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
    parser.add_argument("--child", choices=list(variants), help=argparse.SUPPRESS)


def lora_config(args: argparse.Namespace, enabled: bool) -> LoRAConfig:
    """Rank `--r`, alpha 2r, on every `*_proj` (the default targets) when `enabled`."""
    from tir_rl.trainer.lora import LoRAConfig

    return LoRAConfig(enabled=True, r=args.r, alpha=2.0 * args.r) if enabled else LoRAConfig()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def time_steps(
    trainer: Trainer, args: argparse.Namespace, built_mib: float
) -> tuple[dict[str, float], StepResult]:
    """`--warmup` GRPO steps, then the mean time of `--steps` more on the same random batch.

    Returns the step time, `built_mib` (RSS after construction, measured by the caller), the
    peak RSS of the process, the CUDA peak, the batch's token count, and the last step.
    """
    # every completion token a model token (no tool gap)
    batch = make_batch(args.num_seqs, args.min_len, args.max_len, seed=0, tool_gap=0)
    advantages = torch.linspace(-1.0, 1.0, batch.num_sequences)
    for _ in range(args.warmup):
        trainer.train_step(batch, advantages)
    start = time.perf_counter()
    for _ in range(args.steps):
        result = trainer.train_step(batch, advantages)
    step_s = (time.perf_counter() - start) / args.steps
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    row = {
        "step_s": step_s,
        "rss_built_mib": built_mib,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": cuda_peak,
        "tokens": float(batch.num_tokens),
    }
    return row, result


def run_children(script: str, variants: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each variant's row, measured by `script --child VARIANT` with this run's flags."""
    rows = {}
    for variant in variants:
        out = subprocess.run(
            [sys.executable, script, *sys.argv[1:], "--child", variant],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def memory_keys(args: argparse.Namespace) -> list[str]:
    """The rows every table prints: step time and memory (the CUDA peak on a GPU)."""
    keys = ["step_s", "rss_built_mib", "peak_rss_mib"]
    if args.device.startswith("cuda"):
        keys.append("cuda_peak_mib")
    return keys
