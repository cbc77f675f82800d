"""The ToolEnv base: protocol, nudges, truncation, lazy sandbox, thread safety, config."""

import threading
from dataclasses import dataclass

import pytest
from gymnasium.error import ResetNeeded

from tir_rl.chat.parse import assistant_message
from tir_rl.envs.answers import ANSWER_INSTRUCTIONS
from tir_rl.envs.base import NUDGE, ResetInfo, Split, StepInfo, Task, ToolEnv
from tir_rl.errors import ConfigError
from tir_rl.tools import ToolRegistry, tool
from tir_rl.types import Message, Role, ToolCall, ToolErrorKind


@tool(sandbox=True)
def square(x: int) -> int:
    """Square a number inside the sandbox.

    Args:
        x: the number
    """
    return x * x


@tool
def halve(x: int) -> float:
    """Halve a number in process.

    Args:
        x: the number
    """
    if x == 0:
        raise ValueError("zero has no interesting half")
    return x / 2


class SquareEnv(ToolEnv):
    """Answer n squared; a sandboxed tool and an in-process one."""

    @dataclass(kw_only=True)
    class Config(ToolEnv.Config):
        offset: int = 0
        """Added to every task's number."""

    def build_tools(self) -> ToolRegistry:
        return ToolRegistry([square, halve])

    def generate_task(self, index: int) -> Task:
        n = index % 1000 + self.config.offset
        return Task(f"square/{index}", f"What is {n} squared?", str(n * n), self.split, 1)

    def instructions(self, task: Task) -> str:
        return "Use the square tool. " + ANSWER_INSTRUCTIONS

    def score(self, task: Task, answer: str) -> float:
        return float(answer.strip() == task.answer)


def _call(name: str, **arguments) -> Message:
    return Message.assistant("", [ToolCall(name, arguments)])


def test_reset_returns_prompt_and_typed_info():
    env = SquareEnv(split="test")
    messages, info = env.reset(seed=0)
    assert [m.role for m in messages] == [Role.SYSTEM, Role.USER]
    assert "<answer>" in messages[0].content
    assert isinstance(info, dict) and isinstance(ResetInfo.from_info(info).task, Task)
    assert info["split"] is Split.TEST and info["difficulty"] == 1
    assert info["task_id"] == info["task"].id
    assert [s["function"]["name"] for s in ResetInfo.from_info(info).tool_schemas] == [
        "square",
        "halve",
    ]


def test_task_index_option_picks_the_task():
    env = SquareEnv()
    messages, info = env.reset(options={"task_index": 12})
    assert messages[-1].content == "What is 12 squared?"
    with pytest.raises(ConfigError, match="task_index"):
        env.reset(options={"task_index": -1})


def test_num_tasks_restricts_the_pool():
    env = SquareEnv(num_tasks=3)
    ids = {env.reset(seed=s)[1]["task_id"] for s in range(40)}
    assert ids == {"square/0", "square/1", "square/2"}


def test_sandbox_opens_lazily_once_per_episode_and_closes(fake_sandboxes):
    env = SquareEnv(sandbox_factory=fake_sandboxes)
    env.reset(seed=0)
    env.step(_call("halve", x=4))
    assert fake_sandboxes.opened == []  # in-process tools never open a sandbox
    replies, *_ = env.step(_call("square", x=7))
    assert replies[0].content == "49"
    env.step(_call("square", x=3))
    assert len(fake_sandboxes.opened) == 1 and fake_sandboxes.num_open == 1
    env.reset(seed=1)  # a new episode closes the old sandbox; the new one opens on demand
    assert fake_sandboxes.num_open == 0
    env.step(_call("square", x=2))
    assert len(fake_sandboxes.opened) == 2 and fake_sandboxes.num_open == 1
    env.close()
    env.close()
    assert fake_sandboxes.num_open == 0


def test_final_answer_terminates_with_reward_breakdown():
    env = SquareEnv(format_reward=0.1)
    _, info = env.reset(options={"task_index": 9})
    replies, reward, terminated, truncated, step_info = env.step(
        Message.assistant("So <answer>81</answer>")
    )
    assert (replies, terminated, truncated) == ([], True, False)
    assert isinstance(step_info, dict) and StepInfo.from_info(step_info).turn == 1
    assert step_info["answer"] == "81"
    assert step_info["reward"].correct == 1.0 and step_info["reward"].format == 0.1
    assert reward == pytest.approx(1.1)
    with pytest.raises(ResetNeeded):
        env.step(Message.assistant("<answer>81</answer>"))


