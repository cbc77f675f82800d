"""`tir-rl launch`: two real `vllm serve` servers and the trainer, one of them killed mid-run.

The launch starts both servers from the config's local engine section, trains on them as a
pool (`engine.http.base_urls`), and stops them when the run ends. The weights travel by
vLLM's transfer protocol (`engine.weight_transfer: gloo`, the CPU twin of nccl): one group
spans the trainer and both servers. One server is SIGKILLed after the first step; the run
must finish its steps on the other, whose group is formed anew and which must end with the
trained weights, and no server process may outlive the launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tir_rl.report.run_log import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

HERE = Path(__file__).parent
STEPS = 3


def _config(tmp_path: Path) -> Path:
    config = {
        "model": "tiny",
        "run": {
            "name": "pool",
            "out_dir": str(tmp_path / "runs"),
            "steps": STEPS,
            "tasks_per_step": 2,
            "group_size": 4,
            "eval_tasks": 1,
            "checkpoint_every": 0,
            "plot_every": 0,
        },
        # the tests' fake-reward env (rewards every other episode), imported by the trainer
        "env": {"id": "test_train_tiny:FakeParityRewardEnv", "kwargs": {"horizon": 2}},
        "engine": {
            "local": {"max_model_len": 2048, "kv_cache_gib": 0.25},
            "weight_transfer": "gloo",
        },
        "rollout": {"max_turns": 2, "max_tokens_per_turn": 24, "end_on_truncated_turn": False},
        "trainer": {"lr": 1e-3},
        "correction_preset": "geo_rs_token_tis",
    }
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _server_processes(launcher: psutil.Process) -> list[psutil.Process]:
    return [
        p
        for p in launcher.children(recursive=False)
        if "tir_rl.engine.in_vllm.serve" in " ".join(p.cmdline())
    ]


def test_a_launched_pool_trains_and_a_killed_server_leaves_the_run_going(tmp_path):
    run_dir = tmp_path / "runs" / "pool"
    log = (tmp_path / "launch.log").open("w")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    launch = subprocess.Popen(
        [sys.executable, "-m", "tir_rl.cli", "launch", "--config", str(_config(tmp_path)),
         "--servers", "2", "--base-port", "0", "--weights-dir", str(tmp_path / "weights")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    launcher = psutil.Process(launch.pid)
    servers: list[psutil.Process] = []
    everything: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while not [r for r in _rows(run_dir) if "train/loss" in r]:
            assert launch.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step within 600 s"
            servers = servers or _server_processes(launcher)
            time.sleep(0.5)
        servers = _server_processes(launcher)
        assert len(servers) == 2
        everything = [*servers, *(c for s in servers for c in s.children(recursive=True))]
        killed = servers[1]
        os.killpg(killed.pid, signal.SIGKILL)  # the server and its engine core, at once
        assert launch.wait(timeout=600) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        log.close()
    _gone, alive = psutil.wait_procs(everything, timeout=30)
    assert not alive, f"server processes outlived the launch: {[p.pid for p in alive]}"

    rows = [r for r in _rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["engine/servers_up"] == 2.0
    assert rows[-1]["engine/servers_up"] == 1.0
    synced = [r for r in rows if "sync/parity_max_abs_diff" in r]
    assert synced and all(r["sync/parity_max_abs_diff"] < 1e-3 for r in synced)

    # After the kill the survivor took every sync, and its parity probe passed.
    assert rows[-1]["sync/parity_max_abs_diff"] < 1e-3
    # Both servers sampled before the kill: new episodes go to the least-loaded one. Both
    # joined the first transfer group; the survivor joined a second one after the kill; no
    # weights went through files.
    joins = []
    for server_log in sorted((run_dir / "launch").glob("server-*.log")):
        text = server_log.read_text()
        assert "POST /v1/completions" in text, server_log.name
        assert "POST /collective_rpc" not in text, server_log.name
        joins.append(text.count("POST /init_weight_transfer_engine"))
    assert min(joins) >= 1 and max(joins) >= 2, joins


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []
