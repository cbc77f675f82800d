"""The sampler/trainer mismatch that vLLM's prefix cache adds within one policy version.

A multi-turn episode's later turns re-send its whole context; with the prefix cache on, the
engine reuses the KV blocks it computed for an earlier turn (in another batch, at another
batch shape) instead of prefilling them again, which can change the sampler's logprobs by
float rounding. This measures it: for each sampler dtype, the same tasks are played with the
same engine seed with the cache off and on (block size `--block-size`), and the trainer
(float32, the run's weights, no update in between) scores every sampled token. The arms do
not sample the same tokens (the config's per-turn seeds are off, and the engine's draws
follow its batches): the metrics compare the two caches over the same tasks. The table
gives, per arm, the model tokens scored, k3 KL and mean and max |Δ logprob| over them, and
the ratio of each arm's k3 to the cache-off arm's at the same dtype.

    python bench/prefix_cache_mismatch.py --config configs/lab_sft.yaml --set run.seed=0 \\
        --tasks 8 --group 8 | grep -v '^(' > bench/prefix_cache_records/lab_sft_seed0.txt

(`run.seed` seeds the engine and the tasks; vLLM's own log lines start with a parenthesis.)
"""

from __future__ import annotations

import argparse
import sys


def measure(config_path: str, sets: list[str], num: int, group: int) -> dict[str, float]:
    """Play `num` episodes under `config_path` + `sets`; the trainer's mismatch metrics."""
    from tir_rl.config import load
    from tir_rl.mismatch import mismatch_metrics
    from tir_rl.run_config import RunConfig
    from tir_rl.runtime import play_episodes
    from tir_rl.trainer import TrainBatch, Trainer

    config = load(RunConfig, config_path, sets)
    trajectories = [
        t for t in play_episodes(config, num=num, group_size=group) if t.num_model_tokens > 0
    ]
    batch = TrainBatch.from_trajectories(trajectories)
    trainer = Trainer(config.trainer)
    logprobs = trainer.compute_logprobs(batch)
    metrics = mismatch_metrics(logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids)
    return {
        "tokens": float(batch.loss_mask.sum()),
        "k3": float(metrics["mismatch/k3_kl"]),
        "mean": float(metrics["mismatch/abs_diff_mean"]),
        "max": float(metrics["mismatch/abs_diff_max"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], help="key=value override")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        for cache in (False, True):
            sets = [
                *args.set,
                f"engine.dtype={dtype}",
                f"engine.local.enable_prefix_caching={str(cache).lower()}",
                f"engine.local.block_size={args.block_size}",
                "run.parity_tolerance=1.0",
            ]
            rows.append(
                (dtype, cache, measure(args.config, sets, args.tasks * args.group, args.group))
            )
    print(f"config {args.config} {' '.join(args.set)}: {args.tasks} tasks x {args.group}, "
          f"block size {args.block_size}, trainer float32")  # fmt: skip
    print(f"{'sampler':<9} {'prefix cache':<12} {'tokens':>7} {'k3':>9} {'mean |dlogp|':>12} "
          f"{'max |dlogp|':>11} {'k3 / off':>9}")  # fmt: skip
    for dtype, cache, m in rows:
        off = next(r[2] for r in rows if r[0] == dtype and not r[1])
        ratio = m["k3"] / off["k3"] if off["k3"] else float("nan")
        print(f"{dtype:<9} {'on' if cache else 'off':<12} {m['tokens']:>7.0f} {m['k3']:>9.2e} "
              f"{m['mean']:>12.2e} {m['max']:>11.2e} {ratio:>9.2f}")  # fmt: skip
    return None


if __name__ == "__main__":
    sys.exit(main())
