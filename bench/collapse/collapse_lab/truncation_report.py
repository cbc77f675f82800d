"""The truncation suite's tables, from its kept runs (docs/mismatch.md, truncated sampling).

    python bench/collapse/truncation_report.py bench/collapse/results/truncation \
        > bench/collapse/results/truncation/report.md

`make train`'s setting (configs/lab_sft.yaml, 10 steps) sampling the whole vocabulary
(`top_p_1`), and at top_p 0.9 with the trainer replaying the kept set (`top_p_0.9_replay`) and
scoring the whole vocabulary instead (`top_p_0.9_no_replay`, the biased ratio), on seeds 41-43
(`settings.truncation_suite`). Two tables:

- the held-out change of each setting (per seed, pooled over seeds and tasks) and its
  difference from `top_p_1`'s, paired by seed and task: does sampling as a card says, replayed,
  learn no worse than sampling the whole vocabulary;
- what the trainer saw, as means over every update step and seed: the token ratio π/μ (without
  the replay it carries the kept mass), k3, the share of sequences the shipped preset's
  geometric mask rejected, and the share of sampled tokens outside the replayed set.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from collapse_lab.report import Run, _by_setting, load_runs
from collapse_lab.stabilizers_report import change_table
from collapse_lab.verdict import values_by_step

BASELINE = "top_p_1"
SEEN = (
    ("mismatch/is_token_mean", "token ratio π/μ", ".3f"),
    ("mismatch/k3_kl", "k3", ".1e"),
    ("mismatch/correction/masked_seq_fraction", "sequences masked", ".3f"),
    ("mismatch/outside_kept_set", "tokens outside the replayed set", ".1e"),
)


def by_setting(runs: list[Run]) -> dict[str, list[Run]]:
    """The report's groups (seeds in order), the baseline first."""
    ordered = sorted(_by_setting(runs).items(), key=lambda kv: (kv[0] != BASELINE, kv[0]))
    return {name: sorted(group, key=lambda r: r.seed) for name, group in ordered}


def seen_table(groups: dict[str, list[Run]]) -> list[str]:
    lines = [
        "| setting | seeds | " + " | ".join(label for _, label, _ in SEEN) + " |",
        "|---|---|" + "---|" * len(SEEN),
    ]
    for name, group in groups.items():
        cells = []
        for key, _, spec in SEEN:
            values = [v for run in group for v in values_by_step(run.rows, key).values()]
            cells.append(format(statistics.fmean(values), spec) if values else "–")
        seeds = ", ".join(str(r.seed) for r in group)
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def report_text(runs: list[Run]) -> str:
    groups = by_setting(runs)
    return "\n".join(
        [
            "## Held-out change (make train's setting, 10 steps)",
            "",
            *change_table(groups, BASELINE, "setting"),
            "",
            "## What the trainer saw (means over update steps and seeds)",
            "",
            *seen_table(groups),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="folder of the kept truncation runs")
    args = parser.parse_args()
    runs = load_runs(args.results)
    if not runs:
        raise SystemExit(f"no runs under {args.results}")
    print(report_text(runs))


if __name__ == "__main__":
    main()
