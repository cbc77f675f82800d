#!/usr/bin/env bash
# A real Slurm cluster of NODES nodes on this one machine, for testing `tir-rl launch --emit
# slurm` with sbatch, srun and scancel as a cluster runs them (docs/scale.md, "The Slurm run").
#
#   bash scripts/slurm_local_cluster.sh up DIR [NODES]   # start it; prints SLURM_CONF=...
#   bash scripts/slurm_local_cluster.sh down DIR         # stop it, remove its namespaces
#
# Each node is a network namespace with an address of its own on a bridge (10.77.0.10, .11,
# ...), a hostname of its own (tnode0, tnode1, ...; a UTS namespace) and its own slurmd.
# The controller listens on the bridge (10.77.0.1, hostname tctl). Munge runs with a key and
# socket of the cluster's own, in DIR. The nodes share this machine's file system, processes
# and Docker engine, as a cluster's nodes share a network file system. Needs root and
# Debian's slurmctld, slurmd, slurm-client and munge (`up` installs them when missing).
# Slurm builds without --enable-multiple-slurmd (Debian's) allow one slurmd per host name
# and address; the namespaces give each its own.
set -euo pipefail

action=${1:?usage: slurm_local_cluster.sh up|down DIR [NODES]}
DIR=$(realpath -m "${2:?usage: slurm_local_cluster.sh up|down DIR [NODES]}")
NODES=${3:-2}
BRIDGE=tirrl-br0
SUBNET=10.77.0

ACTIVE=/run/tirrl-slurm-cluster  # the folder of the cluster that is up, if one is

node_ns() { echo "tirrl-node$1"; }

down() {
    local folders=("$DIR")
    [[ -f $ACTIVE ]] && folders+=("$(cat "$ACTIVE")")
    for folder in "${folders[@]}"; do
        for pidfile in "$folder"/slurmd-*.pid "$folder"/ctld.pid "$folder"/munge/pid; do
            [[ -f $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
        done
    done
    rm -f "$ACTIVE"
    sleep 1
    for ns in $(ip netns list | awk '/^tirrl-node/ {print $1}'); do
        # anything still in the node's namespace (a job step's process) goes with it
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns delete "$ns"
    done
    ip link delete "$BRIDGE" 2>/dev/null || true
}

if [[ $action == down ]]; then
    down
    exit 0
fi
[[ $action == up ]] || { echo "usage: slurm_local_cluster.sh up|down DIR [NODES]" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "slurm_local_cluster.sh: needs root (namespaces, daemons)" >&2; exit 1; }
if ! command -v slurmd > /dev/null || ! command -v munged > /dev/null || ! command -v sbatch > /dev/null; then
    packages=(slurmctld slurmd slurm-client munge iproute2)
    install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}"; }
    install > /dev/null || { apt-get update -q > /dev/null && install > /dev/null; }
fi
down  # a cluster an earlier run left
rm -rf "$DIR"
mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool"
echo "$DIR" > "$ACTIVE"
chmod 700 "$DIR/munge"
head -c 1024 /dev/urandom > "$DIR/munge/key"
chmod 400 "$DIR/munge/key"
munged --force --key-file="$DIR/munge/key" --socket="$DIR/munge/sock" \
    --pid-file="$DIR/munge/pid" --log-file="$DIR/munge/log" --seed-file="$DIR/munge/seed"

ip link add "$BRIDGE" type bridge
ip addr add "$SUBNET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
printf '127.0.0.1 localhost\n%s.1 tctl\n' "$SUBNET" > "$DIR/hosts"
node_lines=""
for ((i = 0; i < NODES; i++)); do
    ns=$(node_ns "$i")
    ip netns add "$ns"
    ip link add "tirrl-veth$i" type veth peer name eth0 netns "$ns"
    ip link set "tirrl-veth$i" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    printf '%s.%d tnode%d\n' "$SUBNET" $((10 + i)) "$i" >> "$DIR/hosts"
    node_lines+="NodeName=tnode$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$(nproc) RealMemory=4000 State=UNKNOWN"$'\n'
done

cat > "$DIR/slurm.conf" << EOF
ClusterName=tirrl
SlurmctldHost=tctl($SUBNET.1)
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/ctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/ctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
# linuxproc: a step's processes are its slurmstepd's descendants (no cgroup of its own here)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=15
${node_lines}PartitionName=main Nodes=tnode[0-$((NODES - 1))] Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$DIR/slurm.conf
# Each daemon in a mount namespace of its own whose /etc/hosts names the cluster's hosts.
unshare --uts --mount sh -c "hostname tctl; mount --bind '$DIR/hosts' /etc/hosts; exec slurmctld"
for ((i = 0; i < NODES; i++)); do
    mkdir -p "$DIR/spool/tnode$i"
    nsenter --net="/run/netns/$(node_ns "$i")" unshare --uts --mount sh -c \
        "hostname tnode$i; mount --bind '$DIR/hosts' /etc/hosts; exec slurmd"
done
for _ in $(seq 60); do
    if [[ $(sinfo -h -o '%D %t' | awk '$2 == "idle" {n += $1} END {print n + 0}') == "$NODES" ]]; then
        echo "SLURM_CONF=$DIR/slurm.conf"
        exit 0
    fi
    sleep 1
done
echo "slurm_local_cluster.sh: the nodes did not come up; see $DIR/*.log" >&2
sinfo >&2 || true
exit 1
