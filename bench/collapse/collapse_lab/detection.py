"""Detection study: which signal fires before a collapse, how early, and how often it fires
where nothing collapses.

Replays detectors over the kept runs' `metrics.jsonl` (nothing is rerun). A run's collapse
is `verdict.judge_run`'s. Per detector and run, the firing steps are the steps where its
condition holds; then

- **warned**: a collapsed run with a firing in the `window` steps up to its collapse step
  (inclusive); the **lead** is the collapse step minus the first such firing;
- **false alarm**: a firing more than `window` steps before the collapse, or anywhere in a
  run that did not collapse (a warning no one could act on is counted as one);
- the warned count is also given over **persisting** collapses only (`verdict`: the drop
  lasts to the run's end), leaving out dips after a gradient-norm spike that recovered.

    python bench/collapse/detection.py bench/collapse/results/sft_long [more result folders]

Detectors over a trailing mean of `smooth` steps of a metric: above an absolute threshold,
or above a multiple of the run's own baseline (the median over its first `baseline` steps).
`guard` is the collapse guard's recorded alerts as the run raised them; `grad_norm_spike`
is the verdict's gradient-norm spike.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collapse_lab.report import Run, load_runs
from collapse_lab.verdict import (
    GRAD_NORM_KEY,
    CollapseCriteria,
    alert_steps,
    spike_steps,
    trailing_means,
    values_by_step,
)

K3_KEY = "mismatch/k3_kl"
ENTROPY_KEY = "train/entropy"

Rows = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class Detector:
    name: str
    firing_steps: Callable[[Rows], list[int]]


def above(key: str, threshold: float, smooth: int) -> Callable[[Rows], list[int]]:
    def fire(rows: Rows) -> list[int]:
        means = trailing_means(values_by_step(rows, key), smooth)
        return [s for s, v in sorted(means.items()) if v > threshold]

    return fire


def above_baseline(
    key: str, factor: float, smooth: int, baseline: int
) -> Callable[[Rows], list[int]]:
    """Fires where the trailing mean exceeds `factor` × the median of the first `baseline`
    steps' values; never within those steps."""

    def fire(rows: Rows) -> list[int]:
        values = values_by_step(rows, key)
        steps = sorted(values)
        if len(steps) <= baseline:
            return []
        base = statistics.median(values[s] for s in steps[:baseline])
        if not base > 0:
            return []
        means = trailing_means(values, smooth)
        return [s for s in steps[baseline:] if means[s] > factor * base]

    return fire


def grad_norm_spikes(rows: Rows) -> list[int]:
    return spike_steps(values_by_step(rows, GRAD_NORM_KEY), CollapseCriteria())


def detectors(smooth: int, baseline: int) -> list[Detector]:
    found = [Detector("guard (as recorded)", alert_steps)]
    found.append(Detector("grad_norm_spike", grad_norm_spikes))
    for threshold in ("1e-3", "3e-3", "1e-2"):
        found.append(Detector(f"k3 > {threshold}", above(K3_KEY, float(threshold), smooth)))
    for factor in (3.0, 10.0):
        found.append(
            Detector(f"k3 > {factor:g}x baseline", above_baseline(K3_KEY, factor, smooth, baseline))
        )
    found.append(
        Detector("entropy > 5x baseline", above_baseline(ENTROPY_KEY, 5.0, smooth, baseline))
    )
    return found


@dataclass(frozen=True)
class Detection:
    """One detector on one run."""

    collapse_step: int | None
    lead: int | None
    """Steps from the first firing within the window to the collapse; None: not warned."""
    false_alarm: bool


def judge(firing: list[int], collapse_step: int | None, window: int) -> Detection:
    if collapse_step is None:
        return Detection(None, None, bool(firing))
    early = [s for s in firing if s < collapse_step - window]
    warned = [s for s in firing if collapse_step - window <= s <= collapse_step]
    lead = collapse_step - warned[0] if warned else None
    return Detection(collapse_step, lead, bool(early))


def study(runs: list[Run], window: int, smooth: int, baseline: int) -> str:
    collapsed = [r for r in runs if r.verdict.collapsed]
    persisting = sum(r.verdict.persisting for r in collapsed)
    where = ", ".join(
        f"{r.folder.name} at step {r.verdict.collapse_step}"
        + ("" if r.verdict.persisting else " (recovered)")
        for r in collapsed
    )
    lines = [
        f"{len(runs)} runs, {len(collapsed)} collapsed ({where or 'none'}); "
        f"window {window} steps, trailing mean over {smooth}, baseline the first {baseline} steps",
        "",
        "| detector | collapsed runs warned | persisting collapses warned | lead (steps) | "
        "runs with a false alarm | false alarms in runs that never collapsed |",
        "|---|---|---|---|---|---|",
    ]
    for detector in detectors(smooth, baseline):
        found = [
            (judge(detector.firing_steps(r.rows), r.verdict.collapse_step, window), r.verdict)
            for r in runs
        ]
        warned = [(d, v) for d, v in found if d.lead is not None]
        leads = ", ".join(str(d.lead) for d, _ in warned) or "–"
        quiet = [d for d, _ in found if d.collapse_step is None]
        lines.append(
            f"| {detector.name} | {len(warned)}/{len(collapsed)} | "
            f"{sum(v.persisting for _, v in warned)}/{persisting} | {leads} | "
            f"{sum(d.false_alarm for d, _ in found)}/{len(runs)} | "
            f"{sum(d.false_alarm for d in quiet)}/{len(quiet)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="result folders of kept runs")
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--smooth", type=int, default=5)
    parser.add_argument("--baseline", type=int, default=25)
    args = parser.parse_args()
    runs = [run for folder in args.results for run in load_runs(folder)]
    if not runs:
        raise SystemExit(f"no kept runs under {', '.join(map(str, args.results))}")
    print(study(runs, args.window, args.smooth, args.baseline))


if __name__ == "__main__":
    main()
