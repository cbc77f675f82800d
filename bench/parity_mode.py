"""`make train`'s run with `trainer.kernels: vllm_cpu` against the default: k3 and cost.

Runs configs/lab_sft.yaml (10 steps, the trained lab model, float32 vLLM-CPU) three times
with one seed: the default (`trainer.packing shared_prefix`, transformers' kernels),
`packed` with transformers' kernels (the packing the parity mode needs, to separate its
cost from the kernels'), and `packed` with vLLM's kernels. Prints, per arm, the largest
per-step k3 and max |Δ logprob| between the trainer's recomputed logprobs and the sampler's
over the run's steps, how many steps had both exactly 0, the median update time
(`perf/train_s`) and step time, and the held-out pass@1 before and after; then keeps each
run's metrics.jsonl beside the table.

    python bench/parity_mode.py --out bench/parity_records

(`--summarize DIR` prints the table of runs already in DIR/<arm>/.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ARMS = {
    "default": [],
    "packed": ["--set", "trainer.packing=packed"],
    "vllm_cpu": ["--set", "trainer.packing=packed", "--set", "trainer.kernels=vllm_cpu"],
}


def run(arm: str, runs: Path) -> None:
    command = [
        str(Path(sys.executable).parent / "tir-rl"), "train", "--config", "configs/lab_sft.yaml",
        "--set", f"run.name={arm}", "--set", f"run.out_dir={runs}", *ARMS[arm],
    ]  # fmt: skip
    subprocess.run(command, check=True)


def summary(arm: str, metrics: Path) -> str:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "mismatch/k3_kl" in r]
    evals = [r for r in rows if "eval/pass_at_1" in r]
    exact = sum(r["mismatch/k3_kl"] == 0 and r["mismatch/abs_diff_max"] == 0 for r in steps)
    return (
        f"| {arm} | {len(steps)} | {max(r['mismatch/k3_kl'] for r in steps):.2e} | "
        f"{max(r['mismatch/abs_diff_max'] for r in steps):.2e} | {exact}/{len(steps)} | "
        f"{statistics.median(r['perf/train_s'] for r in steps):.2f} | "
        f"{statistics.median(r['perf/step_s'] for r in steps):.2f} | "
        f"{evals[0]['eval/pass_at_1']:.3f} -> {evals[-1]['eval/pass_at_1']:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="run the arms; keep their metrics here")
    parser.add_argument("--summarize", type=Path, help="only print the table of DIR/<arm>/")
    args = parser.parse_args()
    if args.summarize is not None:
        files = {arm: args.summarize / arm / "metrics.jsonl" for arm in ARMS}
    else:
        runs = Path("runs") / "parity_mode"
        files = {}
        for arm in ARMS:
            run(arm, runs)
            kept = args.out / arm / "metrics.jsonl"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(runs / arm / "metrics.jsonl", kept)
            files[arm] = kept
    print(
        "| arm | steps | max k3 | max abs diff | steps exactly 0 | update s (median) | "
        "step s (median) | held-out pass@1 |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for arm, path in files.items():
        print(summary(arm, path))


if __name__ == "__main__":
    main()
