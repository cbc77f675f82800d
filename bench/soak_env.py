"""The environment of `bench/soak_pool.py`: agent episodes next to native ones, in one run.

`SoakMixed-v0` builds, in turn, an agent episode (`CommandAgentEnv` running
`bench/soak_agent.py` through the run's chat endpoint) and a native one (`SoakToolEnv`,
stepped by tir-rl's own loop), so that every step of the soak trains on both kinds at once.

`SoakToolEnv` counts every assistant turn as one tool call. Its tool answers at once, except
for the tasks whose index picks `hang` (`TOOL_FAULTS`): then it never returns (it sleeps far
past any deadline), as a tool stuck on a lock or a dead socket would. tir-rl must end that
episode at `rollout.tool_call_timeout_s` with `error_tool`, and go on.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import gymnasium

from tir_rl.envs.agent_env import CommandAgentEnv
from tir_rl.types import Message, Role

TOOL_FAULTS = ("none", "none", "none", "hang")
"""The native episode's fault, by `task_index % len(TOOL_FAULTS)`."""
HANG_S = 3600.0
"""How long a hung tool sleeps: longer than the soak."""
TURNS = 2


class SoakToolEnv(gymnasium.Env):
    """A native episode: two turns, each answered by a tool that may hang."""

    def __init__(self, split: str = "train") -> None:
        self.split = split
        self.index = 0
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.index = int((options or {}).get("task_index", seed or 0))
        self.turn = 0
        fault = TOOL_FAULTS[self.index % len(TOOL_FAULTS)]
        messages = [
            Message.system("Call the tool on every turn."),
            Message.user(f"native task {self.index} ({fault}): say anything."),
        ]
        return messages, {}

    def step(self, action: Message):
        assert action.role == Role.ASSISTANT
        if TOOL_FAULTS[self.index % len(TOOL_FAULTS)] == "hang":
            time.sleep(HANG_S)
        self.turn += 1
        # A reward that differs between a group's episodes, so that the group is trained.
        reward = (sum(map(ord, action.content or "")) % 7) / 6.0
        if self.turn >= TURNS:
            return [], reward, True, False, {}
        return [Message.tool("ok, go on", name="probe")], 0.0, False, False, {}

    def close(self) -> None:
        pass


_kinds = itertools.count()
_kinds_lock = threading.Lock()  # the rollout builds episodes' envs in worker threads


def soak_mixed(split: str = "train", *, command: list[str]) -> gymnasium.Env:
    """An agent env and a native one, alternately (`command`: the agent's argv)."""
    with _kinds_lock:
        agent = next(_kinds) % 2 == 0
    if agent:
        return CommandAgentEnv(split=split, command=command)
    return SoakToolEnv(split=split)


gymnasium.register(id="SoakMixed-v0", entry_point=soak_mixed, disable_env_checker=True)
