"""`tir-rl launch`: a pool of `vllm serve` servers and the trainer, from one run config.

The run config's `engine` section describes the local engine as usual; the launch turns it
into server command lines (`vllm_http.serve_command`, one per server) and gives the trainer
a config whose engine is the pool of those servers (`engine.kind: http`,
`engine.http.base_urls`, docs/scale.md). Two forms:

- on this machine (`launch_local`): N servers on loopback ports, then `tir-rl train` (or
  torchrun's ranks with `--nproc-per-node`); the servers stop when the run ends, fails or
  is interrupted;
- on a Slurm cluster (`slurm_script`): an sbatch script whose first node trains and whose
  other nodes serve, one server each; with `engine.weight_transfer: file` the weights
  folder must be on a file system every node mounts at the same path, with `nccl` the
  weights go from the trainer's node to the servers' GPUs over NCCL.

Every server asks for the run's secret on every route (`tir_rl.process.run_secret`,
`tir_rl.engine.in_vllm.server_guard`): the launch writes a fresh one to `<run dir>/launch/secret`
(mode 600; on Slurm, when the job starts), hands the servers its path in
`TIR_RL_RUN_SECRET_FILE` and the trainer in `engine.http.api_key_file`.

Why torchrun, `vllm serve` and Slurm rather than Ray: docs/design.md ("Scaling out").
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tir_rl.config import to_dict
from tir_rl.engine.engine_config import HTTP_KEYS, EngineKind
from tir_rl.engine.vllm_http import serve_command
from tir_rl.errors import ConfigError, EngineError
from tir_rl.process.run_secret import SECRET_FILE_ENV, SECRET_FILE_NAME, RunSecret
from tir_rl.run_config import RunConfig

logger = logging.getLogger(__name__)

LAUNCH_DIR = "launch"
"""Folder of the run folder that holds the trainer's config and the servers' logs."""
TRAIN_CONFIG = "train.yaml"
SERVER_START_TIMEOUT_S = 900.0
"""Longest wait for a server to answer /health (vLLM-CPU takes about a minute)."""


@dataclass(frozen=True)
class ServerPlan:
    """One `vllm serve` of the pool."""

    url: str
    command: list[str]
    log: Path


@dataclass(frozen=True)
class LaunchPlan:
    """What `launch_local` starts: the servers, then the trainer."""

    servers: list[ServerPlan]
    train_command: list[str]
    """`tir-rl train` on the trainer's config, the pool's addresses given with `--set`."""
    weights_dir: Path
    secret_file: Path
    """The run's secret (mode 600): the servers ask every caller for it."""


def trainer_config(config: RunConfig) -> dict[str, Any]:
    """`config` as a tree whose engine section keeps only what applies to servers.

    The local engine's section (context length, KV cache, prefix caching, ...) is the
    servers' command-line flags now; the trainer gets the keys it checks against the
    servers (`engine.engine_config.HTTP_KEYS`). The pool's addresses, its weights folder and
    `engine.kind: http` are given with `--set` (they differ between launches).
    """
    if config.engine.kind is not EngineKind.LOCAL:
        raise ConfigError(
            "tir-rl launch starts the servers itself from the config's local engine section; "
            f"this config has engine.kind={config.engine.kind.value}. Use tir-rl train for a "
            "run on servers someone else started."
        )
    tree = to_dict(config)
    tree["engine"] = {k: v for k, v in tree["engine"].items() if k in HTTP_KEYS}
    return tree


def pool_overrides(urls: Sequence[str], weights_dir: str, secret_file: Path) -> list[str]:
    """The `--set` values that point the trainer at the pool and give it the run's secret."""
    return [
        "engine.kind=http",
        f"engine.http.base_urls=[{','.join(urls)}]",
        f"engine.weights_dir={weights_dir}",
        f"engine.http.api_key_file={secret_file}",
    ]


def launch_folder(config: RunConfig) -> Path:
    """`<run dir>/launch`, created readable by its owner only (it holds the secret)."""
    folder = config.run_dir / LAUNCH_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def new_run_secret(folder: Path) -> Path:
    """Write a fresh secret to `folder/secret` (mode 600) and return the file."""
    return RunSecret.generate().write(folder / SECRET_FILE_NAME)


def server_plans(config: RunConfig, ports: Sequence[int], log_dir: Path) -> list[ServerPlan]:
    """One `vllm serve` on loopback per port, with the config's local engine flags."""
    local = config.engine.local_config()
    return [
        ServerPlan(
            url=f"http://127.0.0.1:{port}",
            command=serve_command(local, port=port, python=sys.executable),
            log=log_dir / f"server-{i}.log",
        )
        for i, port in enumerate(ports)
    ]


