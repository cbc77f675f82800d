"""Every registered environment follows the Gymnasium API and works under its wrappers.

No sandbox is opened: the turns are final answers and calls of a tool that does not exist.
The reasoning-gym adapter is skipped only when ``reasoning_gym`` is not installed.
"""

import importlib.util

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env as gymnasium_check_env
from gymnasium.wrappers import RecordEpisodeStatistics, TimeLimit

import tir_rl.envs
from tir_rl.envs import ResetInfo, StepInfo
from tir_rl.errors import EnvironmentSpecError
from tir_rl.types import Message, ToolCall

NEEDS_PACKAGE = {"tir_rl/ReasoningGym-v0": "reasoning_gym"}


def registered_ids() -> list:
    params = []
    for env_id in tir_rl.envs.ENV_IDS:
        package = NEEDS_PACKAGE.get(env_id)
        missing = package is not None and importlib.util.find_spec(package) is None
        marks = pytest.mark.skip(reason=f"{package} is not installed") if missing else ()
        params.append(pytest.param(env_id, marks=marks))
    return params


def unknown_tool_call() -> Message:
    return Message.assistant("", [ToolCall("no_such_tool", {})])


@pytest.mark.parametrize("env_id", registered_ids())
def test_gymnasium_check_env_passes(env_id):
    env = gym.make(env_id)
    gymnasium_check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("env_id", registered_ids())
def test_record_episode_statistics_reports_the_episode(env_id):
    env = RecordEpisodeStatistics(gym.make(env_id))
    _, info = env.reset(seed=3)
    reference = ResetInfo.from_info(info).task.answer
    env.step(unknown_tool_call())
    _, reward, terminated, truncated, step_info = env.step(
        Message.assistant(f"<answer>{reference}</answer>")
    )
    assert terminated and not truncated
    assert step_info["episode"]["l"] == 2
    assert step_info["episode"]["r"] == pytest.approx(reward)
    assert StepInfo.from_info(step_info).reward.total == reward
    env.close()


@pytest.mark.parametrize("env_id", registered_ids())
def test_time_limit_truncates_a_tool_loop(env_id):
    env = RecordEpisodeStatistics(TimeLimit(gym.make(env_id), max_episode_steps=3))
    env.reset(seed=0)
    ends = [env.step(unknown_tool_call())[2:4] for _ in range(3)]
    assert ends == [(False, False), (False, False), (False, True)]
    env.close()


@pytest.mark.parametrize("env_id", registered_ids())
def test_infos_are_new_dicts_with_a_typed_view(env_id):
    env = gym.make(env_id)
    _, first = env.reset(seed=1)
    _, second = env.reset(seed=1)
    assert isinstance(first, dict) and first is not second
    assert ResetInfo.from_info(first) == ResetInfo.from_info(second)
    *_, step_info = env.step(unknown_tool_call())
    view = StepInfo.from_info(step_info)
    assert view.turn == 1 and view.num_tool_errors == 1
    env.close()


def test_typed_view_names_the_missing_key():
    with pytest.raises(EnvironmentSpecError, match="no 'turn' key"):
        StepInfo.from_info({"episode": {}})
    with pytest.raises(EnvironmentSpecError, match="must be a dict"):
        ResetInfo.from_info(["task_id"])
