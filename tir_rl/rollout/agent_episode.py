"""An agent episode: the user's agent plays an `AgentEnv` task through the run's chat endpoint.

The agent gets an `openai.AsyncOpenAI` client whose base URL records under a key of its
own (`EndpointServer.episode_base_url`); when it returns its reward (or raises, or overruns
`rollout.agent_timeout_s`), the calls recorded under that key become the episode's samples
(`tir_rl.endpoint.samples_from_calls`). Every sample carries the episode's reward, and
`episode_id` ties the samples of one episode together.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tir_rl.endpoint import samples_from_calls
from tir_rl.errors import SetupError
from tir_rl.rollout.episode import Ending, EpisodeBase, EpisodeHost, EpisodeSpec, env_failure
from tir_rl.types import RolloutStatus, Trajectory

if TYPE_CHECKING:
    from tir_rl.endpoint import EndpointServer
    from tir_rl.envs.agent_env import AgentEnv
    from tir_rl.envs.episode import Task

__all__ = ["AgentEpisode", "AgentOutcome", "play_agent_episode"]


class AgentEpisode(EpisodeBase):
    """The state of one agent episode while it runs."""

    def __init__(self, rollout: EpisodeHost, spec: EpisodeSpec, env: AgentEnv) -> None:
        super().__init__(rollout, spec, env)
        self.samples: list[Trajectory] = []
        """The training samples of the agent's calls (one per append-only history)."""

    async def _play(self) -> Ending:
        """Ask the env for the task, then let its agent play it through the endpoint."""
        try:
            task = self.env.task_for(seed=self.spec.task_seed, options=self.spec.options)
        except Exception as exc:  # noqa: BLE001 (one episode's env failure, not the batch's)
            return env_failure(exc, "building or resetting the environment")
        t0 = time.perf_counter()
        outcome = await play_agent_episode(
            self.env,
            task,
            self.rollout.agent_server(),
            group_id=self.spec.group_id,
            episode_id=self.spec.sample_index,
            timeout_s=self.config.agent_timeout_s,
        )
        self.timings.generate_s += time.perf_counter() - t0
        self.reward = outcome.reward
        self.samples = outcome.samples
        return Ending(outcome.status, outcome.error)

    def _trajectories(self, ending: Ending) -> list[Trajectory]:
        if not self.samples:  # a failure before any call: one empty trajectory with it
            from tir_rl.rollout.episode import empty_trajectory

            return [empty_trajectory(self.spec, ending, self.timings)]
        for sample in self.samples:
            sample.timings = self.timings
        return self.samples


@dataclass(frozen=True)
class AgentOutcome:
    """What an agent episode gave."""

    samples: list[Trajectory]
    """The training samples (empty when the agent made no call)."""
    reward: float
    status: RolloutStatus
    error: str | None
    num_calls: int


async def play_agent_episode(
    env: AgentEnv,
    task: Task,
    server: EndpointServer,
    *,
    group_id: int,
    episode_id: int,
    timeout_s: float | None,
) -> AgentOutcome:
    """Run `env.agent` on `task` against `server`; failures become statuses, never raises."""
    try:
        import openai
    except ImportError as exc:  # vLLM depends on openai, so a set-up machine has it
        raise SetupError('AgentEnv needs the openai package: pip install "tir-rl[serve]"') from exc
    key = f"g{group_id}-e{episode_id}-{uuid.uuid4().hex[:8]}"
    server.endpoint.recorder.open(key)
    client = openai.AsyncOpenAI(
        base_url=server.episode_base_url(key),
        api_key=server.api_key,
        max_retries=0,
        timeout=None,
    )
    reward, status, error = 0.0, RolloutStatus.FINISHED, None
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: see episode.run_blocking
            value: Any = await env.agent(client, task)
        reward = _reward(value)
    except TimeoutError:
        status = RolloutStatus.ERROR_AGENT
        error = f"the agent did not return within rollout.agent_timeout_s={timeout_s} s"
    except Exception as exc:  # noqa: BLE001 (one episode's agent failure, not the batch's)
        if server.endpoint.recorder.was_cut(key):
            status = RolloutStatus.TRUNCATED_MAX_TURNS
            error = f"the agent made more calls than rollout.max_turns allows ({exc})"
        else:
            status = RolloutStatus.ERROR_AGENT
            error = f"the agent raised {type(exc).__name__}: {exc}"
    finally:
        await client.close()
    calls = server.endpoint.recorder.calls(key)
    server.endpoint.recorder.discard(key)
    samples = samples_from_calls(
        calls, reward=reward, group_id=group_id, episode_id=episode_id, status=status, error=error
    )
    num_calls = len({c.call_index for c in calls})
    return AgentOutcome(samples, reward, status, error, num_calls)


def _reward(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"the agent must return a finite number (the reward), got {value!r}")
    return float(value)