def test_boxed_answer_counts_without_format_bonus():
    env = SquareEnv(format_reward=0.1)
    env.reset(options={"task_index": 9})
    _, reward, terminated, _, info = env.step(Message.assistant("\\boxed{81}"))
    assert terminated and reward == 1.0 and info["reward"].format == 0.0


def test_wrong_answer_scores_zero():
    env = SquareEnv(format_reward=0.1)
    env.reset(options={"task_index": 9})
    _, reward, terminated, _, info = env.step(Message.assistant("<answer>80</answer>"))
    assert terminated and info["reward"].correct == 0.0 and reward == pytest.approx(0.1)


def test_no_call_and_no_answer_is_nudged_then_ends_with_zero():
    env = SquareEnv(max_nudges=1)
    env.reset(seed=0)
    replies, reward, terminated, truncated, info = env.step(Message.assistant("hmm"))
    assert replies == [Message.user(NUDGE)] and info["nudged"]
    assert (reward, terminated, truncated) == (0.0, False, False)
    replies, reward, terminated, truncated, info = env.step(Message.assistant("still hmm"))
    assert (replies, reward, terminated, truncated) == ([], 0.0, True, False)
    assert info["answer"] is None and info["reward"].correct == 0.0


def test_tool_calls_take_precedence_over_an_answer_in_the_same_turn():
    env = SquareEnv()
    env.reset(options={"task_index": 2})
    replies, _, terminated, _, _ = env.step(
        Message.assistant("<answer>4</answer>", [ToolCall("halve", {"x": 2})])
    )
    assert not terminated and replies == [Message.tool("1.0", name="halve")]


def test_max_turns_truncates():
    env = SquareEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step(_call("halve", x=2))[3] is False
    _, _, terminated, truncated, _ = env.step(_call("halve", x=2))
    assert (terminated, truncated) == (False, True)
    with pytest.raises(ResetNeeded):
        env.step(_call("halve", x=2))


def test_mistakes_become_tool_messages_in_order():
    env = SquareEnv()
    env.reset(seed=0)
    text = (
        '<tool_call>{"name": "halve", "arguments": {"x": 0}}</tool_call>\n'
        "<tool_call>{oops</tool_call>\n"
        '<tool_call>{"name": "cube", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "halve", "arguments": {"x": "two"}}</tool_call>'
    )
    action = assistant_message(text)  # the chat format's reading, as in a rollout
    calls = [ToolCall("halve", {"x": 0}), ToolCall("cube", {}), ToolCall("halve", {"x": "two"})]
    assert list(action.tool_calls) == calls
    replies, reward, terminated, _, info = env.step(action)
    assert not terminated and reward == 0.0
    assert [m.role for m in replies] == [Role.TOOL] * 4
    assert [r.error for r in info["tool_results"]] == [
        ToolErrorKind.TOOL_RAISED,
        ToolErrorKind.MALFORMED_CALL,
        ToolErrorKind.UNKNOWN_TOOL,
        ToolErrorKind.INVALID_ARGUMENTS,
    ]
    assert StepInfo.from_info(info).num_tool_errors == 4
    assert "zero has no interesting half" in replies[0].content


def test_sandbox_failure_is_a_tool_message():
    def broken_factory():
        raise RuntimeError("docker daemon is gone")

    env = SquareEnv(sandbox_factory=broken_factory)
    env.reset(seed=0)
    replies, _, terminated, _, info = env.step(_call("square", x=3))
    assert not terminated
    assert replies[0].role == Role.TOOL and "docker daemon is gone" in replies[0].content
    assert info["tool_results"][0].error is ToolErrorKind.SANDBOX


def test_step_needs_reset_and_an_assistant_message():
    env = SquareEnv()
    with pytest.raises(ResetNeeded):
        env.step(Message.assistant("<answer>1</answer>"))
    env.reset(seed=0)
    with pytest.raises(TypeError):
        env.step(Message.user("<answer>1</answer>"))


def test_unknown_config_key_names_the_nearest_field():
    with pytest.raises(ConfigError, match="did you mean 'offset'"):
        SquareEnv(ofset=3)
    with pytest.raises(ConfigError, match="split"):
        SquareEnv(split="validation")


def test_config_object_and_overrides_combine():
    env = SquareEnv(SquareEnv.Config(offset=5), split="test")
    assert env.config.offset == 5 and env.split is Split.TEST
    assert env.reset(options={"task_index": 1})[0][-1].content == "What is 6 squared?"


def test_concurrent_steps_on_one_instance_are_serialized(fake_sandboxes):
    env = SquareEnv(sandbox_factory=fake_sandboxes)
    env.reset(seed=0)
    errors = []

    def worker():
        try:
            for _ in range(20):
                env.step(_call("square", x=3))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(fake_sandboxes.opened) == 1  # one lazy open despite the race
