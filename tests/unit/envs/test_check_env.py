"""check_env passes the built-in environments and names the fault of broken ones."""

import math

import gymnasium as gym
import pytest

import tir_rl.envs  # noqa: F401 (registers the ids)
from tir_rl.envs import check_env
from tir_rl.envs.answers import ANSWER_INSTRUCTIONS
from tir_rl.envs.base import ResetInfo, Split, StepInfo, Task, ToolEnv
from tir_rl.errors import EnvironmentSpecError
from tir_rl.tools import ToolRegistry, tool
from tir_rl.types import Message


@tool
def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: what to echo
    """
    return text


class GoodEnv(ToolEnv):
    def build_tools(self) -> ToolRegistry:
        return ToolRegistry([echo])

    def generate_task(self, index: int) -> Task:
        return Task(f"good/{index}", f"Say {index}.", str(index), self.split, 1)

    def instructions(self, task: Task) -> str:
        return "Answer. " + ANSWER_INSTRUCTIONS

    def score(self, task: Task, answer: str) -> float:
        return float(answer == task.answer)


class RaisesOnUnknownTool(GoodEnv):
    def step(self, action):
        if action.tool_calls and action.tool_calls[0].name not in self.tools:
            raise KeyError(action.tool_calls[0].name)
        return super().step(action)


class NanReward(GoodEnv):
    def score(self, task, answer):
        return 0.5

    def step(self, action):
        messages, reward, terminated, truncated, info = super().step(action)
        return messages, math.nan if terminated else reward, terminated, truncated, info


class IntFlags(GoodEnv):
    def step(self, action):
        messages, reward, terminated, truncated, info = super().step(action)
        return messages, reward, int(terminated), truncated, info


class IgnoresSeed(GoodEnv):
    def reset(self, *, seed=None, options=None):
        return super().reset(seed=None, options=options)


class TypedResetInfo(GoodEnv):
    def reset(self, *, seed=None, options=None):
        messages, info = super().reset(seed=seed, options=options)
        return messages, ResetInfo.from_info(info)


class PartialResetInfo(GoodEnv):
    def reset(self, *, seed=None, options=None):
        messages, info = super().reset(seed=seed, options=options)
        return messages, {"task_id": info["task_id"]}


class ReusedInfoDict(GoodEnv):
    """Hands out one dict for every reset (Gymnasium forbids sharing returned data)."""

    shared: dict | None = None

    def reset(self, *, seed=None, options=None):
        messages, info = super().reset(seed=seed, options=options)
        if self.shared is None:
            self.shared = info
        self.shared.update(info)
        return messages, self.shared


class StringMessages(GoodEnv):
    def reset(self, *, seed=None, options=None):
        messages, info = super().reset(seed=seed, options=options)
        return [m.content for m in messages], info


class NoQuestion(GoodEnv):
    def reset(self, *, seed=None, options=None):
        messages, info = super().reset(seed=seed, options=options)
        return messages[:1], info


class PositionalSeed(GoodEnv):
    def reset(self, seed=None, options=None):  # not keyword-only
        return super().reset(seed=seed, options=options)


class SilentOnBadCalls(GoodEnv):
    def step(self, action):
        if action.tool_calls or "<tool_call>" in action.content:
            return [], 0.0, False, False, StepInfo(turn=1).to_info()
        return super().step(action)


class CloseTwiceFails(GoodEnv):
    closed = False

    def close(self):
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True
        super().close()


class _BadSchemaRegistry(ToolRegistry):
    @property
    def json_schemas(self):
        return [{"type": "function", "function": {"name": "bad name!", "description": "x"}}]


class BadSchema(GoodEnv):
    def build_tools(self):
        return _BadSchemaRegistry([echo])


class TypedStepInfo(GoodEnv):
    def step(self, action):
        messages, reward, terminated, truncated, info = super().step(action)
        return messages, reward, terminated, truncated, StepInfo.from_info(info)


class AssistantReply(GoodEnv):
    def step(self, action):
        messages, reward, terminated, truncated, info = super().step(action)
        return [Message.assistant("I answer for the model")], reward, terminated, truncated, info


class RaisingReset(GoodEnv):
    def generate_task(self, index):
        raise FileNotFoundError("tasks.jsonl")


def test_good_env_passes():
    check_env(GoodEnv())


@pytest.mark.parametrize("env_id", ["tir_rl/MathPython-v0", "tir_rl/MultiHop-v0"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_builtin_envs_pass(env_id, split):
    env = gym.make(env_id, split=split)
    check_env(env)


def test_multihop_long_horizon_passes():
    check_env(gym.make("tir_rl/MultiHop-v0", horizon=32))


@pytest.mark.parametrize(
    ("env_class", "reason"),
    [
        (RaisesOnUnknownTool, "raised KeyError.*unknown tool.*never exceptions"),
        (NanReward, "reward must be a finite float"),
        (IntFlags, "`terminated` must be a bool"),
        (IgnoresSeed, "not deterministic"),
        (TypedResetInfo, "reset\\(\\) info must be a dict"),
        (PartialResetInfo, "reset\\(\\) info: the info dict has no 'split' key"),
        (ReusedInfoDict, "fails gymnasium.*share an object"),
        (StringMessages, "use tir_rl.types.Message"),
        (NoQuestion, "must end with the user's question"),
        (PositionalSeed, "keyword-only `seed`"),
        (SilentOnBadCalls, "must get a tool message"),
        (CloseTwiceFails, "close must be idempotent"),
        (BadSchema, "tool name 'bad name!'"),
        (TypedStepInfo, "step\\(\\) info must be a dict"),
        (AssistantReply, "only return tool or user messages"),
        (RaisingReset, "reset\\(seed=0\\) raised FileNotFoundError"),
    ],
)
def test_broken_env_fails_with_the_reason(env_class, reason):
    with pytest.raises(EnvironmentSpecError, match=reason):
        check_env(env_class())


def test_not_a_gym_env_fails():
    class NotAnEnv:
        pass

    with pytest.raises(EnvironmentSpecError, match="not a gymnasium.Env"):
        check_env(NotAnEnv())


def test_reset_info_reports_the_split():
    _, info = GoodEnv(split="test").reset(seed=0)
    assert isinstance(info, dict) and ResetInfo.from_info(info).split is Split.TEST
