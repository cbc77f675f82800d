"""The rollout stage: many multi-turn episodes against one engine, as token trajectories.

`loop` runs them concurrently (`Rollout`); `episode` plays one (`play_episode`, with its
`EpisodeSpec` and the `RolloutConfig` limits) as a `SteppedEpisode` (`stepped_episode`) or an
`AgentEpisode` (`agent_episode`), by the env's type.
"""

from tir_rl.rollout.episode import EnvFactory, EpisodeSpec, RolloutConfig, run_blocking
from tir_rl.rollout.loop import Rollout, group_specs

__all__ = ["EnvFactory", "EpisodeSpec", "Rollout", "RolloutConfig", "group_specs", "run_blocking"]
