#!/usr/bin/env bash
# Install Docker's engine and bubblewrap from Debian if missing, and start dockerd if no
# engine answers. Idempotent. Machines of this kind have no service manager, so dockerd is
# started in the background by hand, with no bridge network: containers then only have `lo`.
set -euo pipefail
log() { printf '\033[1m[docker]\033[0m %s\n' "$*" >&2; }

# chromium is for the trajectory viewer's browser test (headless screenshots).
if ! command -v dockerd >/dev/null || ! command -v bwrap >/dev/null \
    || ! command -v chromium >/dev/null; then
    log "installing docker.io, bubblewrap and chromium (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq docker.io bubblewrap chromium >/dev/null
fi

if docker info >/dev/null 2>&1; then
    exit 0
fi

STATE=${TIR_RL_DOCKER_STATE:-/var/lib/tir-rl-docker}
mkdir -p "$STATE"
log "starting dockerd (state in $STATE, log in $STATE/dockerd.log)"
nohup dockerd --iptables=false --ip-masq=false --bridge=none \
    --data-root "$STATE/data" --exec-root "$STATE/exec" --pidfile "$STATE/dockerd.pid" \
    >"$STATE/dockerd.log" 2>&1 </dev/null &
for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && exit 0
    sleep 0.5
done
log "dockerd did not come up within 30 s; see $STATE/dockerd.log"
exit 1
