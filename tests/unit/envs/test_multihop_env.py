import re

import gymnasium as gym
import pytest

import tir_rl.envs  # noqa: F401 (registers the ids)
from tir_rl.envs.base import Split
from tir_rl.envs.multihop import MultiHopEnv
from tir_rl.errors import ConfigError
from tir_rl.types import Message, Role, ToolCall, ToolErrorKind


def _lookup(entity: str, relation: str) -> Message:
    return Message.assistant("", [ToolCall("lookup", {"entity": entity, "relation": relation})])


def _chain_from_question(question: str) -> tuple[str, list[str]]:
    """Read the start entity and the relations from the question text only."""
    start = re.match(r"Start from (.+?) \(a \w+\)", question).group(1)
    relations = re.findall(r"^\d+\. (\w+)$", question, flags=re.MULTILINE)
    return start, relations


def _oracle_episode(env, seed: int) -> tuple[float, int, list[Message]]:
    """Solve the task by following the chain with one lookup per hop; return reward, lookups."""
    messages, info = env.reset(seed=seed)
    start, relations = _chain_from_question(messages[-1].content)
    entity, num_lookups = start, 0
    for relation in relations:
        replies, reward, terminated, truncated, step_info = env.step(_lookup(entity, relation))
        num_lookups += 1
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert [m.role for m in replies] == [Role.TOOL]
        assert step_info["tool_results"][0].ok, replies[0].content
        entity = replies[0].content
    replies, reward, terminated, truncated, step_info = env.step(
        Message.assistant(f"The chain ends at <answer>{entity}</answer>.")
    )
    assert terminated and not truncated and replies == []
    return reward, num_lookups, messages


@pytest.mark.parametrize("horizon", [2, 3, 5, 8, 16, 24, 32])
def test_oracle_solves_every_horizon_with_exactly_horizon_lookups(horizon):
    env = gym.make("tir_rl/MultiHop-v0", horizon=horizon, split="test")
    for seed in range(3):
        reward, num_lookups, _ = _oracle_episode(env, seed)
        assert reward == 1.0
        assert num_lookups == horizon
    env.close()


def test_wrong_or_partial_answers_get_zero():
    env = MultiHopEnv(horizon=4)
    messages, info = env.reset(seed=5)
    path = info["task"].data["path"]
    assert len(path) == 5
    for wrong in path[:-1]:  # every intermediate entity is wrong...
        if wrong == path[-1]:
            continue
        env.reset(seed=5)
        assert env.step(Message.assistant(f"<answer>{wrong}</answer>"))[1] == 0.0
    env.reset(seed=5)
    _, reward, *_ = env.step(Message.assistant(f"<answer>  {path[-1].upper()} </answer>"))
    assert reward == 1.0  # ...and the right one counts in any case


def test_the_answer_is_not_in_the_prompt():
    env = MultiHopEnv(horizon=6)
    for seed in range(20):
        messages, info = env.reset(seed=seed)
        path = info["task"].data["path"]
        if path[-1] != path[0]:
            assert path[-1] not in messages[-1].content


def test_progress_shaping_counts_leading_hops_and_is_off_by_default():
    for weight, expected in ((0.0, 0.0), (0.5, 0.5 * 2 / 4)):
        env = MultiHopEnv(horizon=4, progress_reward=weight)
        _, info = env.reset(seed=11)
        start, relations = info["task"].data["start"], info["task"].data["relations"]
        entity = start
        for relation in relations[:2]:
            entity = env.step(_lookup(entity, relation))[0][0].content
        _, reward, terminated, _, step_info = env.step(Message.assistant("<answer>nobody</answer>"))
        assert terminated
        assert step_info["reward"].correct == 0.0
        assert step_info["reward"].shaping == pytest.approx(expected)
        assert reward == pytest.approx(expected)


