"""One `tir-rl train` run, optionally pinned to a core, and its small record kept.

Shared by bench/lab_full_weight.py and bench/lab_sft_train.py: the run's resolved
`config.yaml`, `metrics.jsonl` and held-out evaluations (`eval_step_*.json`) are what their
reports read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

KEPT = ("config.yaml", "metrics.jsonl")
"""Copied with every `eval_step_*.json` of the run folder."""


def train_pinned(config: Path, sets: list[str], core: int | None) -> float:
    """Run `tir-rl train --config config --set ...`, on `core` alone if given; wall seconds."""
    env = dict(os.environ)
    prefix: list[str] = []
    if core is not None:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
        prefix = ["taskset", "-c", str(core)]
    command = [*prefix, sys.executable, "-m", "tir_rl.cli", "train", "--config", str(config)]
    for item in sets:
        command += ["--set", item]
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    return time.perf_counter() - started


def keep_record(run_dir: Path, out: Path) -> None:
    """Replace `out` with the record files of `run_dir`."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in run_dir.glob("*"):
        if path.name in KEPT or path.name.startswith("eval_step_"):
            shutil.copy(path, out / path.name)
