"""Copy the records of a folder of collapse-lab runs into the repository.

    python bench/collapse/keep.py runs/breaking bench/collapse/results/breaking

A run folder holds checkpoints, TensorBoard events and trajectories that are too big to
keep; `report.py` needs only what this copies: the resolved `config.yaml`, `metrics.jsonl`,
the evaluation reports (`eval*_step_*.json`, with each task's pass@1) and the `DONE` marker
with the wall time. The per-sequence records (`sequences.jsonl`) are kept too. Both JSONL files
are kept gzipped. The tables of docs/collapse.md are regenerated from the kept records
with `python bench/collapse/report.py bench/collapse/results/<suite>`.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

RECORDS = (
    "config.yaml",
    "DONE",
    "attempts.txt",
    "eval_step_*.json",
    "eval_clean_step_*.json",
)
COMPRESSED = ("metrics.jsonl", "sequences.jsonl")
"""Kept gzipped (`*.gz`; `read_metrics` and `read_sequences` read either): a 300-step run's
metrics are about 2 MB and compress sixfold, its per-sequence records about tenfold. Kept
plain, the records no longer fit beside a build in a device run's 64 MiB carry."""


def _gzip(source: Path, target: Path) -> None:
    # mtime 0: the same record gzips to the same bytes, so a re-keep shows no diff
    with source.open("rb") as src, target.open("wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            shutil.copyfileobj(src, out)


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
                _gzip(run / name, target / f"{name}.gz")
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
