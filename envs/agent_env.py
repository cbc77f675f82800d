"""`AgentEnv`: tasks whose episodes a user's own agent plays through tir-rl's chat endpoint.

A `ToolEnv` answers the model turn by turn, so the agent loop must be tir-rl's. An
`AgentEnv` hands the whole episode to an agent written with any harness (the OpenAI SDK, an
agent framework, a hand-written loop): ``async def agent(self, client, task) -> float``
gets an `openai.AsyncOpenAI` client whose calls the run's endpoint answers and records in
tokens (`tir_rl.endpoint`), and returns the episode's reward. The rollout turns the recorded
calls into training samples (docs/bring_your_agent.md).

Subclasses implement `generate_task` and `agent`; ``env.id: my_module:MyAgentEnv`` in a run
config trains it. An `AgentEnv` is not a Gymnasium env: nothing steps it. The rollout asks it
for the episode's task (`task_for`) and hands the task to its agent.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tir_rl.envs.episode import Split, Task, task_index
from tir_rl.errors import ConfigError

ENDPOINT_KEY_ENV = "TIR_RL_ENDPOINT_KEY"
"""The variable that gives a `CommandAgentEnv` command the endpoint's API key."""

__all__ = ["AgentEnv", "CommandAgentEnv", "ProgramAgentEnv"]


class AgentEnv:
    """Tasks for an agent that talks to the run's OpenAI-compatible endpoint.

    `task_for` picks an episode's task (``options["task_index"]`` or the seed, as a
    `ToolEnv`'s reset does); `agent` plays it.
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

    # ----------------------------------------------------------------- the rollout's API
    def task_for(self, *, seed: int | None, options: Mapping[str, Any] | None) -> Task:
        """The task of an episode reset with this seed and these options."""
        index = task_index(options, np.random.default_rng(seed), self.config.num_tasks)
        return self.generate_task(index)

    def close(self) -> None:
        """Release what the env holds (nothing here; the rollout calls it after each episode)."""


class ProgramAgentEnv(AgentEnv):
    """Episodes played by a program outside the run, which owns the tasks.

    The program picks a task from its index, so the task here is a placeholder that carries
    the index; `env.kwargs.command` is the program's argv.
    """

    def generate_task(self, index: int) -> Task:
        """A placeholder task: the program picks the real one from its index."""
        return Task(f"{self.split.value}-{index}", "", "", self.split, 1, {"index": index})


def check_argv(command: list[str], refusal: str) -> None:
    """Raise `ConfigError(refusal)` unless `command` is a non-empty sequence of strings."""
    if not command or not all(isinstance(a, str) for a in command):
        raise ConfigError(refusal)


class CommandAgentEnv(ProgramAgentEnv):
    """Episodes played by an external command: a harness in any language or Python environment.

    For each episode tir-rl runs `Config.command` with ``{base_url}``, ``{split}`` and
    ``{index}`` replaced (the episode's OpenAI base URL, the split, the task index), and also
    writes those three as a JSON object to its standard input. The command owns its tasks
    (``index`` picks one of the split's), talks to the model only through the base URL with
    the API key tir-rl puts in its environment (``TIR_RL_ENDPOINT_KEY``, and
    ``OPENAI_API_KEY`` for clients that read that), and
    prints its reward on the last line of its standard output: a number, or a JSON object
    with a ``"reward"`` key. A non-zero exit status or a last line that is not a reward ends
    the episode with `error_agent`, with the end of its standard error in the message. The
    process is killed when the episode is cancelled or overruns `rollout.agent_timeout_s`.
    """

    @dataclass(kw_only=True)
    class Config(AgentEnv.Config):
        """Options (from the run config's `env.kwargs`)."""

        command: list[str] = dataclasses.field(default_factory=list)
        """The argv to run, e.g. ``[".venv-vf/bin/python", "play.py", "{base_url}",
        "{index}"]``; placeholders are replaced in every argument."""

        def validate(self) -> None:
            """Raise `ConfigError` naming the bad field."""
            super().validate()
            check_argv(
                self.command,
                "CommandAgentEnv needs env.kwargs.command: a list of strings (the argv), "
                "e.g. [python, play.py, '{base_url}', '{index}']",
            )

    config: Config

    async def agent(self, client: Any, task: Task) -> float:
        """Run the command for `task`'s index against the client's base URL; its reward."""
        import asyncio
        import json

        values = {
            "base_url": str(client.base_url).rstrip("/"),
            "split": self.split.value,
            "index": str(task.data["index"]),
        }
        argv = [_substitute(arg, values) for arg in self.config.command]
        key = str(client.api_key)  # in the environment, never on the command line
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, ENDPOINT_KEY_ENV: key, "OPENAI_API_KEY": key},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stdout, stderr = await proc.communicate(json.dumps(values).encode())
        finally:
            if proc.returncode is None:  # cancelled or timed out: leave nothing running
                proc.kill()
                await proc.wait()
        err_tail = stderr.decode(errors="replace").strip()[-800:]
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} exited with status {proc.returncode}: {err_tail}")
        lines = stdout.decode(errors="replace").strip().splitlines()
        return _reward_line(lines[-1] if lines else "", argv[0], err_tail)


def _substitute(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def _reward_line(line: str, program: str, err_tail: str) -> float:
    import json

    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f'{program} must print its reward (a number or {{"reward": r}}) on the last line '
            f"of its standard output; the last line was {line[-200:]!r}. stderr: {err_tail}"
        )
    return float(value)
