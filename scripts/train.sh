#!/usr/bin/env bash
# Set up (idempotent) and run the README's main job. Extra arguments go to `tir-rl train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${TIR_RL_VENV:-$PWD/.venv}
exec "$VENV/bin/tir-rl" train --config configs/lab_sft.yaml "$@"
