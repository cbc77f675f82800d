"""The async multi-turn agent loop: episodes in, token-level `Trajectory`s out.

::

    EpisodeSpec ──► Episode (one coroutine each, up to max_concurrent_episodes at once)
                      │ env.reset / env.step ──► daemon thread, with a deadline
                      │ every assistant turn ──► engine.generate (its own request)
                      ▼
                    Conversation (TITO: sampled ids verbatim, env turns rendered, mask 0)
                      ▼
                    Trajectory (+ status, reward, tool counts, timings, group id)

Each assistant turn is its own `GenerateRequest`, so while one episode waits on a tool the
engine keeps batching the other episodes' turns (continuous batching across episodes).

Stop conditions are token ids, never strings: the chat format's stop tokens (`<|im_end|>`
or `<|eot_id|>`, EOS) always, and, with `Config.stop_at_tool_call_end`, the token ids of
`</tool_call>` as a stop sequence. That option is off by default: Hermes lets a turn hold
several calls, and a model may spell `</tool_call>` with other tokens than the tokenizer's
own encoding (then the sequence never matches and the turn goes on to `<|im_end|>` anyway).
Turn it on to run each call as soon as it is written (the env answers, and the turn is
closed with a rendered `<|im_end|>` that carries loss mask 0).

Usage::

    rollout = Rollout(engine, tokenizer, Rollout.Config(max_turns=6))
    groups = rollout.run_batch_sync(
        [EpisodeSpec(env_factory=make_env, task_seed=7, group_id=0, sample_index=i)
         for i in range(8)]
    )
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tir_rl.chat import ChatFormat, ChatFormatName
from tir_rl.chat.format import ChatFormats
from tir_rl.envs.agent_env import AgentEnv
from tir_rl.errors import ConfigError
from tir_rl.rollout.agent_episode import AgentEpisode
from tir_rl.rollout.agent_server import AgentServer
from tir_rl.rollout.episode import (
    EnvFactory,
    EpisodeHost,
    EpisodeSpec,
    RolloutConfig,
    empty_trajectory,
    env_failure,
    run_blocking,
)
from tir_rl.rollout.stepped_episode import SteppedEpisode
from tir_rl.types import EpisodeTimings, Trajectory

if TYPE_CHECKING:
    from tir_rl.chat.tokens import Tokenizer
    from tir_rl.endpoint import ChatEndpoint, EndpointServer
    from tir_rl.engine.base import Engine

__all__ = ["Rollout", "group_specs"]


class Rollout:
    """Runs many episodes concurrently against one engine.

    Args:
        engine: The sampling engine (`VLLMLocalEngine`, `VLLMHttpEngine`, ...).
        tokenizer: The model's Hugging Face tokenizer (for the chat format).
        config: Episode limits and sampling settings.
        chat_config: The chat format: its family (`auto`: detected from the tokenizer)
            and options (system prompt, tool block); the env's tool schemas are added per
            episode.

    Raises:
        ConfigError: A limit is invalid or exceeds the engine's context length.
        ChatFormatError: The tokenizer cannot carry the configured chat format.
    """

    Config = RolloutConfig

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        config: Config | None = None,
        *,
        chat_config: ChatFormat.Config | None = None,
    ) -> None:
        self.config = config or Rollout.Config()
        self.config.validate()
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_config = chat_config or ChatFormat.Config()
        engine_len = engine.model_info.max_model_len
        wanted = self.config.max_context_tokens
        if wanted is not None and wanted > engine_len:
            raise ConfigError(
                f"rollout.max_context_tokens={wanted} exceeds the engine's max_model_len="
                f"{engine_len}; lower it or raise engine.local.max_model_len"
            )
        self.max_context_tokens: int = wanted or engine_len
        """The context limit in force (the config's, or the engine's)."""
        self.formats = ChatFormats(tokenizer, self.chat_config)
        """The chat formats per tool set, shared with the agents' chat endpoint."""
        self._chat_endpoint: ChatEndpoint | None = None
        self._agent_server = AgentServer(lambda: self.chat_endpoint(open_on_first_call=False))
        """The endpoint server `AgentEnv` agents talk to: started on the first agent episode,
        closed with the loop (`close`)."""
        default_format = self.chat_format_for(())  # refuses an unsupported format up front
        self.stop_token_sequences: tuple[tuple[int, ...], ...] = ()
        """Multi-token stop sequences sent with every request."""
        if self.config.stop_at_tool_call_end:
            from tir_rl.chat.parse import TOOL_CALL_CLOSE

            if default_format.name is ChatFormatName.LLAMA3:
                raise ConfigError(
                    "rollout.stop_at_tool_call_end needs a format with </tool_call> blocks; "
                    "chat.format=llama3 writes JSON calls. Leave it off for Llama 3."
                )
            close_ids = default_format.encode_assistant_text(TOOL_CALL_CLOSE)
            self.stop_token_sequences = (tuple(close_ids),)

    def chat_format_for(self, tool_schemas: Sequence[dict[str, Any]]) -> ChatFormat:
        """The chat format showing these tool schemas (built once per distinct tool set)."""
        return self.formats.for_tools(tool_schemas)

    def chat_endpoint(self, *, open_on_first_call: bool = True) -> ChatEndpoint:
        """The chat endpoint over this loop's engine and chat format (built once).

        It samples as `config` says: its temperature, `max_tokens_per_turn` per call unless
        a request asks for fewer or more, the context limit, and at most `max_turns` calls
        per episode. `open_on_first_call`: whether a call under a new episode id starts
        that episode (`tir-rl serve`), or only ids the run opened are served (its agents).
        """
        if self._chat_endpoint is None:
            from tir_rl.endpoint import CallRecorder, ChatEndpoint, EndpointConfig

            self._chat_endpoint = ChatEndpoint(
                self.engine,
                self.tokenizer,
                recorder=CallRecorder(open_on_first_call=open_on_first_call),
                chat_config=self.chat_config,
                formats=self.formats,
                config=EndpointConfig(
                    temperature=self.config.temperature,
                    truncation=self.config.truncation,
                    max_tokens_per_call=self.config.max_tokens_per_turn,
                    max_context_tokens=self.max_context_tokens,
                    max_calls_per_episode=self.config.max_turns,
                ),
            )
        return self._chat_endpoint

    def agent_server(self) -> EndpointServer:
        """The endpoint server `AgentEnv` agents talk to (started on first use)."""
        return self._agent_server.get()

    def close(self) -> None:
        """Stop the agents' endpoint and workers (idempotent)."""
        self._agent_server.close()

    # ---------------------------------------------------------------------- async API
    async def run_episode(self, spec: EpisodeSpec) -> list[Trajectory]:
        """Play one episode: one trajectory, or an `AgentEnv` episode's samples.

        Failures become error statuses, never exceptions (`episode.play_episode`).
        """
        return await play_episode(self, spec)

    async def run_batch(self, specs: Sequence[EpisodeSpec]) -> list[Trajectory]:
        """Play all episodes, at most `max_concurrent_episodes` at once; results in order.

        An `AgentEnv` episode's samples come together, at the episode's place.
        """
        limit = asyncio.Semaphore(self.config.max_concurrent_episodes)

        async def bounded(spec: EpisodeSpec) -> list[Trajectory]:
            async with limit:
                return await self.run_episode(spec)

        episodes = await asyncio.gather(*(bounded(s) for s in specs))
        return [t for samples in episodes for t in samples]

    async def run_group(
        self,
        env_factory: EnvFactory,
        task_seed: int | None,
        *,
        group_size: int,
        group_id: int = 0,
        options: Mapping[str, Any] | None = None,
    ) -> list[Trajectory]:
        """Play `group_size` samples of one task (same env seed and options)."""
        return await self.run_batch(
            group_specs(
                env_factory, task_seed, group_size=group_size, group_id=group_id, options=options
            )
        )

    # ----------------------------------------------------------------------- sync API
    def run_batch_sync(self, specs: Sequence[EpisodeSpec]) -> list[Trajectory]:
        """`run_batch` for scripts without an event loop (runs its own with `asyncio.run`)."""
        return asyncio.run(self.run_batch(specs))