def plan_local_launch(
    config: RunConfig,
    *,
    servers: int,
    ports: Sequence[int],
    weights_dir: Path,
    nproc_per_node: int = 1,
) -> LaunchPlan:
    """The servers and the trainer command for a launch on this machine.

    Writes the trainer's config to `<run dir>/launch/train.yaml`.
    """
    import yaml

    if servers < 1 or len(ports) != servers:
        raise ConfigError(f"tir-rl launch --servers {servers}: give at least 1 (one port each)")
    folder = launch_folder(config)
    secret_file = new_run_secret(folder)
    train_yaml = folder / TRAIN_CONFIG
    train_yaml.write_text(yaml.safe_dump(trainer_config(config), sort_keys=False))
    plans = server_plans(config, ports, folder)
    train = [sys.executable, "-m", "tir_rl.cli", "train", "--config", str(train_yaml)]
    for override in pool_overrides([p.url for p in plans], str(weights_dir), secret_file):
        train += ["--set", override]
    if nproc_per_node > 1:
        train += ["--nproc-per-node", str(nproc_per_node)]
    return LaunchPlan(
        servers=plans, train_command=train, weights_dir=weights_dir, secret_file=secret_file
    )


def launch_local(plan: LaunchPlan) -> int:
    """Start the servers, wait until each answers, run the trainer, stop the servers.

    Returns the trainer's exit status (130 after Ctrl-C).

    Raises:
        EngineError: a server exited or did not become healthy (the others are stopped).
    """
    with running_servers(plan.servers, plan.secret_file):
        logger.info("%d servers up; training", len(plan.servers))
        trainer = subprocess.Popen(plan.train_command)
        try:
            return trainer.wait()
        except KeyboardInterrupt:  # the trainer got the terminal's SIGINT too
            return trainer.wait()


