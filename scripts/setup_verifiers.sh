#!/usr/bin/env bash
# Build .venv-verifiers: the `verifiers` package (pinned) in a virtual environment of its own.
#
# verifiers 0.4.0 needs openai<3 while the project's .venv has openai 3 (vLLM and the Agents
# SDK), so a verifiers environment runs in this venv and reaches the run only through the
# chat endpoint (examples/verifiers_env/play_one.py, run per episode by CommandAgentEnv).
# Idempotent: a stamp of this script's hash skips everything when nothing changed.
#
# Steps (what it costs: bench/verifiers_cost.sh and docs/bring_your_agent.md):
#   1. a venv in $TIR_RL_VERIFIERS_VENV (default .venv-verifiers) with uv in it
#   2. verifiers and its dependencies, installed by uv (much faster than pip for this list)
#   3. verifiers' chat program (its `null` harness: a PEP 723 script that verifiers prepares
#      with uv before an episode) synced once into the venv's uv cache, so an episode
#      downloads nothing
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TIR_RL_VERIFIERS_VENV:-$PWD/.venv-verifiers}
PY=${PYTHON:-python3}
VERIFIERS=verifiers==0.4.0
UV=uv==0.13.9

log() { printf '\033[1m[setup-verifiers]\033[0m %s\n' "$*" >&2; }

stamp="$VENV/.tir-rl-installed"
want=$(sha256sum scripts/setup_verifiers.sh | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi
start=$(date +%s)
log "creating $VENV ($VERIFIERS)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$UV"
# uv's cache lives in the venv: play_one.py points verifiers' uv at the same one.
export UV_CACHE_DIR="$VENV/uv-cache"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$VERIFIERS"
# verifiers finds uv on PATH (else it installs one under ~/.local).
PATH="$VENV/bin:$PATH" "$VENV/bin/python" - <<'PY'
import asyncio
import os

from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import SubprocessConfig
from verifiers.v1.runtimes.subprocess import SubprocessRuntime


async def sync() -> None:
    runtime = SubprocessRuntime(SubprocessConfig(), name=f"tir-rl-setup-{os.getpid()}")
    await runtime.start()
    try:
        await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)
    finally:
        await runtime.teardown()


asyncio.run(sync())
PY
echo "$want" > "$stamp"
log "ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1), $VENV)"
