#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, slow lane included (what CI runs).
# TIR_RL_TEST_FAST=1 (make test-fast) skips the tests marked slow. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# verifiers in a venv of its own (it needs openai<3), for the slow verifiers test (seconds
# the first time, bench/verifiers_records/cost.txt; then a stamp check). It needs nothing of
# the project's set-up, so both run at once.
verifiers_setup=
if [[ "${TIR_RL_TEST_FAST:-0}" != 1 ]]; then
    bash scripts/setup_verifiers.sh &
    verifiers_setup=$!
fi
bash scripts/setup.sh
if [[ -n $verifiers_setup ]]; then
    wait "$verifiers_setup"
fi
VENV=${TIR_RL_VENV:-$PWD/.venv}
# Two workers: much of an integration test waits on an engine, a server or a subprocess, so
# the two cores are better used by two tests at once (tests/conftest.py groups them).
# TIR_RL_TEST_WORKERS=0 runs in this process (e.g. to debug with -s or --pdb).
# Each test's span goes to the timeline (`python bench/test_timeline.py runs/test_timeline.jsonl`).
mkdir -p runs
export TIR_RL_TEST_TIMELINE=${TIR_RL_TEST_TIMELINE:-$PWD/runs/test_timeline.jsonl}
: > "$TIR_RL_TEST_TIMELINE"
WORKERS=(-n "${TIR_RL_TEST_WORKERS:-2}" --dist loadgroup --durations=30)
if [[ "${TIR_RL_TEST_FAST:-0}" == 1 ]]; then
    exec "$VENV/bin/python" -m pytest "${WORKERS[@]}" -m "not slow" "$@"
fi
exec "$VENV/bin/python" -m pytest "${WORKERS[@]}" "$@"
