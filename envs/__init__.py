"""Environments for tool-using agents, registered with gymnasium under `tir_rl/...`.

Importing this package registers the built-in environments (cheap: entry points are
strings, nothing is generated until `gymnasium.make`)::

    import gymnasium as gym
    import tir_rl.envs  # noqa: F401 (registers tir_rl/...)

    env = gym.make("tir_rl/MathPython-v0", split="test")
    messages, info = env.reset(seed=0)

The environments follow the Gymnasium API (infos are dicts; `ResetInfo.from_info` and
`StepInfo.from_info` give typed views), so Gymnasium's passive checker stays on and its
wrappers (``TimeLimit``, ``RecordEpisodeStatistics``) work. `check_env` checks more.
"""

from __future__ import annotations

import gymnasium

from tir_rl.envs.agent_env import AgentEnv, CommandAgentEnv
from tir_rl.envs.agent_worker import WorkerAgentEnv
from tir_rl.envs.base import ResetInfo, Reward, Split, StepInfo, Task, ToolEnv
from tir_rl.envs.checker import check_env

ENV_IDS = {
    "tir_rl/Dataset-v0": "tir_rl.envs.dataset:DatasetEnv",
    "tir_rl/MathPython-v0": "tir_rl.envs.math_python:MathPythonEnv",
    "tir_rl/MultiHop-v0": "tir_rl.envs.multihop:MultiHopEnv",
    "tir_rl/ReasoningGym-v0": "tir_rl.envs.reasoning_gym:ReasoningGymEnv",
}
"""Built-in environment ids and their entry points."""


def register_envs() -> None:
    """Register the built-in environments with gymnasium (idempotent)."""
    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)


register_envs()

__all__ = [
    "ENV_IDS",
    "AgentEnv",
    "CommandAgentEnv",
    "ResetInfo",
    "Reward",
    "Split",
    "StepInfo",
    "Task",
    "ToolEnv",
    "WorkerAgentEnv",
    "check_env",
    "register_envs",
]
