"""Building the live parts of a run from its config: env factories, engine, rollout.

`train`, `eval`, `rollout` and `doctor` all start the same way; this module is that start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl.engine.metered import MeteredEngine
from tir_rl.errors import ConfigError
from tir_rl.run_config import EnvSection, RunConfig
from tir_rl.types import Trajectory

if TYPE_CHECKING:
    import gymnasium

    from tir_rl.chat.tokens import Tokenizer
    from tir_rl.envs.agent_env import AgentEnv
    from tir_rl.rollout import EpisodeSpec, Rollout
    from tir_rl.rollout.episode import EnvFactory

logger = logging.getLogger(__name__)


def env_factory(section: EnvSection, split: str) -> EnvFactory:
    """A function that builds one fresh environment of `section` on `split`.

    `section.id` is a registered gymnasium id, ``module:Name-v0`` or ``module:ClassName``
    (see `tir_rl.envs.resolve`); a bad one raises `ConfigError` here, before any engine starts.
    """
    from tir_rl.envs.agent_env import AgentEnv
    from tir_rl.envs.resolve import env_maker

    build = env_maker(section.id)  # imports a `module:Name` id's module now
    kwargs = dict(section.kwargs)

    def make() -> gymnasium.Env | AgentEnv:
        env = build(split=split, **kwargs)
        return env if isinstance(env, AgentEnv) else env.unwrapped

    return make


def check_env_starts(section: EnvSection, split: str) -> None:
    """Build one environment of `section` on `split`, reset it and close it.

    Building and resetting depend only on the config, so a failure here would end every
    episode the same way (an option the environment does not take, data that is missing):
    it is refused as a `ConfigError` before any engine starts.
    """
    from tir_rl.envs.agent_env import AgentEnv

    make = env_factory(section, split)
    what = f"env.id {section.id!r} (split {split!r}, env.kwargs {dict(section.kwargs)})"
    advice = (
        "Every episode would fail the same way, so the run does not start: fix env.kwargs "
        "(`--set 'env.kwargs={}'` clears the config file's) or the environment."
    )
    try:
        env = make()
    except Exception as exc:
        raise ConfigError(
            f"{what}: building the environment raised {type(exc).__name__}: {exc}. {advice}"
        ) from exc
    if isinstance(env, AgentEnv):
        call, first_task = "task_for(seed=0)", functools.partial(env.task_for, seed=0, options=None)
    else:
        call, first_task = "reset(seed=0)", functools.partial(env.reset, seed=0)
    try:
        first_task()
    except Exception as exc:
        raise ConfigError(
            f"{what}: its {call} raised {type(exc).__name__}: {exc}. {advice}"
        ) from exc
    finally:
        env.close()


@dataclass
class Runtime:
    """The engine, tokenizer and agent loop of one run."""

    config: RunConfig
    model_path: Path
    tokenizer: Tokenizer
    engine: MeteredEngine
    """The configured engine, measuring its busy time."""
    rollout: Rollout
    """The agent loop; it owns the endpoint server `AgentEnv` agents talk to."""

    def run_episodes(self, specs: Sequence[EpisodeSpec]) -> list[Trajectory]:
        """Play `specs` concurrently and return their trajectories in order."""
        return asyncio.run(self.rollout.run_batch(list(specs)))


@contextlib.contextmanager
def open_runtime(config: RunConfig) -> Iterator[Runtime]:
    """Start the engine named by `config.engine.kind` and the agent loop; closed on exit.

    A local engine is stopped on exit; an HTTP engine's server keeps running.
    """
    from transformers import AutoTokenizer

    from tir_rl import sandbox
    from tir_rl.engine.engine_config import build_engine
    from tir_rl.models import resolve_model
    from tir_rl.rollout import Rollout

    model_path = resolve_model(config.model)
    sandbox.configure(config.sandbox)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = MeteredEngine(build_engine(config.engine, model_path))
    rollout: Rollout | None = None
    try:
        rollout = Rollout(engine, tokenizer, config.rollout, chat_config=config.chat)
        yield Runtime(config, model_path, tokenizer, engine, rollout)
    finally:
        if rollout is not None:
            rollout.close()  # the agents' endpoint and workers
        engine.close()
        sandbox.shutdown()


def task_specs(
    factory: EnvFactory,
    *,
    num_tasks: int,
    group_size: int,
    first_group_id: int = 0,
    seed_of: Callable[[int], int] | None = None,
) -> list[EpisodeSpec]:
    """Episode specs for `num_tasks` tasks with `group_size` samples each.

    Args:
        factory: builds the environment.
        num_tasks: number of tasks (groups).
        group_size: samples per task.
        first_group_id: group id of the first task (keeps ids unique across a run).
        seed_of: maps a task's index to its reset seed; None: task `i` is
            `options={"task_index": i}` (a fixed, ordered held-out set).
    """
    from tir_rl.rollout import group_specs

    specs = []
    for i in range(num_tasks):
        seed = seed_of(i) if seed_of is not None else None
        options = None if seed_of is not None else {"task_index": i}
        specs += group_specs(
            factory, seed, group_size=group_size, group_id=first_group_id + i, options=options
        )
    return specs


def play_episodes(
    config: RunConfig, *, num: int, group_size: int = 1, split: str = "train"
) -> list[Trajectory]:
    """Play `num` episodes of `config.env` on `split` with the config's engine (`tir-rl rollout`).

    Episodes come in groups of `group_size` samples of one task; task `i` is reset with
    seed `run.seed + i`, so the same call replays the same tasks.
    """
    if num < 1 or group_size < 1:
        raise ConfigError(f"--num ({num}) and --group-size ({group_size}) must be >= 1")
    check_env_starts(config.env, split)
    factory = env_factory(config.env, split)
    num_tasks = -(-num // group_size)
    specs = task_specs(
        factory,
        num_tasks=num_tasks,
        group_size=group_size,
        seed_of=lambda i: config.run.seed + i,
    )[:num]
    with open_runtime(config) as runtime:
        return runtime.run_episodes(specs)
