"""Where one GRPO step goes, lab model against the bundled model, measured in one run.

Both models play the same MultiHop set-up (horizon 2, 4 tasks x 4 samples, 2 steps, the
same engine settings) through `tir-rl train`; the table is the second step (the first pays
for warm-up) and the held-out evaluation before training, per task.

    python bench/rl_step_split.py                 # ~8 minutes on the 2-core CPU machine
    python bench/rl_step_split.py --horizon 4 --tasks 8 --group 8 --lab-only   # issue 11's step
    python bench/rl_step_split.py --horizon 4 --tasks 8 --group 8 --models lab lab-sft

Measured on the shared 2-core CPU machine (defaults, one run, 6 minutes):

    phase                             lab s  bundled s  bundled/lab
    rollout                             4.3       30.9         7.19
    trainer (recompute + update)        2.2       54.4        24.55
    weight sync                         0.4        0.0         0.00
    step total                          6.9       85.3        12.30
    eval, per held-out task            0.97       2.95         3.03
    sampled tokens in the step: lab 1430, bundled 1847

Issue 11's step (`--horizon 4 --tasks 8 --group 8 --lab-only`, one run, quiet machine):
rollout 15.4 s, trainer 5.6 s, weight sync 0.2 s, step total 21.2 s, 14,721 sampled tokens.

(Before the trainer's token_stats / lm_head changes the lab trainer took 5.8 s of a 13.6 s
step in the same set-up.)

The bundled model scored 0 on every episode, so every group was degenerate: its trainer time
is the logprob recompute and mismatch metrics without an update, and there was no weight
sync. Its real step (with an update) is slower still (docs/lab_model.md: 331 s for 8 x 4).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

PHASES = (
    ("rollout", "perf/rollout_s"),
    ("trainer (recompute + update)", "perf/train_s"),
    ("weight sync", "perf/sync_s"),
)


@dataclass(frozen=True)
class StepSplit:
    """Seconds per phase of one step, and of evaluating one held-out task."""

    seconds: dict[str, float]
    eval_per_task_s: float
    sampled_tokens: float


def measure(model: str, extra: list[str], args: argparse.Namespace, out: Path) -> StepSplit:
    from tir_rl.config import load
    from tir_rl.report.run_log import read_metrics
    from tir_rl.rl_loop import run_train
    from tir_rl.run_config import RunConfig

    config = load(
        RunConfig,
        None,
        [
            f"model={model}",
            f"run.out_dir={out}",
            f"run.name={model}",
            "run.steps=2",
            f"run.tasks_per_step={args.tasks}",
            f"run.group_size={args.group}",
            f"run.eval_tasks={args.eval_tasks}",
            "run.save_trajectories=0",
            "run.parity_tolerance=1e-2",
            "env.id=tir_rl/MultiHop-v0",
            f"env.kwargs={{horizon: {args.horizon}}}",
            f"rollout.max_turns={args.horizon + 3}",
            "rollout.max_tokens_per_turn=64",
            "rollout.max_concurrent_episodes=64",
            "rollout.end_on_truncated_turn=false",
            "engine.local.max_model_len=4096",
            "rollout.max_context_tokens=4096",
            "engine.local.enable_prefix_caching=true",
            "engine.local.block_size=32",
            "correction_preset=geo_rs_token_tis",
            *extra,
        ],
    )
    summary = run_train(config)
    rows = [r for r in read_metrics(summary.run_dir) if r.get("step") == 2 and "perf/train_s" in r]
    report = json.loads((summary.run_dir / "eval_step_0.json").read_text())
    return StepSplit(
        seconds={name: float(rows[-1][key]) for name, key in PHASES},
        eval_per_task_s=report["wall_time_s"] / report["num_tasks"],
        sampled_tokens=float(rows[-1]["rollout/model_tokens"]),
    )


MODELS = {
    "lab": ["trainer.train_only=[model.norm.weight]", "trainer.lr=2e-2"],
    "lab-sft": ["trainer.train_only=[]", "trainer.lr=1e-4"],  # every weight (configs/lab_sft.yaml)
    "bundled": ["trainer.lr=1e-6"],
}
"""What each model trains in the measured step."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--eval-tasks", type=int, default=8)
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=["lab", "bundled"],
        help="measured in this order in one run; the last column is last / first",
    )  # fmt: skip
    parser.add_argument(
        "--lab-only", action="store_true",
        help="the same as --models lab (the bundled model's step takes minutes at 8 x 8)",
    )  # fmt: skip
    args = parser.parse_args()
    names = ["lab"] if args.lab_only else args.models
    with tempfile.TemporaryDirectory() as tmp:
        splits = [measure(name, MODELS[name], args, Path(tmp)) for name in names]
    print(f"\nMultiHop horizon {args.horizon}, {args.tasks} tasks x {args.group} samples, step 2")
    ratio = f"{names[-1]}/{names[0]}" if len(names) > 1 else ""
    print(f"{'phase':<30}" + "".join(f"{n + ' s':>12}" for n in names) + f"{ratio:>16}")

    def row(label: str, values: list[float], digits: int) -> None:
        first, last = values[0], values[-1]
        ratio = f"{last / first:>16.2f}" if len(values) > 1 and first else ""
        print(f"{label:<30}" + "".join(f"{v:>12.{digits}f}" for v in values) + ratio)

    for name, _ in PHASES:
        row(name, [split.seconds[name] for split in splits], 1)
    row("step total", [sum(split.seconds.values()) for split in splits], 1)
    row("eval, per held-out task", [split.eval_per_task_s for split in splits], 2)
    row("sampled tokens in the step", [split.sampled_tokens for split in splits], 0)


if __name__ == "__main__":
    main()
