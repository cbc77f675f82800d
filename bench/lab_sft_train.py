"""`make train`'s job (configs/lab_sft.yaml) per seed, timed, with its small record kept.

    python bench/lab_sft_train.py --seed 0 [--core C] [--set KEY=VALUE ...]  # one run (~3-5 min)
    python bench/lab_sft_train.py --report                # the table, from the kept records

`run.seed` seeds every random source left unset (engine, trainer, tasks). Each run keeps its
config, metrics and held-out evaluations, plus the command's wall seconds, in
bench/lab_sft_train_records/NAME/ (NAME: `seed{S}` and the extra settings).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kept_run import keep_record, train_pinned

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = ROOT / "configs" / "lab_sft.yaml"
RECORDS = HERE / "lab_sft_train_records"


def run(seed: int, core: int | None, sets: list[str]) -> Path:
    """Train once with `run.seed=seed` and the extra settings; keep the record."""
    name = "-".join([f"seed{seed}", *(s.replace("=", "") for s in sets)])
    with tempfile.TemporaryDirectory() as tmp:
        run_sets = [f"run.seed={seed}", f"run.name={name}", f"run.out_dir={tmp}", *sets]
        wall = train_pinned(CONFIG, run_sets, core)
        out = RECORDS / name
        keep_record(Path(tmp, name), out)
        (out / "wall.json").write_text(
            json.dumps({"wall_s": round(wall, 1), "core": core, "sets": sets}) + "\n"
        )
    return out


def report() -> str:
    """One row per kept run: reward per step, held-out pass@1 before -> after, paired change."""
    from tir_rl.report.eval_stats import bootstrap_paired_change

    lines = [
        "| run | steps | rollout reward per step | held-out pass@1 before -> after | "
        "paired change [95%] | tool calls before -> after | sampler/trainer k3, min-max over "
        "steps | trainer s per step | wall s (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for folder in sorted(p for p in RECORDS.glob("*") if (p / "wall.json").is_file()):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
        k3 = [r["mismatch/k3_kl"] for r in rows if "mismatch/k3_kl" in r]
        train_s = [r["perf/train_s"] for r in rows if "perf/train_s" in r]
        evals = sorted(folder.glob("eval_step_*.json"), key=lambda p: int(p.stem.split("_")[-1]))
        first, last = (json.loads(p.read_text()) for p in (evals[0], evals[-1]))
        change = bootstrap_paired_change(first["task_pass_at_1"], last["task_pass_at_1"])
        wall = json.loads((folder / "wall.json").read_text())
        cores = "2" if wall["core"] is None else f"1, core {wall['core']}"
        lines.append(
            f"| {folder.name} | {len(rewards)} | "
            + " ".join(f"{x:.2f}" for x in rewards)
            + f" | {first['pass_at_1']['value']:.3f} -> {last['pass_at_1']['value']:.3f} | "
            f"{change.value:+.3f} [{change.low:+.3f}, {change.high:+.3f}] | "
            f"{first['mean_tool_calls']:.2f} -> {last['mean_tool_calls']:.2f} | "
            f"{min(k3):.1e}-{max(k3):.1e} | "
            f"{sum(train_s) / len(train_s):.2f} | "
            f"{wall['wall_s']:.0f} ({cores}) |"
        )
    return "\n".join(lines)


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, help="train once with this run.seed")
    parser.add_argument("--core", type=int, help="keep the run on this core")
    parser.add_argument("--set", action="append", default=[], help="extra KEY=VALUE settings")
    parser.add_argument("--report", action="store_true", help="print the table from the records")
    args = parser.parse_args()
    if args.seed is not None:
        run(args.seed, args.core, args.set)
    print(report())


if __name__ == "__main__":
    main()