def test_tool_mistakes_become_tool_messages():
    env = MultiHopEnv(horizon=3)
    _, info = env.reset(seed=0)
    start = info["task"].data["start"]
    action = Message.assistant(
        "",
        [
            ToolCall("lookup", {"entity": "Nobody Atall", "relation": "mentor"}),
            ToolCall("lookup", {"entity": start, "relation": "favourite_colour"}),
            ToolCall("lookup", {"entity": start}),
            ToolCall("teleport", {}),
            ToolCall("search", {"query": start.split()[-1]}),
        ],
    )
    replies, reward, terminated, truncated, step_info = env.step(action)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert [m.role for m in replies] == [Role.TOOL] * 5
    kinds = [r.error for r in step_info["tool_results"]]
    assert kinds == [
        ToolErrorKind.TOOL_RAISED,
        ToolErrorKind.TOOL_RAISED,
        ToolErrorKind.INVALID_ARGUMENTS,
        ToolErrorKind.UNKNOWN_TOOL,
        None,
    ]
    assert "use search" in replies[0].content
    assert "its relations are" in replies[1].content
    assert start in replies[4].content


def test_splits_share_no_entity_and_no_question():
    names, questions = {}, {}
    for split in Split:
        env = MultiHopEnv(horizon=3, split=split)
        names[split], questions[split] = set(), set()
        for index in range(300):
            task = env.generate_task(index)
            names[split] |= set(task.data["kb"].kinds)
            questions[split].add(task.question)
    assert not names[Split.TRAIN] & names[Split.TEST]
    assert not questions[Split.TRAIN] & questions[Split.TEST]


def test_reset_is_deterministic_per_seed():
    a, b = MultiHopEnv(horizon=5), MultiHopEnv(horizon=5)
    assert a.reset(seed=3)[0] == b.reset(seed=3)[0]
    assert a.reset(seed=3)[1]["task_id"] == b.reset(seed=3)[1]["task_id"]
    assert len({a.reset(seed=s)[1]["task_id"] for s in range(10)}) == 10


@pytest.mark.parametrize("horizon", [0, 1000])
def test_bad_horizon_is_a_config_error(horizon):
    with pytest.raises(ConfigError, match="horizon"):
        MultiHopEnv(horizon=horizon)


def test_invented_names_are_new_per_task_solvable_and_deterministic():
    env = gym.make("tir_rl/MultiHop-v0", horizon=4, split="test", invented_names=True)
    pool_names = {
        name
        for index in range(20)
        for name in MultiHopEnv(horizon=4, split="test").generate_task(index).data["kb"].kinds
    }
    seen: list[set[str]] = []
    for seed in range(5):
        reward, num_lookups, _ = _oracle_episode(env, seed)
        assert (reward, num_lookups) == (1.0, 4)
        names = set(env.unwrapped.generate_task(seed).data["kb"].kinds)
        assert not names & pool_names
        assert all(not names & earlier for earlier in seen)
        seen.append(names)
    again = MultiHopEnv(horizon=4, split="test", invented_names=True)
    assert again.reset(seed=2)[0] == env.reset(seed=2)[0]
    env.close()


def test_simulated_tool_latency_is_lognormal_with_the_given_median_and_tail(monkeypatch):
    import statistics

    from tir_rl.envs import base

    delays: list[float] = []
    monkeypatch.setattr(base.time, "sleep", delays.append)
    env = MultiHopEnv(horizon=2, tool_latency_median_s=0.3, tool_latency_p99_s=5.0)
    messages, _ = env.reset(seed=0)
    call = Message.assistant("", [ToolCall("search", {"query": "x"})])
    for _ in range(4000):
        env._simulate_latency()
    env.step(call)  # a turn with tool calls waits once
    assert len(delays) == 4001
    delays.sort()
    assert statistics.median(delays) == pytest.approx(0.3, rel=0.1)
    assert delays[int(0.99 * len(delays))] == pytest.approx(5.0, rel=0.3)


def test_no_latency_by_default_and_a_tail_below_the_median_is_refused(monkeypatch):
    from tir_rl.envs import base

    delays: list[float] = []
    monkeypatch.setattr(base.time, "sleep", delays.append)
    env = MultiHopEnv(horizon=2)
    env.reset(seed=0)
    env.step(Message.assistant("", [ToolCall("search", {"query": "x"})]))
    assert delays == []
    with pytest.raises(ConfigError, match="99th percentile"):
        MultiHopEnv(tool_latency_median_s=1.0, tool_latency_p99_s=0.5)
