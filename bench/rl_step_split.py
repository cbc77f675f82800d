"""Where one GRPO step goes, lab model against the bundled model, measured in one run.

Both models play the same MultiHop set-up (horizon 2, 4 tasks x 4 samples, 2 steps, the
same engine settings) through `tir-rl train`; the table is the second step (the first pays
for warm-up) and the held-out evaluation before training, per task.

    python bench/rl_step_split.py                 # ~8 minutes on the 2-core CPU machine
    python bench/rl_step_split.py --horizon 4 --tasks 8 --group 8 --lab-only   # issue 11's step

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
    from tir_rl.run_config import RunConfig
    from tir_rl.train import run_train

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
            "engine.max_model_len=4096",
            "rollout.max_context_tokens=4096",
            "engine.enable_prefix_caching=true",
            "engine.block_size=32",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--eval-tasks", type=int, default=8)
    parser.add_argument(
        "--lab-only", action="store_true",
        help="measure the lab model alone (the bundled model's step takes minutes at 8 x 8)",
    )  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lab = measure(
            "lab", ["trainer.train_only=[model.norm.weight]", "trainer.lr=2e-2"], args, Path(tmp)
        )
        if args.lab_only:
            print(f"\nMultiHop horizon {args.horizon}, {args.tasks} tasks x {args.group} samples, "
                  "step 2, lab model")  # fmt: skip
            for name, _ in PHASES:
                print(f"{name:<30} {lab.seconds[name]:>8.1f} s")
            print(f"{'step total':<30} {sum(lab.seconds.values()):>8.1f} s")
            print(f"sampled tokens in the step: {lab.sampled_tokens:.0f}")
            return
        bundled = measure("bundled", ["trainer.lr=1e-6"], args, Path(tmp))
    print(f"\nMultiHop horizon {args.horizon}, {args.tasks} tasks x {args.group} samples, step 2")
    print(f"{'phase':<30} {'lab s':>8} {'bundled s':>10} {'bundled/lab':>12}")
    for name, _ in PHASES:
        a, b = lab.seconds[name], bundled.seconds[name]
        print(f"{name:<30} {a:>8.1f} {b:>10.1f} {b / a if a else float('nan'):>12.2f}")
    a, b = sum(lab.seconds.values()), sum(bundled.seconds.values())
    print(f"{'step total':<30} {a:>8.1f} {b:>10.1f} {b / a:>12.2f}")
    a, b = lab.eval_per_task_s, bundled.eval_per_task_s
    print(f"{'eval, per held-out task':<30} {a:>8.2f} {b:>10.2f} {b / a:>12.2f}")
    print(
        f"sampled tokens in the step: lab {lab.sampled_tokens:.0f}, "
        f"bundled {bundled.sampled_tokens:.0f}"
    )


if __name__ == "__main__":
    main()
