"""How often does the asynchronous learning test's run learn? One run per seed, one record each.

    python bench/lab_learns_async.py --seed 0 --record bench/lab_learns_records/NAME.json
    python bench/lab_learns_async.py --seed 3 --core 1 --set run.steps=4
    python bench/lab_learns_async.py --report bench/lab_learns_records

The run is that of the asynchronous learning test of 2026-11 (tests/integration/train/
test_train_learns.py, since merged into the asynchronous LoRA test), from
`collapse_lab.lab_learns` (`train_lab_model` with its `ASYNCHRONOUS` settings:
configs/lab_learns.yaml, the lab model at logit scale 0.36); `--set` changes any other
setting. The record keeps held-out pass@1 before and after with the paired change, and per
step the reward, the lag, the correction's weights, the ratio, the gradient norm and the
logit scale (the mean of the final norm's weight) after the step; `--report` prints one line
per record. The test's run is seeded by `run.seed`, but with `run.max_staleness` > 0 which
groups a step takes depends on timing, so the same seed can give a different run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from collapse_lab.lab_learns import ASYNCHRONOUS, train_lab_model
from collapse_lab.run import pin_to_core

STEP_KEYS = (
    "rollout/reward_mean",
    "staleness/lag_mean",
    "staleness/lag_max",
    "mismatch/correction/weight_mean",
    "loss/ratio_mean",
    "loss/clip_fraction_high",
    "loss/clip_fraction_low",
    "train/grad_norm",
    "mismatch/k3_kl",
)


def run(seed: int, overrides: list[str]) -> dict[str, object]:
    from tir_rl.engine.weights.files import read_checkpoint_weights
    from tir_rl.report.run_log import read_metrics
    from tir_rl.trainer.checkpoint import MODEL_DIR, step_folder

    with tempfile.TemporaryDirectory() as tmp:
        settings = [*ASYNCHRONOUS, f"run.seed={seed}", *overrides]
        summary, _ = train_lab_model(Path(tmp), "run.checkpoint_every=1", *settings)
        rows = [r for r in read_metrics(summary.run_dir) if "rollout/reward_mean" in r]
        scales = []
        for step in range(1, summary.steps_done + 1):
            weights = read_checkpoint_weights(step_folder(summary.run_dir, step) / MODEL_DIR)
            norm = weights["model.norm.weight"]
            scales.append(float(norm.float().mean()))
        evaluations = held_out_by_step(summary.run_dir)
        steps = [{k: r.get(k) for k in STEP_KEYS} for r in rows]
        for row, scale in zip(steps, scales, strict=False):
            row["logit_scale_after"] = scale
    change = summary.accuracy_change
    return {
        "seed": seed,
        "settings": settings,
        "before": str(summary.accuracy_before),
        "after": str(summary.accuracy_after),
        "change": str(change),
        "change_value": change.value if change is not None else None,
        "change_low": change.low if change is not None else None,
        "evaluations": evaluations,
        "steps": steps,
    }


def held_out_by_step(run_dir: Path) -> list[dict[str, object]]:
    """pass@1 of every held-out evaluation of the run (`run.eval_every`), paired with step 0."""
    from tir_rl.report.eval_stats import bootstrap_paired_change

    reports = {}
    for path in run_dir.glob("eval_step_*.json"):
        reports[int(path.stem.rsplit("_", 1)[1])] = json.loads(path.read_text())
    start = reports.get(0)
    out = []
    for step in sorted(reports):
        tasks = reports[step]["task_pass_at_1"]
        change = (
            str(bootstrap_paired_change(start["task_pass_at_1"], tasks))
            if start is not None
            else None
        )
        out.append({"step": step, "pass_at_1": sum(tasks) / len(tasks), "change": change})
    return out


def report(folder: Path) -> None:
    """One line per record: pass@1 before and after, the paired change, at step 4 too."""
    print(
        f"{'record':<28} {'before':>21} {'after':>21} {'change':>25} {'change at step 4':>25}"
        "  reward per step"
    )
    for path in sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem)):
        rec = json.loads(path.read_text())
        at_4 = next((e["change"] for e in rec["evaluations"] if e["step"] == 4), None)
        if at_4 is None and len(rec["steps"]) == 4:
            at_4 = rec["change"]
        rewards = " ".join(f"{s['rollout/reward_mean']:.2f}" for s in rec["steps"])
        print(
            f"{path.stem:<28} {rec['before']:>21} {rec['after']:>21} {rec['change']:>25} "
            f"{at_4 or '-':>25}  {rewards}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="run.seed")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--core", type=int, help="keep the run (trainer, vLLM) on this core")
    parser.add_argument("--record", type=Path, help="write the record (JSON) here")
    parser.add_argument("--report", type=Path, help="print the records in this folder")
    args = parser.parse_args()
    if args.report is not None:
        report(args.report)
        return
    if args.core is not None:
        pin_to_core(args.core)
    record = run(args.seed, args.overrides)
    text = json.dumps(record, indent=1)
    print(text)
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(text + "\n")


if __name__ == "__main__":
    main()
