"""`tir-rl launch`: the servers' commands, the trainer's config, and the Slurm script."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tir_rl.config import load
from tir_rl.engine.engine_config import EngineKind
from tir_rl.engine.in_vllm.server_guard import SERVER_GUARD
from tir_rl.errors import ConfigError
from tir_rl.launch import plan_local_launch, pool_overrides, slurm_script, trainer_config
from tir_rl.process.run_secret import RunSecret
from tir_rl.run_config import RunConfig

LOCAL = [
    "model=tiny",
    "engine.local.max_model_len=1024",
    "engine.local.kv_cache_gib=0.5",
    "engine.local.enable_prefix_caching=true",
    "engine.dtype=float32",
]


def _config(tmp_path: Path, *extra: str) -> RunConfig:
    return load(RunConfig, None, [*LOCAL, f"run.out_dir={tmp_path}", *extra])


def test_servers_get_the_local_engine_flags_and_the_trainer_gets_the_pool(tmp_path):
    config = _config(tmp_path)
    plan = plan_local_launch(config, servers=2, ports=[9001, 9002], weights_dir=tmp_path / "w")
    assert [s.url for s in plan.servers] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    for server, port in zip(plan.servers, (9001, 9002), strict=True):
        flags = server.command
        assert flags[flags.index("--port") + 1] == str(port)
        assert flags[flags.index("--max-model-len") + 1] == "1024"
        assert str(0.5 * (1 << 30)).split(".")[0] in flags
        assert "--enable-prefix-caching" in flags
    cmd = plan.train_command
    train_yaml = Path(cmd[cmd.index("--config") + 1])
    sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    urls = [s.url for s in plan.servers]
    assert sets == pool_overrides(urls, str(tmp_path / "w"), plan.secret_file)
    trainer = load(RunConfig, train_yaml, sets)  # what the trainer process loads
    assert trainer.engine.kind is EngineKind.HTTP
    # The run's secret: owner-only, in an owner-only folder, given to the trainer by path.
    assert plan.secret_file.parent == config.run_dir / "launch"
    assert stat.S_IMODE(plan.secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(plan.secret_file.parent.stat().st_mode) == 0o700
    assert trainer.engine.http.api_key_file == str(plan.secret_file)
    assert RunSecret.read(plan.secret_file).value not in " ".join(cmd + flags)
    assert "--middleware" in flags and SERVER_GUARD in flags
    assert trainer.engine.server_urls() == [s.url for s in plan.servers]
    assert trainer.engine.dtype == "float32"
    assert trainer.run == config.run and trainer.trainer == config.trainer


def test_the_servers_get_the_kv_block_size_the_token_budget_and_the_dtypes_prefix_cache(tmp_path):
    sized = _config(
        tmp_path, "engine.local.block_size=32", "engine.local.max_num_batched_tokens=4096"
    )
    flags = plan_local_launch(sized, servers=1, ports=[9001], weights_dir=tmp_path).servers[0]
    assert flags.command[flags.command.index("--block-size") + 1] == "32"
    assert flags.command[flags.command.index("--max-num-batched-tokens") + 1] == "4096"
    for dtype, caching in (("float32", "--enable-prefix-caching"),
                           ("bfloat16", "--no-enable-prefix-caching")):  # fmt: skip
        sets = ["model=tiny", f"engine.dtype={dtype}", f"run.out_dir={tmp_path}"]
        config = load(RunConfig, None, sets)
        assert config.engine.local.enable_prefix_caching is None
        server = plan_local_launch(config, servers=1, ports=[9001], weights_dir=tmp_path)
        assert caching in server.servers[0].command


def test_a_config_on_servers_someone_else_started_is_refused(tmp_path):
    config = _config(tmp_path)
    tree = trainer_config(config)
    path = tmp_path / "http.yaml"
    path.write_text(yaml.safe_dump(tree))
    overrides = pool_overrides(["http://127.0.0.1:1"], "/dev/shm/w", tmp_path / "secret")
    http = load(RunConfig, path, overrides)
    with pytest.raises(ConfigError, match="starts the servers itself"):
        trainer_config(http)


def test_the_slurm_script_trains_on_node_0_and_serves_on_the_others(tmp_path):
    config = _config(tmp_path)
    script = slurm_script(
        config, tmp_path / "train.yaml", servers=3, weights_dir="/shared/w", nproc_per_node=4
    )
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=1" in script
    assert "env VLLM_SERVER_DEV_MODE=1 TIR_RL_RUN_SECRET_FILE=" in script
    assert "--host 0.0.0.0" in script and f"--middleware {SERVER_GUARD}" in script
    secret_file = config.run_dir / "launch" / "secret"
    assert f"-m tir_rl.process.run_secret {secret_file}" in script  # a fresh secret per job
    assert f"--set engine.http.api_key_file={secret_file}" in script
    assert "umask 077" in script
    assert '--set "engine.http.base_urls=[$joined]"' in script
    assert "--set engine.weights_dir=/shared/w" in script
    assert f"train --config {tmp_path / 'train.yaml'} --nproc-per-node 4" in script
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n"], input=script, text=True, check=True)  # it parses
    cpu_only = slurm_script(
        config, tmp_path / "t.yaml", servers=1, weights_dir="/w", gpus_per_node=0
    )
    assert "--gpus-per-node" not in cpu_only  # a CPU partition has no GPU to ask for
    with pytest.raises(ConfigError, match="needs --weights-dir"):
        slurm_script(config, tmp_path / "train.yaml", servers=2, weights_dir="")
    with pytest.raises(ConfigError, match="at least 1"):
        slurm_script(config, tmp_path / "train.yaml", servers=0, weights_dir="/w")


def test_with_nccl_the_servers_take_the_transfer_and_the_slurm_script_needs_no_shared_folder(
    tmp_path,
):
    config = _config(tmp_path, "engine.weight_transfer=nccl")
    plan = plan_local_launch(config, servers=1, ports=[9001], weights_dir=tmp_path / "w")
    flags = plan.servers[0].command
    assert flags[flags.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert trainer_config(config)["engine"]["weight_transfer"] == "nccl"
    script = slurm_script(config, tmp_path / "train.yaml", servers=2, weights_dir="")
    assert "--weight-transfer-config" in script
    assert '--set "engine.transfer_address=${nodes[0]}"' in script
    assert "engine.weights_dir" not in script
    subprocess.run([shutil.which("bash") or "bash", "-n"], input=script, text=True, check=True)


FAKE_SLURM = {
    "scontrol": 'printf "n0\\nn1\\nn2\\nn3\\n"\n',
    # Skips srun's own options, then runs the step's command on each of its --nodes, as
    # Slurm would, with SLURM_NODEID set to the node's index in the step.
    "srun": """nodes=1
