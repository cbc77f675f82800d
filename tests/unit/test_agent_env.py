"""`AgentEnv` episodes through the rollout: an agent's calls become samples, counted per episode.

The engine is the scripted fake of test_endpoint.py; the endpoint server, the OpenAI client,
the chat format and the tokenizer are real.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_endpoint import TOOLS, FakeTextEngine
from transformers import AutoTokenizer

from tir_rl.envs import AgentEnv, CommandAgentEnv, Split, Task
from tir_rl.errors import ConfigError
from tir_rl.models import prepare_bundled_model
from tir_rl.report.eval_stats import build_report
from tir_rl.report.step_metrics import episode_row
from tir_rl.rl_loop.step_plan import plan_step
from tir_rl.rollout import EpisodeSpec, Rollout
from tir_rl.trainer.loss import group_advantages
from tir_rl.types import Role, RolloutStatus

pytest.importorskip("openai")
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"word": "ada"}}\n</tool_call>'


class LookupAgentEnv(AgentEnv):
    """An agent that looks a word up, then compacts its history before answering."""

    def generate_task(self, index: int) -> Task:
        return Task(f"t{index}", f"What is word {index}?", "a name", Split.TRAIN, 1, {})

    async def agent(self, client: Any, task: Task) -> float:
        messages = [{"role": "user", "content": task.question}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a name"},
        ]
        await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        summary = [{"role": "user", "content": f"{task.question} Notes: a name. Answer."}]
        final = await client.chat.completions.create(model="m", messages=summary)
        return 1.0 if "name" in (final.choices[0].message.content or "") else 0.0


class RaisingAgentEnv(LookupAgentEnv):
    async def agent(self, client: Any, task: Task) -> float:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        raise ValueError("the agent's own bug")


class TalkativeAgentEnv(LookupAgentEnv):
    async def agent(self, client: Any, task: Task) -> float:
        for _ in range(10):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "again"}]
            )
        return 1.0


def rollout_for(tokenizer: Any, script: list[str], **config: Any) -> Rollout:
    queue = list(script)
    engine = FakeTextEngine(tokenizer, lambda request: queue.pop(0))
    return Rollout(engine, tokenizer, Rollout.Config(max_tokens_per_turn=64, **config))


def play(rollout: Rollout, make: type[AgentEnv], group_size: int) -> list:
    specs = [
        EpisodeSpec(env_factory=make, options={"task_index": 0}, group_id=7, sample_index=i)
        for i in range(group_size)
    ]
    try:
        return asyncio.run(rollout.run_batch(specs))
    finally:
        rollout.close()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_bundled_model())


def test_an_agent_episode_gives_one_sample_per_context_and_counts_once(tokenizer):
    # Episode 0 answers right, episode 1 wrong; each makes a 2-call context and a compacted one.
    script = [CALL, "Noted.", "It is a name.", CALL, "Noted.", "No idea."]
    rollout = rollout_for(tokenizer, script, max_concurrent_episodes=1)
    trajectories = play(rollout, LookupAgentEnv, group_size=2)

    assert [(t.episode_id, t.reward) for t in trajectories] == [
        (0, 1.0),
        (0, 1.0),
        (1, 0.0),
        (1, 0.0),
    ]
    assert [sorted(set(t.turn_ids)) for t in trajectories] == [[0, 1], [0], [0, 1], [0]]
    assert all(t.status == RolloutStatus.FINISHED for t in trajectories)
    assert {t.group_id for t in trajectories} == {7}

    plan, _ = plan_step(trajectories)
    assert plan.advantages is not None
    assert plan.advantages.tolist() == pytest.approx([0.7071, 0.7071, -0.7071, -0.7071], abs=1e-3)
    row = episode_row(trajectories, prefix="rollout")
    assert row["rollout/reward_mean"] == 0.5
    assert row["rollout/samples_per_episode"] == 2.0
    report = build_report(trajectories, env_id="agent", split="train", k=1)
    assert (report.num_tasks, report.samples_per_task, report.pass_at_1.value) == (1, 2, 0.5)


def test_an_episode_counts_once_in_its_group_s_mean_and_std():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    groups = torch.zeros(4, dtype=torch.long)
    per_sample = group_advantages(rewards, groups).advantages
    per_episode = group_advantages(
        rewards, groups, episode_ids=torch.tensor([0, 0, 0, 1])
    ).advantages
    # per sample: mean 0.75 and std 0.5, the first episode counted three times
    assert float(per_sample[0]) == pytest.approx(0.5, abs=1e-4)
    assert per_episode.tolist() == pytest.approx([0.7071, 0.7071, 0.7071, -0.7071], abs=1e-3)


def test_an_agent_that_raises_ends_with_its_error_and_keeps_its_calls(tokenizer):
    rollout = rollout_for(tokenizer, ["Hm."])
    (trajectory,) = play(rollout, RaisingAgentEnv, group_size=1)
    assert trajectory.status == RolloutStatus.ERROR_AGENT
    assert trajectory.reward == 0.0
    assert "ValueError: the agent's own bug" in (trajectory.error or "")
    assert trajectory.num_model_tokens > 0


def test_an_agent_past_max_turns_is_cut_and_its_episode_truncated(tokenizer):
    rollout = rollout_for(tokenizer, ["Again."] * 3, max_turns=3)
    trajectories = play(rollout, TalkativeAgentEnv, group_size=1)
    assert len(trajectories) == 3  # three separate contexts (each call restarts the history)
    assert {t.status for t in trajectories} == {RolloutStatus.TRUNCATED_MAX_TURNS}
    assert "rollout.max_turns" in (trajectories[0].error or "")


def test_an_agent_that_overruns_its_deadline_ends_with_an_error(tokenizer):
    class SlowAgentEnv(LookupAgentEnv):
        async def agent(self, client: Any, task: Task) -> float:
            await asyncio.sleep(30)
            return 1.0

    rollout = rollout_for(tokenizer, [], agent_timeout_s=0.2)
    (trajectory,) = play(rollout, SlowAgentEnv, group_size=1)
    assert trajectory.status == RolloutStatus.ERROR_AGENT
    assert "agent_timeout_s=0.2" in (trajectory.error or "")
    assert trajectory.num_model_tokens == 0


def test_the_openai_sdk_example_runs_its_tool_and_scores_the_answer(tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from openai_agent import LetterCount

    task = LetterCount(split="test").generate_task(3)
    word, letter = re.findall(r"'(\w+)'", task.question)[::-1]
    call = json.dumps({"name": "count_letter", "arguments": {"word": word, "letter": letter}})
    script = [f"<tool_call>\n{call}\n</tool_call>", f"It occurs {task.answer} times."]

    class OneTask(LetterCount):
        def generate_task(self, index: int) -> Task:
            return task

    rollout = rollout_for(tokenizer, script)
    (trajectory,) = play(rollout, OneTask, group_size=1)
    assert trajectory.reward == 1.0, trajectory.error
    assert trajectory.num_tool_calls == 1
    tool_turn = [m for m in trajectory.messages if m.role == Role.TOOL]
    assert [m.content for m in tool_turn] == [task.answer]


HARNESS = str(Path(__file__).with_name("external_harness.py"))


def command_env(mode: str) -> type[AgentEnv]:
    class Harness(CommandAgentEnv):
        def __init__(self, **overrides: Any) -> None:
            command = [sys.executable, HARNESS, mode, "{base_url}", "{index}"]
            super().__init__(command=command, **overrides)

    return Harness


def test_an_external_command_plays_through_the_endpoint_and_prints_its_reward(tokenizer):
    # One episode at a time: the fake engine answers requests in the order they arrive.
    rollout = rollout_for(tokenizer, ["yes, done.", "no."], max_concurrent_episodes=1)
    trajectories = play(rollout, command_env("ok"), group_size=2)
    assert [t.reward for t in trajectories] == [1.0, 0.25]
    assert all(t.status == RolloutStatus.FINISHED for t in trajectories)
    assert "Task 0 of the train split." in tokenizer.decode(trajectories[0].prompt_ids)
    assert all(t.num_model_tokens > 0 for t in trajectories)


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("fail", "exited with status 3: the harness broke on purpose"),
        ("garbage", "must print its reward"),
    ],
)
def test_a_command_that_fails_ends_its_episode_with_the_reason(tokenizer, mode, says):
    rollout = rollout_for(tokenizer, ["yes."])
    (trajectory,) = play(rollout, command_env(mode), group_size=1)
    assert trajectory.status == RolloutStatus.ERROR_AGENT
    assert says in (trajectory.error or "")
    assert trajectory.num_model_tokens > 0  # its call is kept, with reward 0


def test_a_command_past_its_deadline_is_killed(tokenizer):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rollout = rollout_for(tokenizer, ["yes."], agent_timeout_s=5)
    (trajectory,) = play(rollout, command_env("sleep"), group_size=1)
    assert trajectory.status == RolloutStatus.ERROR_AGENT
    assert "agent_timeout_s=5" in (trajectory.error or "")
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and HARNESS in " ".join(p.cmdline())
    ]
    assert left == []


def test_a_command_env_without_a_command_is_refused():
    with pytest.raises(ConfigError, match="needs env.kwargs.command"):
        CommandAgentEnv()


def test_an_agent_env_is_not_a_gymnasium_env_and_picks_tasks_as_a_tool_env_resets():
    import gymnasium

    env = LookupAgentEnv(num_tasks=1000)
    assert not isinstance(env, gymnasium.Env)
    assert not hasattr(env, "step")
    assert env.task_for(seed=None, options={"task_index": 12}).id == "t12"
    # a seed picks the index a gymnasium env reset with that seed would draw
    rng, _ = gymnasium.utils.seeding.np_random(5)
    assert env.task_for(seed=5, options=None).id == f"t{int(rng.integers(0, 1000))}"
    with pytest.raises(ConfigError, match="task_index"):
        env.task_for(seed=None, options={"task_index": -1})


def test_the_agents_server_is_closed_by_whoever_made_it(tokenizer):
    import httpx

    def answers(url: str) -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code < 500
        except httpx.TransportError:
            return False

    engine = FakeTextEngine(tokenizer, lambda request: "ok")
    alone = Rollout(engine, tokenizer)
    url = alone.agent_server().url
    assert answers(url)
    alone.close()  # the rollout made its server: closing the rollout ends it
    assert not answers(url)
