#!/usr/bin/env bash
# What the verifiers path costs here: building .venv-verifiers from scratch (what
# scripts/setup_verifiers.sh does, into a temporary venv with an empty uv cache) and
# importing verifiers.v1 there (paid once per episode, in play_one.py's process).
#
#   bash bench/verifiers_cost.sh [RECORD]   # default: bench/verifiers_records/cost.txt
set -euo pipefail
cd "$(dirname "$0")/.."
RECORD=${1:-bench/verifiers_records/cost.txt}
WORK=$(mktemp -d /tmp/tir-rl-vf-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s.%N)
TIR_RL_VERIFIERS_VENV="$WORK/venv" bash scripts/setup_verifiers.sh 2>/dev/null
setup_s=$(echo "$(date +%s.%N) - $start" | bc)
size=$(du -sh "$WORK/venv" | cut -f1)
imports=()
for _ in 1 2 3; do
    start=$(date +%s.%N)
    "$WORK/venv/bin/python" -c "import verifiers.v1"
    imports+=("$(printf '%.1f' "$(echo "$(date +%s.%N) - $start" | bc)")")
done
{
    echo "verifiers cost on $(nproc) cores, $(date -u +%F)"
    echo
    printf 'setup_verifiers.sh from scratch: %.0f s, %s\n' "$setup_s" "$size"
    echo "import verifiers.v1 (3 runs, s): ${imports[*]}"
} | tee "$RECORD"