while [[ "$1" == -* ]]; do
    case "$1" in --nodes=*) nodes=${1#--nodes=} ;; -w) shift ;; esac
    shift
done
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@"; done
""",
    "curl": "exit 0\n",
    # The nodes' `python`: records what each launch asked for, one line per call.
    "python": 'echo "secret=${TIR_RL_RUN_SECRET_FILE:-} $*" >> "$FAKE_SLURM_LOG"\n',
}


def test_the_slurm_script_runs_each_trainer_node_with_its_rank_on_a_fake_slurm(tmp_path):
    """The emitted script run by bash against fake `srun`, `scontrol`, `curl` and `python`
    (each a few lines of shell): what every node's process would have been started with."""
    config = _config(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    script = slurm_script(
        config, tmp_path / "train.yaml", servers=2, weights_dir="/shared/w", trainer_nodes=2,
        nproc_per_node=4, python=str(bin_dir / "python"),
    )  # fmt: skip
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_SLURM_LOG": str(log), "HOME": str(tmp_path)}
    env["SLURM_JOB_NODELIST"] = "n[0-3]"
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    secret_file = config.run_dir / "launch" / "secret"
    assert calls[0] == f"secret= -m tir_rl.process.run_secret {secret_file}"
    servers = [c for c in calls if "tir_rl.engine.in_vllm.serve" in c]
    assert len(servers) == 2 and all(c.startswith(f"secret={secret_file} ") for c in servers)
    trainers = [c for c in calls if " train " in c]
    assert len(trainers) == 2
    for rank, call in enumerate(trainers):
        assert call.startswith("secret= ")  # the trainer reads the secret's path from its config
        assert "--nproc-per-node 4 --nnodes 2 --master-addr n0 --master-port 29500" in call
        assert call.endswith(f"--node-rank {rank}")
        assert "engine.http.base_urls=[http://n2:8000,http://n3:8000]" in call
        assert f"engine.http.api_key_file={secret_file}" in call


def test_a_node_s_place_in_a_multi_node_job_is_checked():
    from tir_rl.cli import build_parser
    from tir_rl.commands import nodes_of as _nodes

    parse = build_parser().parse_args
    assert _nodes(parse(["train", "--config", "x.yaml"])) is None
    nodes = _nodes(parse(["train", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                          "--master-port", "29500"]))  # fmt: skip
    assert nodes is not None and nodes.torchrun_flags() == [
        "--nnodes=2", "--node-rank=1", "--master-addr=h", "--master-port=29500"
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="needs --node-rank"):
        _nodes(parse(["train", "--nnodes", "2"]))
    with pytest.raises(ConfigError, match="add --nnodes"):
        _nodes(parse(["train", "--node-rank", "1"]))
    with pytest.raises(ConfigError, match="not in 0..1"):
        _nodes(parse(["train", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h",
                      "--master-port", "1"]))  # fmt: skip
