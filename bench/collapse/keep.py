"""Copy the records of a folder of collapse-lab runs into the repository.

    python bench/collapse/keep.py runs/breaking bench/collapse/results/breaking

A run folder holds checkpoints, TensorBoard events and trajectories that are too big to
keep; `report.py` needs only what this copies: the resolved `config.yaml`, `metrics.jsonl`,
the evaluation reports (`eval*_step_*.json`, with each task's pass@1) and the `DONE` marker
with the wall time. The per-sequence records (`sequences.jsonl`) are kept too, gzipped. The
tables of docs/collapse.md are regenerated from the kept records
with `python bench/collapse/report.py bench/collapse/results/<suite>`.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

RECORDS = (
    "config.yaml",
    "metrics.jsonl",
    "DONE",
    "attempts.txt",
    "eval_step_*.json",
    "eval_clean_step_*.json",
)
COMPRESSED = ("sequences.jsonl",)
"""Kept gzipped (`*.gz`; `tir_rl.report.sequences.read_sequences` reads either): the
per-sequence records are the largest file of a run, and compress about tenfold."""


def keep(source: Path, dest: Path) -> list[Path]:
    """Copy every run's records from `source` into `dest/<run>/`; returns the runs copied."""
    kept = []
    for run in sorted(p for p in source.iterdir() if (p / "metrics.jsonl").is_file()):
        target = dest / run.name
        target.mkdir(parents=True, exist_ok=True)
        for pattern in RECORDS:
            for path in run.glob(pattern):
                shutil.copy2(path, target / path.name)
        for name in COMPRESSED:
            if (run / name).is_file():
                with (run / name).open("rb") as src, gzip.open(target / f"{name}.gz", "wb") as out:
                    shutil.copyfileobj(src, out)
        kept.append(target)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a folder of runs (run.py --out)")
    parser.add_argument("dest", type=Path, help="where the records go")
    args = parser.parse_args()
    if not args.source.is_dir():
        raise SystemExit(f"{args.source} is not a folder of runs")
    for target in keep(args.source, args.dest):
        print(f"kept {target}")


if __name__ == "__main__":
    main()
