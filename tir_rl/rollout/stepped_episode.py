"""A stepped episode: tir-rl's own loop plays a `ToolEnv` (or any gymnasium env).

Reset, then sample a turn with the engine, parse it, let the env answer it (`env.step`, in a
thread of its own under a deadline: `episode.run_blocking`), and append the answer as tokens,
until the env ends the episode or a limit does. The sampled tokens are kept verbatim; the
env's are rendered by the chat format with loss mask 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tir_rl.engine.base import FinishReason, GenerateRequest, GenerateResult
from tir_rl.envs.episode import ResetInfo, StepInfo
from tir_rl.errors import EnvironmentSpecError
from tir_rl.rollout.episode import (
    Ending,
    EpisodeBase,
    EpisodeHost,
    EpisodeSpec,
    StepTimeoutError,
    describe,
    empty_trajectory,
    env_failure,
    run_blocking,
    turn_seed,
)
from tir_rl.types import Message, RolloutStatus, ToolErrorKind, ToolResult, Trajectory

if TYPE_CHECKING:
    from tir_rl.chat import ChatFormat, Conversation
    from tir_rl.engine.base import Engine


class SteppedEpisode(EpisodeBase):
    """The state of one stepped episode while it runs."""

    def __init__(self, rollout: EpisodeHost, spec: EpisodeSpec, env: Any) -> None:
        super().__init__(rollout, spec, env)
        self.engine: Engine = rollout.engine
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self.num_parse_errors = 0
        self.conv: Conversation | None = None
        self.chat_format: ChatFormat | None = None

    async def _play(self) -> Ending:
        """tir-rl's own loop: reset, then sample a turn and step the env with it until the end."""
        c = self.config
        label = f"episode g{self.spec.group_id}/s{self.spec.sample_index}"
        try:
            messages, info = await run_blocking(
                self._reset, timeout_s=c.reset_timeout_s, name=f"{label} env.reset"
            )
        except Exception as exc:  # noqa: BLE001 (one episode's env failure, not the batch's)
            self.env_hung = isinstance(exc, StepTimeoutError)
            return env_failure(exc, "building or resetting the environment")
        schemas = _tool_schemas(info)
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
                return Ending(
                    RolloutStatus.TRUNCATED_CONTEXT,
                    f"the environment's answer ({len(pending)} tokens) leaves no room to sample "
                    f"within max_context_tokens={self.rollout.max_context_tokens}",
                )
            conv.append_messages(env_messages)
        return Ending(RolloutStatus.TRUNCATED_MAX_TURNS)

    def _reset(self) -> tuple[Sequence[Message], Any]:
        return self.env.reset(seed=self.spec.task_seed, options=self.spec.options)

    async def _sample_turn(self, conv: Conversation, turn: int) -> Ending | None:
        """Generate one assistant turn and append it; an ending if the episode stops here."""
        c = self.config
        assert self.chat_format is not None
        remaining = self.rollout.max_context_tokens - conv.num_tokens
        if remaining < 1:
            return Ending(RolloutStatus.TRUNCATED_CONTEXT, None)
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
            return Ending(RolloutStatus.ERROR_ENGINE, f"turn {turn}: {describe(exc)}")
        finally:
            self.timings.generate_s += time.perf_counter() - t0
        if result.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            return Ending(
                RolloutStatus.ERROR_ENGINE,
                f"turn {turn}: the engine ended the request with {result.finish_reason.value!r}",
            )
        if not result.token_ids:
            return Ending(RolloutStatus.ERROR_ENGINE, f"turn {turn}: the engine sampled nothing")
        self._count_prefill(result)
        conv.append_sampled(result.token_ids, result.logprobs, result.policy_versions)
        if result.finish_reason == FinishReason.LENGTH:
            if (
                max_tokens < c.max_tokens_per_turn
                or conv.num_tokens >= self.rollout.max_context_tokens
            ):
                return Ending(RolloutStatus.TRUNCATED_CONTEXT)
            if c.end_on_truncated_turn:
                return Ending(RolloutStatus.TRUNCATED_TURN_LENGTH)
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
    ) -> tuple[Ending | None, list[Message]]:
        """Parse the turn, let the environment answer it; an ending if the episode stops."""
        c = self.config
        assert self.chat_format is not None
        parsed = self.chat_format.parse_assistant(conv.current_turn_ids)
        self.num_tool_calls += parsed.num_blocks
        self.num_parse_errors += len(parsed.errors)
        if self.num_parse_errors > c.max_parse_errors:
            self.num_tool_errors += len(parsed.errors)
            return Ending(
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
            return env_failure(exc, f"turn {conv.turn_index}: env.step"), []
        finally:
            self.timings.tools_s += time.perf_counter() - t0
        messages, reward, terminated, truncated, info = out
        self.reward += float(reward)
        try:
            results = _tool_results(info)
        except EnvironmentSpecError as exc:
            return env_failure(exc, f"turn {conv.turn_index}: env.step"), []
        self.num_tool_errors += sum(r.error is not None for r in results)
        sandbox_failures = [r for r in results if r.error == ToolErrorKind.SANDBOX]
        if sandbox_failures and c.end_on_sandbox_error:
            return Ending(RolloutStatus.ERROR_SANDBOX, sandbox_failures[0].content), []
        if terminated:
            return Ending(RolloutStatus.FINISHED), []
        if truncated:
            return Ending(RolloutStatus.TRUNCATED_MAX_TURNS), []
        if not messages:
            return Ending(
                RolloutStatus.ERROR_TOOL,
                f"turn {conv.turn_index}: env.step returned no messages without ending the "
                "episode (a ToolEnv must answer every non-final turn)",
            ), []
        return None, list(messages)

    def _trajectories(self, ending: Ending) -> list[Trajectory]:
        return [self._trajectory(ending)]

    def _trajectory(self, ending: Ending) -> Trajectory:
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
            return dataclasses.replace(empty_trajectory(self.spec, ending, self.timings), **fields)
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
