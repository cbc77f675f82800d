"""The trained lab model's build command (scripts/build_lab_sft.sh) is reproducible.

Its two stages, shortened: the same arguments give the same weights, and the second stage
trains on a demonstrator that answers early.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--steps", "2", "--eval-every", "2", "--batch", "4", "--episodes", "16", "--threads", "1"]


def _build(out: Path, *extra: str) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "lab_sft_model.py"), "--out", str(out)]
    done = subprocess.run(
        [*command, *SHORT, "--splits", "train", "test", *extra],
        check=True,
        capture_output=True,
        text=True,
    )
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return summary


@pytest.mark.slow
def test_both_stages_rebuild_the_same_weights(tmp_path):
    first, again = (_build(tmp_path / name) for name in ("a", "b"))
    assert first["sha256"] == again["sha256"]
    assert first["early_answers"] == 0
    early = ["--init", str(tmp_path / "a"), "--early-answer-rate", "0.5", "--lr", "1e-3"]
    second, second_again = (_build(tmp_path / name, *early) for name in ("a2", "b2"))
    assert second["sha256"] == second_again["sha256"] != first["sha256"]
    assert 0 < second["early_answers"] < second["demonstrations"] == 16