async def play_episode(rollout: EpisodeHost, spec: EpisodeSpec) -> list[Trajectory]:
    """Build the env and play the kind of episode its type calls for.

    A stepped env gives one trajectory; an `AgentEnv` gives one per sample of its agent's
    calls (several when its history was not append-only; none is empty: a failure with no
    call gives one empty trajectory carrying the status). An env that cannot be built gives
    one empty trajectory with the error.
    """
    started = time.perf_counter()
    label = f"episode g{spec.group_id}/s{spec.sample_index}"
    try:
        env = await run_blocking(
            spec.env_factory, timeout_s=rollout.config.reset_timeout_s, name=f"{label} make env"
        )
    except Exception as exc:  # noqa: BLE001 (one episode's env failure, not the batch's)
        ending = env_failure(exc, "building or resetting the environment")
        timings = EpisodeTimings(total_s=time.perf_counter() - started)
        return [empty_trajectory(spec, ending, timings)]
    kind = AgentEpisode if isinstance(env, AgentEnv) else SteppedEpisode
    return await kind(rollout, spec, env).run(started=started)


def group_specs(
    env_factory: EnvFactory,
    task_seed: int | None,
    *,
    group_size: int,
    group_id: int = 0,
    options: Mapping[str, Any] | None = None,
) -> list[EpisodeSpec]:
    """The `EpisodeSpec`s of one group: same task, sample indices 0..group_size-1."""
    if group_size < 1:
        raise ConfigError(f"group_size must be >= 1, got {group_size}")
    return [
        EpisodeSpec(
            env_factory=env_factory,
            task_seed=task_seed,
            options=options,
            group_id=group_id,
            sample_index=i,
        )
        for i in range(group_size)
    ]
