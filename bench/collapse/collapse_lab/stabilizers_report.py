"""The stabilizer head-to-head's tables, from its kept runs (docs/collapse.md A7).

    python bench/collapse/stabilizers_report.py bench/collapse/results/stabilizers \
        > bench/collapse/results/stabilizers/report.md

Runs are named `<cause>_<arm>_s<seed>` (`settings.STABILIZER_CAUSES`, `STABILIZER_ARMS`). Each
is judged by the lab's own verdict (`report.outcome`, `verdict.judge_run`), each cell by the
rule of `stabilizers_plan.md`, fixed before the runs were read:

- per cell: outcome per seed, collapsed or held, steps to collapse, final held-out pass@1
  (seeds × tasks, 95% interval), mismatch (k3) and VCPO's ESS ratio over the last 10 steps, and
  the cost per step (wall seconds per step, and the trainer's share);
- the matrix: which arm holds which cause;
- the cost of stability (cause `none`, make train's setting): each arm's paired held-out change
  and its difference from the preset's, paired by seed and task.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

from collapse_lab.report import (
    Run,
    final_task_scores,
    load_runs,
    outcome,
    paired_change,
    task_scores,
)
from collapse_lab.report import _heldout as heldout_points
from collapse_lab.settings import STABILIZER_ARMS, STABILIZER_CAUSES
from collapse_lab.verdict import REWARD_KEY, values_by_step
from tir_rl.report.eval_stats import Estimate, bootstrap_seeds_and_tasks

FAILED = ("collapsed", "degraded")
LAST_STEPS = 10
COST_CAUSE = "none"
BASELINE_ARM = "preset"


def split_setting(setting: str) -> tuple[str, str] | None:
    """(cause, arm) of a head-to-head setting name, or None for another run."""
    for cause in STABILIZER_CAUSES:
        prefix = f"{cause}_"
        if setting.startswith(prefix):
            return cause, setting.removeprefix(prefix)
    return None


def cells(runs: list[Run]) -> dict[tuple[str, str], list[Run]]:
    out: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        key = split_setting(run.setting)
        if key is not None:
            out[key].append(run)
    return {k: sorted(v, key=lambda r: r.seed) for k, v in out.items()}


def failed(run: Run) -> bool:
    """The plan's failure of one run: held-out collapsed or degraded, or a persisting collapse."""
    return outcome(run) in FAILED or run.verdict.persisting


def cell_verdict(group: list[Run]) -> str:
    """collapses (≥ 2 seeds failed), holds (none), or mixed; 'unfinished' while one runs."""
    if any(outcome(r) == "unfinished" for r in group):
        return "unfinished"
    bad = sum(failed(r) for r in group)
    if bad >= 2:
        return f"collapses ({bad}/{len(group)})"
    if bad == 0:
        return f"holds ({len(group)}/{len(group)})"
    return f"mixed ({bad}/{len(group)} failed)"


def _last_mean(run: Run, key: str) -> float:
    values = values_by_step(run.rows, key)
    if not values:
        return math.nan
    last = sorted(values)[-LAST_STEPS:]
    return statistics.fmean(values[s] for s in last)


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _fmt(value: float, spec: str) -> str:
    return "–" if not math.isfinite(value) else format(value, spec)


def _pooled_final(group: list[Run]) -> str:
    pooled = [scores for r in group if (scores := final_task_scores(r)) is not None]
    if not pooled or len({len(p) for p in pooled}) != 1:
        return "–"
    return str(bootstrap_seeds_and_tasks(pooled))


LOW_REWARD = 0.1
LOW_STRETCH_STEPS = 10
"""A run that recovered is shown with its longest stretch of at least this many steps at a
training reward below `LOW_REWARD`: the verdict names only its first dip, and a collapse of
the training curve that came back is still one (descriptive; the plan's rule ignores it)."""


def longest_low_stretch(run: Run) -> tuple[int, int] | None:
    """(first step, length) of the longest run of consecutive steps whose training reward is
    below `LOW_REWARD`, or None without any such step."""
    rewards = values_by_step(run.rows, REWARD_KEY)
    best: tuple[int, int] | None = None
    start, previous = None, None
    for step in sorted(rewards):
        if rewards[step] >= LOW_REWARD:
            start = None
        elif start is None or previous != step - 1:
            start = step
        if start is not None and (best is None or step - start + 1 > best[1]):
            best = (start, step - start + 1)
        previous = step
    return best


def _seed_outcome(run: Run) -> str:
    """The held-out outcome, with the training curve's collapse step: persisting, or a dip
    it recovered from (which the plan does not count as a failure, but the table shows), and
    a long stretch at a reward near 0 that a recovered run came back from."""
    text = outcome(run)
    step = run.verdict.collapse_step
    if run.verdict.persisting:
        return f"{text} ({step})"
    if run.verdict.collapsed and step is not None:
        text = f"{text}, dipped at {step} and recovered"
    stretch = longest_low_stretch(run)
    if stretch is not None and stretch[1] >= LOW_STRETCH_STEPS:
        first, length = stretch
        text = f"{text}, training reward < {LOW_REWARD} for {length} steps from {first}"
    return text


