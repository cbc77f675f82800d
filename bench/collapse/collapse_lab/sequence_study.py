"""Which sequences a sequence mask drops: failed and succeeded episodes, read from the kept
per-sequence records (nothing is rerun).

    python bench/collapse/sequence_study.py bench/collapse/results/sft_long

Each run's `sequences.jsonl(.gz)` holds, per trained sequence, its GRPO advantage and its
per-token log-ratio δ = ℓ^θ − ℓ^μ (the trainer's logprob before the update against the
sampler's). Per run, the sequences are split by the sign of their advantage (failed: A < 0;
succeeded: A > 0; A = 0 gives no gradient and is left out), and each side gets its count, its
mean of the per-sequence mean δ (the log of the geometric-mean ratio, which `geo_rs` bands),
the share outside `geo_rs`'s band, and, in a run whose correction rejects sequences, the share
it rejected (no model token kept). Steps read: those before a collapse that lasted to the
run's end (`verdict`: persisting), the whole run otherwise.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from collapse_lab.report import Run, load_runs
from tir_rl.config import load
from tir_rl.mismatch import MismatchCorrection
from tir_rl.report.run_log import run_file
from tir_rl.report.sequences import SEQUENCES_FILE, SequenceRecord, read_sequences
from tir_rl.run_config import RunConfig

GEO_BAND = MismatchCorrection.Config.preset("geo_rs").geo_mask
"""The band `geo_rs` keeps a sequence in, on its geometric-mean ratio."""


@dataclass(frozen=True)
class Side:
    """The failed or the succeeded sequences of one run."""

    sequences: int
    mean_log_ratio: float
    outside_band: float
    rejected: float | None
    """Share the run's correction rejected; None when it rejects nothing by design."""


def last_step_read(run: Run) -> int:
    """The step before a persisting collapse, else the run's last step."""
    if run.verdict.persisting and run.verdict.collapse_step is not None:
        return run.verdict.collapse_step - 1
    return max(row["step"] for row in run.rows)


def side(
    records: Sequence[SequenceRecord], keep: Callable[[float], bool], masks: bool
) -> Side | None:
    chosen = [r for r in records if r.advantage is not None and keep(r.advantage)]
    if not chosen:
        return None
    lo, hi = (math.log(bound) for bound in GEO_BAND)
    return Side(
        sequences=len(chosen),
        mean_log_ratio=statistics.fmean(r.log_ratio_mean for r in chosen),
        outside_band=statistics.fmean(not lo <= r.log_ratio_mean <= hi for r in chosen),
        rejected=statistics.fmean(r.kept_tokens == 0 for r in chosen) if masks else None,
    )


def _cells(found: Side | None) -> str:
    if found is None:
        return "0 | – | – | –"
    rejected = "–" if found.rejected is None else f"{found.rejected:.2f}"
    return (
        f"{found.sequences} | {found.mean_log_ratio:+.1e} | {found.outside_band:.2f} | {rejected}"
    )


def study(runs: list[Run]) -> str:
    read = [(run, run_file(run.folder, SEQUENCES_FILE)) for run in runs]
    missing = [run.folder.name for run, path in read if path is None]
    lines = [
        f"{len(runs) - len(missing)} runs with per-sequence records"
        + (f" ({len(missing)} without: {', '.join(missing)})" if missing else "")
        + f"; geo_rs band [{GEO_BAND[0]}, {GEO_BAND[1]}] on the geometric-mean ratio",
        "",
        "| run | steps read | failed (A < 0) | mean δ per token | outside the band | "
        "rejected | succeeded (A > 0) | mean δ per token | outside the band | rejected |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, path in read:
        if path is None:
            continue
        last = last_step_read(run)
        records = [r for r in read_sequences(path) if r.step <= last and r.model_tokens > 0]
        masks = load(RunConfig, run.folder / "config.yaml", []).correction.rejects
        failed = side(records, lambda a: a < 0, masks)
        succeeded = side(records, lambda a: a > 0, masks)
        lines.append(f"| {run.folder.name} | 1-{last} | {_cells(failed)} | {_cells(succeeded)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="result folders of kept runs")
    args = parser.parse_args()
    runs = [run for folder in args.results for run in load_runs(folder)]
    if not runs:
        raise SystemExit(f"no kept runs under {', '.join(map(str, args.results))}")
    print(study(runs))


if __name__ == "__main__":
    main()
