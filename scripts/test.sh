#!/usr/bin/env bash
# Set up (idempotent) and run the default test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${TIR_RL_VENV:-$PWD/.venv}
exec "$VENV/bin/python" -m pytest -m "not slow" "$@"
