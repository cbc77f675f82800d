#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, slow lane included (what CI runs).
# TIR_RL_TEST_FAST=1 (make test-fast) skips the tests marked slow. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${TIR_RL_VENV:-$PWD/.venv}
if [[ "${TIR_RL_TEST_FAST:-0}" == 1 ]]; then
    exec "$VENV/bin/python" -m pytest -m "not slow" "$@"
fi
exec "$VENV/bin/python" -m pytest "$@"
