"""Does a LoRA run learn on the lab model? The tries of docs/lora.md, one command each.

    python bench/lora_lab_learning.py --targets lm_head --r 16 --alpha 256 --lr 1e-2
    python bench/lora_lab_learning.py --targets model.layers.2.self_attn.o_proj --lr 5e-3
    python bench/lora_lab_learning.py --targets lm_head --init pissa --r 48 --alpha 48 --lr 3e-3 \
        --steps 12 --set run.tasks_per_step=8 --set run.group_size=8 --set run.eval_tasks=128 \
        --set run.eval_samples_per_task=2

The run is `configs/lab_learns.yaml`, the lab model's learning run (`collapse_lab.lab_learns`)
(the lab model at logit scale 0.36, MultiHop horizon 1, 6 steps of 6 tasks x 4 samples,
held-out pass@1 on 64 tasks), with LoRA adapters on `--targets` instead of the final norm's
weight; `--set` changes any other setting (the third command is the LoRA learning test's run).
Prints held-out pass@1 before -> after with 95% intervals, the change paired over the same
tasks, and the training reward per step. About 2.5 minutes on the quiet 2-core machine
(6 steps); the third command about 6 minutes on one core (`--core`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from collapse_lab.lab_learns import train_lab_model
from collapse_lab.run import pin_to_core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["lm_head"], help="trainer.lora targets")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--init", default="default", help="trainer.lora.init: default|pissa")
    parser.add_argument("--seed", type=int, default=0, help="run.seed (the task stream)")
    parser.add_argument("--steps", type=int, default=6, help="run.steps (the test's: 6)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="any other run setting"
    )
    parser.add_argument("--core", type=int, help="keep the run (trainer, vLLM) on this core")
    args = parser.parse_args()
    if args.core is not None:
        pin_to_core(args.core)

    from tir_rl.report.eval_stats import describe_change

    with tempfile.TemporaryDirectory() as tmp:
        summary, rewards = train_lab_model(
            Path(tmp),
            "run.name=lora",
            f"run.seed={args.seed}",
            f"run.steps={args.steps}",
            "trainer.train_only=[]",
            "trainer.lora.enabled=true",
            f"trainer.lora.target_modules=[{', '.join(args.targets)}]",
            f"trainer.lora.r={args.r}",
            f"trainer.lora.alpha={args.alpha}",
            f"trainer.lora.init={args.init}",
            f"trainer.lr={args.lr}",
            *args.overrides,
        )
    extra = "".join(f", {o}" for o in args.overrides)
    print(
        f"\nLoRA on {', '.join(args.targets)} (init {args.init}, r {args.r}, alpha {args.alpha:g}, "
        f"lr {args.lr:g}, seed {args.seed}, {args.steps} steps{extra})\n"
        + describe_change(
            "held-out pass@1",
            summary.accuracy_before,
            summary.accuracy_after,
            summary.accuracy_change,
        )
        + f"\ntraining reward per step: {' '.join(f'{r:.2f}' for r in rewards)}"
    )


if __name__ == "__main__":
    main()
