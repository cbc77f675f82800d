"""Stop collapse-lab runs that collapsed for good, at a held-out evaluation.

    python bench/collapse/stop_collapsed.py runs/stab-raw     # beside the running suite

The rule (bench/collapse/stabilizers_plan.md, addendum of 2026-12-03): a run is stopped at a
held-out evaluation when its training reward was 0 at each of the `WINDOW` steps up to it and
that evaluation's clean held-out pass@1 is 0. It gets SIGTERM, as from `scancel` (a suite
started in the background ignores SIGINT, and so do its runs): the run writes its checkpoint
and exits, `run.py` records the attempt without a `DONE` marker, and the suite goes
on with its next run. Polls every run folder under the given one until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tir_rl.report.run_log import read_metrics

WINDOW = 20
"""Steps of training reward 0 before the evaluation."""


def collapsed_at_an_evaluation(run: Path) -> int | None:
    """The evaluation step at which `run` meets the rule, while it is still there; else None."""
    rows = read_metrics(run)  # skips a line the live run is still writing
    rewards = [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]
    evals = sorted((int(p.stem.rsplit("_", 1)[1]), p) for p in run.glob("eval_clean_step_*.json"))
    if not evals or not rewards:
        return None
    step, path = evals[-1]
    if step == 0 or rewards[-1][0] > step + 1:  # judged only while the run is at it
        return None
    last = [value for s, value in rewards if step - WINDOW < s <= step]
    held_out = json.loads(path.read_text())["pass_at_1"]["value"]
    return step if len(last) == WINDOW and max(last) == 0.0 and held_out == 0.0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the suite's --out folder")
    args = parser.parse_args()
    stopped: set[str] = set()
    while True:
        runs = sorted(p for p in args.out.iterdir() if p.is_dir()) if args.out.is_dir() else []
        for run in runs:
            if run.name in stopped or (run / "DONE").exists():
                continue
            if not (run / "metrics.jsonl").exists():
                continue
            step = collapsed_at_an_evaluation(run)
            if step is None:
                continue
            found = subprocess.run(
                ["pgrep", "-f", f"run.name={run.name} "], capture_output=True, text=True
            )
            for pid in found.stdout.split():
                os.kill(int(pid), signal.SIGTERM)
            print(f"{time.strftime('%T')} {run.name}: stopped at step {step}", flush=True)
            stopped.add(run.name)
        time.sleep(5)


if __name__ == "__main__":
    main()
