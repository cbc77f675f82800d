"""`tir-rl train` as a two-process FSDP2 job on the CPU (torchrun, gloo), tiny model, real vLLM."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tir_rl import checkpoint
from tir_rl import distributed as tdist
from tir_rl.config import load
from tir_rl.grpo import GRPOLoss
from tir_rl.metrics import load_trajectories, read_metrics
from tir_rl.models import prepare_tiny_model
from tir_rl.run_config import RunConfig
from tir_rl.train import latest_checkpoint, plan_step
from tir_rl.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("fsdp2_train_worker.py")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    command = tdist.torchrun_command(2, "tir_rl.cli", [])[:-2] + [
        str(WORKER),
        "train",
        "--config", str(ROOT / "configs" / "fsdp2_cpu.yaml"),
        "--set", "model=tiny",
        "--set", f"run.out_dir={out}",
        "--set", "run.steps=2",
        "--set", "run.eval_tasks=2",
        "--set", "run.checkpoint_every=0",
        "--set", "env.id=tests/FakeParityRewardFsdp-v0",
        "--set", "rollout.max_turns=2",
        "--set", "rollout.max_tokens_per_turn=24",
        "--set", "engine.kv_cache_gib=0.25",
        "--set", "trainer.lr=1e-3",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return out / "fsdp2_cpu"


def test_two_process_run_writes_metrics_and_a_loadable_checkpoint(run_dir):
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"])
        assert row["train/skipped"] == 0.0
        assert row["sync/parity_max_abs_diff"] < 1e-3  # the engine got the sharded weights
    assert load_trajectories(run_dir / "trajectories.jsonl")
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_2"
    trainer = Trainer(Trainer.Config(model=str(prepare_tiny_model())))
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    state = checkpoint.load(ckpt, trainer)
    assert state.step == 2 and trainer.step == 2
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, initial[k])]
    assert changed, "two optimizer steps at lr 1e-3 must change the weights"


def test_two_ranks_take_the_first_step_one_rank_takes(run_dir):
    config = load(RunConfig, run_dir / "config.yaml")
    first = next(r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r)
    trajectories = torch.load(run_dir / "trajectories_step1.pt", weights_only=False)
    plan, (work,) = plan_step(trajectories, world_size=1)
    assert work.batch is not None and work.advantages is not None
    trainer = Trainer(
        config.trainer, loss_fn=GRPOLoss(config.loss), correction_config=config.correction
    )
    old = trainer.compute_logprobs(work.batch)
    result = trainer.train_step(work.batch, work.advantages, old_logprobs=old)
    assert abs(result.loss - first["train/loss"]) < 1e-4
    assert abs(result.grad_norm - first["train/grad_norm"]) < 1e-4 * max(1.0, result.grad_norm)
    assert result.metrics["train/num_loss_tokens"] == first["train/num_loss_tokens"]
