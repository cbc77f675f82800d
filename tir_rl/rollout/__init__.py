"""The rollout stage: many multi-turn episodes against one engine, as token trajectories.

`loop` runs them concurrently (`Rollout`), `episode` plays one (`Episode`, with its
`EpisodeSpec` and the `RolloutConfig` limits).
"""

from tir_rl.rollout.episode import EnvFactory, EpisodeSpec, RolloutConfig, run_blocking
from tir_rl.rollout.loop import Rollout, group_specs

__all__ = ["EnvFactory", "EpisodeSpec", "Rollout", "RolloutConfig", "group_specs", "run_blocking"]
