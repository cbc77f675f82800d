"""`tir-rl` with the tests' fake-reward env registered, for runs in a subprocess.

Usage: python tiny_env_cli.py train --config FILE   (any `tir-rl` arguments)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import test_train_tiny  # noqa: E402, F401 (registers tests/FakeParityReward-v0)

from tir_rl import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
