#!/usr/bin/env bash
# How long installing tir-rl's Python environment takes with pip and with uv (what
# scripts/setup.sh does), each into a fresh venv with empty caches, measured in one run;
# then whether both installed the same versions.
#
#   bash bench/setup_time.sh [RECORD]     # default record: bench/setup_records/pip_vs_uv.txt
set -euo pipefail
cd "$(dirname "$0")/.."
RECORD=${1:-bench/setup_records/pip_vs_uv.txt}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/tir-rl-setup-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT

uv_args=()
for links in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
    uv_args+=(--find-links "$links")
done
constraint=$("$PY" -m pip config get global.constraint 2>/dev/null || true)
[[ -n $constraint && -f $constraint ]] && uv_args+=(--constraint "$constraint")

time_pip() {
    "$PY" -m venv "$WORK/pip"
    PIP_CACHE_DIR="$WORK/pip-cache" "$WORK/pip/bin/python" -m pip install -q -e ".[cpu,dev]"
}
time_uv() {
    "$PY" -m venv "$WORK/uv"
    PIP_CACHE_DIR="$WORK/pip-cache-uv" "$WORK/uv/bin/python" -m pip install -q uv==0.13.9
    UV_CACHE_DIR="$WORK/uv-cache" UV_LINK_MODE=copy "$WORK/uv/bin/uv" pip install -q --compile-bytecode \
        --python "$WORK/uv/bin/python" "${uv_args[@]}" -e ".[cpu,dev]"
}
seconds() { local start; start=$(date +%s.%N); "$@"; echo "$(date +%s.%N) - $start" | bc; }

uv_s=$(seconds time_uv)
pip_s=$(seconds time_pip)
norm() { "$1" -m pip freeze 2>/dev/null | grep -v -e '^-e' -e '^uv==' | tr 'A-Z_' 'a-z-' | sort; }
same=$(diff <(norm "$WORK/pip/bin/python") <(norm "$WORK/uv/bin/python") >/dev/null && echo yes || echo no)
{
    echo "install of tir-rl[cpu,dev] into a fresh venv, empty caches, $(nproc) cores, $(date -u +%F)"
    echo
    echo "| installer | seconds | ratio to pip |"
    echo "|---|---|---|"
    printf '| pip | %.0f | 1.00 |\n' "$pip_s"
    printf '| uv (incl. installing uv) | %.0f | %.2f |\n' "$uv_s" "$(echo "$uv_s / $pip_s" | bc -l)"
    echo
    echo "same versions installed (pip freeze): $same"
} | tee "$RECORD"
