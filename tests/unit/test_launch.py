"""`tir-rl launch`: the servers' commands, the trainer's config, and the Slurm script."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tir_rl.config import load
from tir_rl.engine.choice import EngineKind
from tir_rl.engine.server_guard import SERVER_GUARD
from tir_rl.errors import ConfigError
from tir_rl.launch import plan_local_launch, pool_overrides, slurm_script, trainer_config
from tir_rl.run_config import RunConfig
from tir_rl.run_secret import RunSecret

LOCAL = [
    "model=tiny",
    "engine.max_model_len=1024",
    "engine.kv_cache_gib=0.5",
    "engine.enable_prefix_caching=true",
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
    sized = _config(tmp_path, "engine.block_size=32", "engine.max_num_batched_tokens=4096")
    flags = plan_local_launch(sized, servers=1, ports=[9001], weights_dir=tmp_path).servers[0]
    assert flags.command[flags.command.index("--block-size") + 1] == "32"
    assert flags.command[flags.command.index("--max-num-batched-tokens") + 1] == "4096"
    for dtype, caching in (("float32", "--enable-prefix-caching"),
                           ("bfloat16", "--no-enable-prefix-caching")):  # fmt: skip
        sets = ["model=tiny", f"engine.dtype={dtype}", f"run.out_dir={tmp_path}"]
        config = load(RunConfig, None, sets)
        assert config.engine.enable_prefix_caching is None
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
    assert "#SBATCH --nodes=4" in script
    assert "env VLLM_SERVER_DEV_MODE=1 TIR_RL_RUN_SECRET_FILE=" in script
    assert "--host 0.0.0.0" in script and f"--middleware {SERVER_GUARD}" in script
    secret_file = config.run_dir / "launch" / "secret"
    assert f"-m tir_rl.run_secret {secret_file}" in script  # a fresh secret per job
    assert f"--set engine.http.api_key_file={secret_file}" in script
    assert "umask 077" in script
    assert '--set "engine.http.base_urls=[$joined]"' in script
    assert "--set engine.weights_dir=/shared/w" in script
    assert f"train --config {tmp_path / 'train.yaml'} --nproc-per-node 4" in script
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n"], input=script, text=True, check=True)  # it parses
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