def cell_table(by_cell: dict[tuple[str, str], list[Run]]) -> list[str]:
    lines = [
        "| cause | arm | seeds | outcome per seed (collapse step) | cell | final held-out "
        "pass@1 [95% CI, seeds × tasks] | k3, last 10 steps | ESS ratio ρ, last 10 steps | "
        "s / step (trainer) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cause in STABILIZER_CAUSES:
        for arm in STABILIZER_ARMS:
            group = by_cell.get((cause, arm))
            if not group:
                continue
            per_seed = "; ".join(f"s{r.seed} {_seed_outcome(r)}" for r in group)
            step_s = _mean(
                [_mean(list(values_by_step(r.rows, "perf/step_s").values())) for r in group]
            )
            train_s = _mean(
                [_mean(list(values_by_step(r.rows, "train/step_s").values())) for r in group]
            )
            lines.append(
                f"| {cause} | {arm} | {', '.join(str(r.seed) for r in group)} | {per_seed} | "
                f"{cell_verdict(group)} | {_pooled_final(group)} | "
                f"{_fmt(_mean([_last_mean(r, 'mismatch/k3_kl') for r in group]), '.1e')} | "
                f"{_fmt(_mean([_last_mean(r, 'mismatch/vcpo_ess') for r in group]), '.3f')} | "
                f"{_fmt(step_s, '.1f')} ({_fmt(train_s, '.1f')}) |"
            )  # fmt: skip
    return lines


def matrix(by_cell: dict[tuple[str, str], list[Run]]) -> list[str]:
    causes = [c for c in STABILIZER_CAUSES if c != COST_CAUSE]
    lines = [
        "| arm | " + " | ".join(causes) + " |",
        "|---|" + "---|" * len(causes),
    ]
    for arm in STABILIZER_ARMS:
        row = [_matrix_cell(by_cell, c, arm) for c in causes]
        if any(cell not in ("not run", SAME_AS_UNCORRECTED) for cell in row):
            lines.append(f"| {arm} | " + " | ".join(row) + " |")
    return lines


SAME_AS_UNCORRECTED = "= uncorrected"
"""The `bypass` control under a cause whose own mode is bypass: the same run as `uncorrected`."""


def _matrix_cell(by_cell: dict[tuple[str, str], list[Run]], cause: str, arm: str) -> str:
    if (cause, arm) in by_cell:
        return cell_verdict(by_cell[(cause, arm)])
    if arm == "bypass" and STABILIZER_CAUSES[cause][1] == "bypass":
        return SAME_AS_UNCORRECTED
    return "not run"


def change_rows(group: list[Run]) -> dict[int, list[float]]:
    """Per seed, the per-task change (final − start) of the held-out pass@1."""
    out = {}
    for run in group:
        points = heldout_points(run)
        if len(points) < 2:
            continue
        before, after = task_scores(run, min(points)), task_scores(run, max(points))
        if before is not None and after is not None and len(before) == len(after):
            out[run.seed] = [a - b for b, a in zip(before, after, strict=True)]
    return out


def change_table(groups: dict[str, list[Run]], baseline: str, label: str) -> list[str]:
    """Each group's paired held-out change (per seed, pooled over seeds and tasks) and its
    difference from the `baseline` group's, paired by seed and task; `label` heads the first
    column."""
    base = change_rows(groups.get(baseline, []))
    lines = [
        f"| {label} | seeds | paired change per seed [95% CI] | pooled change [95% CI, seeds × "
        f"tasks] | minus {baseline}'s, paired by seed and task [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for name, group in groups.items():
        rows = change_rows(group)
        per_seed = "; ".join(
            f"s{r.seed} {change}" for r in group if (change := paired_change(r)) is not None
        )
        pooled: Estimate | None = bootstrap_seeds_and_tasks(list(rows.values())) if rows else None
        shared = sorted(set(rows) & set(base))
        diff = "–"
        if name != baseline and shared:
            paired = [[a - b for a, b in zip(rows[s], base[s], strict=True)] for s in shared]
            diff = f"{bootstrap_seeds_and_tasks(paired)} (seeds {', '.join(map(str, shared))})"
        lines.append(
            f"| {name} | {', '.join(str(r.seed) for r in group)} | {per_seed or '–'} | "
            f"{pooled if pooled is not None else '–'} | {diff} |"
        )
    return lines


def cost_table(by_cell: dict[tuple[str, str], list[Run]]) -> list[str]:
    groups = {arm: by_cell[(COST_CAUSE, arm)] for arm in STABILIZER_ARMS
              if by_cell.get((COST_CAUSE, arm))}  # fmt: skip
    return change_table(groups, BASELINE_ARM, "arm")


def report_text(runs: list[Run]) -> str:
    by_cell = cells(runs)
    return "\n".join(
        [
            "## Which stabilizer holds which cause",
            "",
            *matrix(by_cell),
            "",
            "## Every cell",
            "",
            *cell_table(by_cell),
            "",
            "## The cost of stability (make train's setting, 10 steps)",
            "",
            *cost_table(by_cell),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="folders of kept runs")
    args = parser.parse_args()
    runs = [run for folder in args.results for run in load_runs(folder)]
    if not runs:
        raise SystemExit(f"no runs under {', '.join(map(str, args.results))}")
    print(report_text(runs))


if __name__ == "__main__":
    main()
