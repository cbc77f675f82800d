"""`AgentEnv`: tasks whose episodes a user's own agent plays through tir-rl's chat endpoint.

A `ToolEnv` answers the model turn by turn, so the agent loop must be tir-rl's. An
`AgentEnv` hands the whole episode to an agent written with any harness (the OpenAI SDK, an
agent framework, a hand-written loop): ``async def agent(self, client, task) -> float``
gets an `openai.AsyncOpenAI` client whose calls the run's endpoint answers and records in
tokens (`tir_rl.endpoint`), and returns the episode's reward. The rollout turns the recorded
calls into training samples (docs/bring_your_agent.md).

Subclasses implement `generate_task` and `agent`; ``env.id: my_module:MyAgentEnv`` in a run
config trains it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gymnasium

from tir_rl.envs.episode import Split, Task
from tir_rl.errors import ConfigError, EnvironmentSpecError

__all__ = ["AgentEnv"]


class AgentEnv(gymnasium.Env[list[Any], Any]):
    """Tasks for an agent that talks to the run's OpenAI-compatible endpoint.

    ``reset`` picks the task (``options["task_index"]`` or the seed, as `ToolEnv` does) and
    returns it in the info dict under ``"agent_task"``; ``step`` is not used: the agent plays.
    """

    @dataclass(kw_only=True)
    class Config:
        """Options; subclasses add their own fields (set from the run config's `env.kwargs`)."""

        split: str = "train"
        """`train` or `test`: which tasks `generate_task` gives."""
        num_tasks: int | None = None
        """Tasks in the split (a seed picks among them); None: effectively unbounded."""

        def validate(self) -> None:
            """Raise `ConfigError` naming the bad field."""
            Split(self.split)
            if self.num_tasks is not None and self.num_tasks < 1:
                raise ConfigError(f"num_tasks={self.num_tasks}: must be >= 1 or None")

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's class attribute)

    def __init__(self, config: Config | None = None, **overrides: Any) -> None:
        base = config or type(self).Config()
        names = {f.name for f in dataclasses.fields(base)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} has no option(s) {unknown}; its options: {sorted(names)}"
            )
        self.config = dataclasses.replace(base, **overrides)
        self.config.validate()
        self.split = Split(self.config.split)
        self._task: Task | None = None

    # ----------------------------------------------------------------- subclass hooks
    def generate_task(self, index: int) -> Task:
        """The task with this index in ``self.split``; deterministic in `index`."""
        raise NotImplementedError

    async def agent(self, client: Any, task: Task) -> float:
        """Play one episode of `task` with `client` (an `openai.AsyncOpenAI`); the reward.

        Every chat completion must go through `client` (or its `base_url`): those calls are
        what is trained. Raising ends the episode with status `error_agent` and reward 0.
        """
        raise NotImplementedError

    # ----------------------------------------------------------------- gymnasium API
    @property
    def task(self) -> Task | None:
        """The current episode's task (None before the first reset)."""
        return self._task

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Any], dict[str, Any]]:
        """Pick the episode's task; the info dict carries it as ``"agent_task"``."""
        super().reset(seed=seed)
        index = (options or {}).get("task_index")
        if index is None:
            index = int(self.np_random.integers(0, self.config.num_tasks or 2**62))
        elif not isinstance(index, int) or index < 0:
            raise ConfigError(f"options['task_index']={index!r}: must be an int >= 0")
        self._task = self.generate_task(index)
        return [], {"agent_task": self._task}

    def step(self, action: Any) -> tuple[list[Any], float, bool, bool, dict[str, Any]]:
        """Not used: an `AgentEnv`'s episodes are played by its `agent`."""
        raise EnvironmentSpecError(
            f"{type(self).__name__} is an AgentEnv: its episodes are played by its agent() "
            "through the chat endpoint, not stepped"
        )