@contextlib.contextmanager
def running_servers(
    servers: Sequence[ServerPlan], secret_file: Path
) -> Iterator[list[subprocess.Popen]]:
    """Start `servers`, wait until each answers `/health`, stop them all on exit.

    They run in process groups of their own (a terminal's Ctrl-C reaches the trainer, not
    them), which get SIGTERM on exit, then SIGKILL for whatever is left after 30 s. Each
    asks every caller for the secret in `secret_file`.

    Raises:
        ConfigError: `secret_file` is not a valid secret file.
        EngineError: a server exited or did not become healthy (the others are stopped).
    """
    secret = RunSecret.read(secret_file)
    started: list[tuple[ServerPlan, subprocess.Popen]] = []
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # weight reloads over HTTP, behind the run's secret
        SECRET_FILE_ENV: str(secret_file),
    }
    try:
        for server in servers:
            logger.info("starting %s: %s", server.url, shlex.join(server.command))
            with server.log.open("w") as log:
                proc = subprocess.Popen(
                    server.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            started.append((server, proc))
        for server, proc in started:
            _wait_healthy(server, proc, secret)
        yield [proc for _, proc in started]
    finally:
        for _, proc in started:
            _stop(proc)


def _wait_healthy(server: ServerPlan, proc: subprocess.Popen, secret: RunSecret) -> None:
    import httpx

    headers = {"Authorization": secret.authorization}
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineError(
                f"vllm serve for {server.url} exited with status {proc.returncode} while "
                f"starting; its log is {server.log}"
            )
        try:
            status = httpx.get(f"{server.url}/health", headers=headers, timeout=2.0).status_code
            if status == 200:
                return
            if status == 401:
                raise EngineError(
                    f"vllm serve for {server.url} refused the run's secret: is another "
                    f"server already listening on that port? Its log is {server.log}"
                )
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise EngineError(
        f"vllm serve for {server.url} did not answer /health within "
        f"{SERVER_START_TIMEOUT_S:.0f} s; its log is {server.log}"
    )


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group; after 30 s, SIGKILL whatever of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # the group may outlive its leader
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def slurm_script(
    config: RunConfig,
    config_path: Path,
    *,
    servers: int,
    weights_dir: str,
    port: int = 8000,
    gpus_per_node: int = 1,
    nproc_per_node: int = 1,
    trainer_nodes: int = 1,
    master_port: int = 29500,
    python: str = "python",
) -> str:
    """An sbatch script: nodes 0..T-1 train (`nproc_per_node` ranks each), the next N serve.

    Args:
        config: the loaded run config (its local engine section gives the servers' flags).
        config_path: where the trainer's config will be (written by the caller from
            `trainer_config`; it must be on a file system every node mounts).
        servers: server nodes, one `vllm serve` each.
        weights_dir: the published weights' folder, on a file system every node mounts at
            the same path.
        port: each server's port on its node.
        gpus_per_node: `--gpus-per-node` of the allocation (0: a CPU cluster, no GPU asked).
        nproc_per_node: trainer ranks per trainer node (FSDP2 under torchrun).
        trainer_nodes: nodes the trainer spans (`tir-rl train --nnodes`, rendezvous at
            node 0, where rank 0 runs the rollouts).
        master_port: node 0's rendezvous port when the trainer spans several nodes.
        python: the interpreter of the nodes' tir-rl environment.
    """
    if servers < 1:
        raise ConfigError(f"tir-rl launch --servers {servers}: give at least 1")
    if trainer_nodes < 1:
        raise ConfigError(f"tir-rl launch --trainer-nodes {trainer_nodes}: give at least 1")
    transfer = config.engine.weight_transfer
    if not weights_dir and not transfer.by_vllm_engine:
        raise ConfigError(
            "a multi-node launch with engine.weight_transfer=file needs --weights-dir: a "
            "folder on a file system that the trainer node and every server node mount at "
            "the same path (or set engine.weight_transfer=nccl to send the weights over NCCL)"
        )
    trainer_config(config)  # refuses a config that is not a local engine's
    local = config.engine.local_config()
    serve = shlex.join(serve_command(local, host="0.0.0.0", port=port, python=python))
    train = shlex.join([python, "-m", "tir_rl.cli", "train", "--config", str(config_path)])
    if nproc_per_node > 1:
        train += f" --nproc-per-node {nproc_per_node}"
    if trainer_nodes > 1:  # each trainer node adds its own --node-rank (below)
        train += f' --nnodes {trainer_nodes} --master-addr "${{nodes[0]}}"'
        train += f" --master-port {master_port}"
    logs = config.run_dir / LAUNCH_DIR
    if transfer.by_vllm_engine:  # the servers join the trainer's transfer group on node 0
        weights = '--set "engine.transfer_address=${nodes[0]}"'
    else:
        weights = f"--set engine.weights_dir={shlex.quote(weights_dir)}"
    logs_q = shlex.quote(str(logs))
    secret_file = shlex.quote(str(logs / SECRET_FILE_NAME))
    gpus = f"#SBATCH --gpus-per-node={gpus_per_node}\n" if gpus_per_node > 0 else ""
    new_secret = shlex.join([python, "-m", "tir_rl.process.run_secret"])
    return f"""#!/bin/bash
#SBATCH --job-name=tir-rl-{config.run.name}
#SBATCH --nodes={servers + trainer_nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --output={logs}/slurm-%j.out
# Written by `tir-rl launch --emit slurm`. Nodes 0..{trainer_nodes - 1} train, the next
# {servers} serve the model. The run folder and the model are on a file system all nodes mount.
set -euo pipefail
umask 077
mkdir -p {logs_q}
# The run's secret: a fresh one per job, mode 600; the servers ask every caller for it.
{new_secret} {secret_file}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
trainers=("${{nodes[@]:0:{trainer_nodes}}}")
servers=("${{nodes[@]:{trainer_nodes}}}")
urls=()
server_steps=()
for host in "${{servers[@]}}"; do
    srun --nodes=1 --ntasks=1 -w "$host" \\
        env VLLM_SERVER_DEV_MODE=1 {SECRET_FILE_ENV}={secret_file} {serve} \\
        > {logs_q}/server-"$host".log 2>&1 &
    server_steps+=($!)
    urls+=("http://$host:{port}")
done
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
# The header comes from a file descriptor: the secret never appears on a command line.
for i in "${{!urls[@]}}"; do
    until curl -sf -H @<(printf 'Authorization: Bearer %s\\n' "$(< {secret_file})") \\
        "${{urls[i]}}/health" > /dev/null; do
        if ! kill -0 "${{server_steps[i]}}" 2> /dev/null; then
            echo "tir-rl: the server on ${{servers[i]}} exited while starting; its log is" \\
                {logs_q}/server-"${{servers[i]}}".log >&2
            exit 1
        fi
        sleep 5
    done
done
joined=$(IFS=,; echo "${{urls[*]}}")
train=({train}
    --set engine.kind=http --set "engine.http.base_urls=[$joined]"
    --set engine.http.api_key_file={secret_file} {weights})
{_trainer_step(trainer_nodes)}
"""


def _trainer_step(trainer_nodes: int) -> str:
    """The srun that runs the trainer: on node 0, or on every trainer node with its rank."""
    if trainer_nodes == 1:
        return 'srun --nodes=1 --ntasks=1 -w "${nodes[0]}" "${train[@]}"'
    # SLURM_NODEID is the node's index in this step, whose nodes are the job's first ones.
    return (
        f"srun --nodes={trainer_nodes} --ntasks={trainer_nodes} --ntasks-per-node=1 \\\n"
        '    -w "$(IFS=,; echo "${trainers[*]}")" \\\n'
        '    bash -c \'exec "$@" --node-rank "$SLURM_NODEID"\' tir-rl-train "${train[@]}"'
    )
