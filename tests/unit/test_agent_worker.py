"""`WorkerAgentEnv`: a worker process that stays up plays many episodes through the endpoint.

The worker is a fake in another process (external_worker.py, plain HTTP) speaking the worker
protocol; the engine is the scripted fake of test_endpoint.py; the endpoint server, the chat
format and the tokenizer are real. The verifiers worker itself runs in
tests/integration/endpoint/test_verifiers_env.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_agent_env import rollout_for
from test_agent_env import tokenizer as tokenizer  # a fixture, for the tests below

from tir_rl.envs import AgentEnv, WorkerAgentEnv
from tir_rl.envs.agent_worker import MAX_FAILED_STARTS
from tir_rl.errors import ConfigError
from tir_rl.rollout import EpisodeSpec, Rollout
from tir_rl.types import RolloutStatus

pytest.importorskip("openai")
WORKER = str(Path(__file__).with_name("external_worker.py"))


def worker_env(log: Path, mode: str, workers: int = 1) -> type[AgentEnv]:
    class Worker(WorkerAgentEnv):
        def __init__(self, **overrides: Any) -> None:
            command = [sys.executable, WORKER, str(log), mode]
            super().__init__(command=command, workers=workers, **overrides)

    return Worker


def specs(make: type[AgentEnv], indices: list[int]) -> list[EpisodeSpec]:
    return [
        EpisodeSpec(env_factory=make, options={"task_index": t}, group_id=3, sample_index=i)
        for i, t in enumerate(indices)
    ]


def logged(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_workers_play_every_episode_across_steps_and_are_gone_when_the_rollout_closes(
    tokenizer, tmp_path
):
    log = tmp_path / "log.jsonl"
    make = worker_env(log, "ok", workers=2)
    rollout = rollout_for(tokenizer, ["yes.", "no.", "yes.", "no."] * 2, max_concurrent_episodes=4)
    try:
        first = asyncio.run(rollout.run_batch(specs(make, [0, 1, 2, 3])))
        # a second step runs its own event loop: the same workers answer it
        second = asyncio.run(rollout.run_batch(specs(make, [4, 5, 6, 7])))
    finally:
        rollout.close()
    for batch in (first, second):
        assert all(t.status == RolloutStatus.FINISHED for t in batch), [t.error for t in batch]
        assert sorted(t.reward for t in batch) == [0.25, 0.25, 1.0, 1.0]
        assert all(t.num_model_tokens > 0 for t in batch)
    answered = logged(log)
    assert sorted(a["index"] for a in answered) == list(range(8))
    pids = {a["pid"] for a in answered}
    assert len(pids) == 2  # two workers, each playing episodes of both steps
    assert {a["pid"] for a in answered[4:]} == pids
    assert not any(psutil.pid_exists(p) for p in pids)


def test_a_worker_that_dies_fails_its_episode_and_the_next_episode_starts_it_again(
    tokenizer, tmp_path
):
    log = tmp_path / "log.jsonl"
    rollout = rollout_for(tokenizer, ["yes.", "yes."], max_concurrent_episodes=1)
    try:
        ok, died, again = asyncio.run(
            rollout.run_batch(specs(worker_env(log, "die_at_1"), [0, 1, 2]))
        )
    finally:
        rollout.close()
    assert ok.status == again.status == RolloutStatus.FINISHED
    assert (ok.reward, again.reward) == (1.0, 1.0)
    assert died.status == RolloutStatus.ERROR_AGENT
    assert "exited with status 7" in (died.error or "")
    assert "the next episode starts it again" in (died.error or "")
    first, last = logged(log)
    assert first["pid"] != last["pid"]


def test_a_cancelled_episode_is_cancelled_in_the_worker_which_stays_up(tokenizer, tmp_path):
    log = tmp_path / "log.jsonl"
    rollout = rollout_for(tokenizer, ["yes.", "yes."], agent_timeout_s=2)
    try:
        (hung,) = asyncio.run(rollout.run_batch(specs(worker_env(log, "hang"), [0])))
        deadline = time.monotonic() + 10
        while not logged(log) and time.monotonic() < deadline:
            time.sleep(0.05)
        (cancel,) = logged(log)
        (again,) = asyncio.run(rollout.run_batch(specs(worker_env(log, "hang"), [1])))
    finally:
        rollout.close()
    assert hung.status == again.status == RolloutStatus.ERROR_AGENT
    assert "agent_timeout_s=2" in (hung.error or "")
    assert hung.num_model_tokens > 0  # its call is kept
    assert cancel["cancel"].startswith("g3-e0-")
    deadline = time.monotonic() + 10
    while len(logged(log)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [entry["pid"] for entry in logged(log)] == [cancel["pid"]] * 2  # the same worker
    assert not psutil.pid_exists(cancel["pid"])


def test_a_worker_that_cannot_start_is_not_started_again_and_says_why(tokenizer, tmp_path):
    rollout = rollout_for(tokenizer, [], max_concurrent_episodes=1)
    indices = list(range(MAX_FAILED_STARTS + 1))
    try:
        outcomes = asyncio.run(
            rollout.run_batch(specs(worker_env(tmp_path / "log", "broken"), indices))
        )
    finally:
        rollout.close()
    assert {t.status for t in outcomes} == {RolloutStatus.ERROR_AGENT}
    for trajectory in outcomes[:-1]:
        assert "exited with status 5" in (trajectory.error or "")
        assert "the worker cannot start: no such environment" in (trajectory.error or "")
    assert f"died {MAX_FAILED_STARTS} times without answering" in (outcomes[-1].error or "")
    assert "the worker cannot start" in (outcomes[-1].error or "")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [({}, "needs env.kwargs.command"), ({"command": ["w"], "workers": 0}, "workers=0")],
)
def test_a_worker_env_with_a_bad_option_is_refused(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        WorkerAgentEnv(**kwargs)


def test_rollout_close_is_what_ends_the_workers(tokenizer, tmp_path):
    log = tmp_path / "log.jsonl"
    rollout: Rollout = rollout_for(tokenizer, ["yes."])
    asyncio.run(rollout.run_batch(specs(worker_env(log, "ok"), [0])))
    (answer,) = logged(log)
    assert psutil.Process(answer["pid"]).is_running()
    rollout.close()
    assert not psutil.pid_exists(answer["pid"])
