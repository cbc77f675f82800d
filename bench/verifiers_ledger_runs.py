"""How often the verifiers ledger test's GRPO steps carry a learning signal.

`tests/integration/endpoint/test_verifiers_env.py` trains the tiny model, fine-tuned on
scripted ledger episodes, for 3 GRPO steps of 2 groups x 4 through the verifiers worker,
which it SIGKILLs in step 1. A step updates the model only when a group's rewards differ;
the test requires an update in step 2 or 3. This script runs that test N times and keeps
each run's metrics, or (`--report`) prints, per kept run and step, the rollout's mean
reward, the groups whose rewards all tied, and whether the step updated the model
(step 1's groups are the killed episodes', dropped as errors):

    python bench/verifiers_ledger_runs.py --runs 2 --out bench/verifiers_records/ledger_test_runs
    python bench/verifiers_ledger_runs.py --report bench/verifiers_records/ledger_test_runs
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = ROOT / "tests" / "integration" / "endpoint" / "test_verifiers_env.py"


def run(out: Path, runs: int) -> None:
    """Run the test `runs` times; keep each run's metrics as `out/run<i>.metrics.jsonl`."""
    out.mkdir(parents=True, exist_ok=True)
    first = len(list(out.glob("*.metrics.jsonl")))
    for i in range(first, first + runs):
        with tempfile.TemporaryDirectory() as base:
            command = [sys.executable, "-m", "pytest", "-q", str(TEST), f"--basetemp={base}"]
            status = subprocess.run(command, cwd=ROOT, check=False).returncode
            metrics = Path(base) / "verifiers0" / "verifiers" / "metrics.jsonl"
            if metrics.exists():
                shutil.copy(metrics, out / f"run{i}.metrics.jsonl")
            print(f"run {i}: pytest exit status {status}")


def report(folder: Path) -> None:
    """One line per kept run."""
    for path in sorted(folder.glob("*.metrics.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        cells = []
        for row in rows:
            if "train/degenerate_groups" not in row:
                continue
            updated = (row.get("train/num_loss_tokens") or 0) > 0
            cells.append(
                f"step {row['step']}: reward {row['rollout/reward_mean']:.3f}, tied groups "
                f"{int(row['train/degenerate_groups'])}/2, {'update' if updated else 'no update'}"
            )
        print(f"{path.name.removesuffix('.metrics.jsonl')}: " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/verifiers_records/ledger_test_runs"
    )
    parser.add_argument("--report", type=Path, help="print the kept runs of this folder")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    else:
        run(args.out, args.runs)


if __name__ == "__main__":
    main()
