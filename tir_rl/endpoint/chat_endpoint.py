"""Chat completions in front of a tir-rl engine, recorded in tokens for training.

`ChatEndpoint.complete` answers one OpenAI `/v1/chat/completions` body for an episode:

1. The request is read (`openai_chat.parse_chat_request`); what the sampler cannot honour
   exactly is refused.
2. The prompt's token ids: when the request's messages are an earlier call's messages, then
   the assistant turn returned to it, then only tool/user/system messages, the prompt is that
   call's prompt and sampled ids verbatim plus the new messages rendered by the chat format
   (TITO: nothing sampled is re-tokenized). Otherwise the whole conversation is rendered.
3. The engine samples each of the `n` choices as its own request; the chat format parses each
   into prose and tool calls, returned as OpenAI `tool_calls`.
4. Every choice is recorded (`CallRecorder`) under the episode id, with its token ids,
   sampler logprobs and policy versions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl.chat import ChatFormat
from tir_rl.chat.format import ChatFormats
from tir_rl.endpoint.openai_chat import (
    ChatRequest,
    RequestedTruncation,
    RequestError,
    assistant_json,
    finite_logprob,
    parse_chat_request,
    same_assistant_turn,
)
from tir_rl.endpoint.recorder import CallRecorder, RecordedCall, UnknownEpisodeError
from tir_rl.engine.base import FinishReason, GenerateRequest, GenerateResult
from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.errors import ConfigError, EngineError
from tir_rl.types import Message, Role

if TYPE_CHECKING:
    from tir_rl.chat.tokens import Tokenizer
    from tir_rl.engine.base import Engine

__all__ = ["ChatEndpoint", "EndpointConfig"]


@dataclass(kw_only=True)
class EndpointConfig:
    """Sampling settings of the endpoint (inside a run: the run's `rollout` section)."""

    temperature: float = 1.0
    """The only temperature sampled; a request asking for another one is refused."""
    truncation: SamplingTruncation = field(default_factory=SamplingTruncation)
    """The only min-p, top-k and top-p sampled (inside a run: the rollout's); a request
    asking for others is refused (the trainer replays the run's kept set)."""
    max_tokens_per_call: int = 512
    """Tokens sampled per choice when the request gives no `max_completion_tokens`."""
    max_context_tokens: int | None = None
    """Most tokens of prompt plus completion; None: the engine's `max_model_len`."""
    model_name: str | None = None
    """The name `/v1/models` lists and responses carry; None: the model folder's name."""
    max_calls_per_episode: int | None = None
    """Calls one episode may make (inside a run: `rollout.max_turns`); one more is refused
    (HTTP 400) and the episode ends truncated. None: no limit."""
    max_choices: int = 16
    """Most choices (`n`) one call may ask for; more is refused (HTTP 400)."""

    def validate(self) -> None:
        """Raise `ConfigError` naming the bad field."""
        if not self.temperature > 0:
            raise ConfigError(f"endpoint temperature must be > 0, got {self.temperature}")
        self.truncation.validate("endpoint")
        if self.max_tokens_per_call < 1:
            raise ConfigError("endpoint max_tokens_per_call must be >= 1")
        if self.max_calls_per_episode is not None and self.max_calls_per_episode < 1:
            raise ConfigError("endpoint max_calls_per_episode must be >= 1 or None")
        if self.max_choices < 1:
            raise ConfigError("endpoint max_choices must be >= 1")


class ChatEndpoint:
    """Answers chat-completions requests with an engine and records them per episode.

    Args:
        engine: The sampling engine of the run (any `tir_rl.engine.base.Engine`).
        tokenizer: The served model's tokenizer.
        chat_config: The chat format (family, system prompt, tool block); each request's
            `tools` are shown as the format's tool block.
        config: Sampling settings.
        recorder: Where calls are kept (a new one by default).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        chat_config: ChatFormat.Config | None = None,
        config: EndpointConfig | None = None,
        recorder: CallRecorder | None = None,
        formats: ChatFormats | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_config = chat_config or ChatFormat.Config()
        self.config = config or EndpointConfig()
        self.config.validate()
        self.recorder = recorder or CallRecorder()
        self.formats = formats or ChatFormats(tokenizer, self.chat_config)
        """The chat formats per tool set (shared with the agent loop that serves this)."""
        self.chat_format(())  # refuse a tokenizer the chat format cannot carry now, not per call

    @property
    def model_name(self) -> str:
        """The served model's name."""
        return self.config.model_name or Path(self.engine.model_info.model_path).name

    @property
    def max_request_bytes(self) -> int:
        """Largest request body read: 64 bytes per token of context, plus 1 MiB for tools.

        A body larger than that cannot become a prompt that fits (no tokenizer packs 64
        bytes of JSON into one token of a chat), so it is refused before it is read.
        """
        return 64 * self.max_context_tokens + (1 << 20)

    @property
    def max_context_tokens(self) -> int:
        """Longest prompt plus completion."""
        limit = self.engine.model_info.max_model_len
        if self.config.max_context_tokens is not None:
            limit = min(limit, self.config.max_context_tokens)
        return limit

    def chat_format(self, tool_schemas: Sequence[dict[str, Any]]) -> ChatFormat:
        """The chat format showing `tool_schemas` (built once per distinct tool set)."""
        return self.formats.for_tools(tool_schemas)

    async def complete(self, episode_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat-completion response to `body`, recorded under `episode_id`.

        Raises:
            RequestError: The request cannot be honoured (its message says why), or the
                engine failed it (status 503).
        """
        try:
            self.recorder.check_known(episode_id)
        except UnknownEpisodeError as exc:
            raise RequestError(str(exc), status=404) from exc
        request = parse_chat_request(body)
        if request.n > self.config.max_choices:
            raise RequestError(
                f"n={request.n}: a call may ask for at most {self.config.max_choices} choices",
                param="n",
            )
        temperature = self.config.temperature
        if request.temperature is not None and request.temperature != temperature:
            raise RequestError(
                f"temperature {request.temperature} differs from the endpoint's {temperature}: "
                "the trainer recomputes logprobs at the run's temperature. Leave 'temperature' "
                "out or send the run's value.",
                param="temperature",
            )
        self._refuse_other_truncation(request.truncation)
        tools = request.tool_schemas if request.show_tools else ()
        fmt = self.chat_format(tools)
        prompt_ids, extends = self._prompt(episode_id, request, fmt, tools)
        room = self.max_context_tokens - len(prompt_ids)
        max_tokens = request.max_tokens or min(self.config.max_tokens_per_call, room)
        if room < 1:
            raise RequestError(
                f"the prompt is {len(prompt_ids)} tokens and the context holds "
                f"{self.max_context_tokens}: shorten the conversation",
                param="messages",
            )
        if max_tokens > room:
            raise RequestError(
                f"the prompt is {len(prompt_ids)} tokens and {max_tokens} more were asked for, "
                f"but the context holds {self.max_context_tokens}: shorten the conversation "
                f"or ask for at most {room} tokens",
                param="max_completion_tokens",
            )
        call_index = self.recorder.next_call_index(episode_id)
        limit = self.config.max_calls_per_episode
        if limit is not None and call_index >= limit:
            self.recorder.mark_cut(episode_id)
            raise RequestError(
                f"episode {episode_id!r} has made its {limit} calls (rollout.max_turns): it "
                "ends here, truncated",
                param="messages",
            )
        requests = [
            GenerateRequest(
                prompt_token_ids=prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=self.config.truncation.top_p,
                top_k=self.config.truncation.top_k,
                min_p=self.config.truncation.min_p,
                seed=None if request.seed is None else request.seed + i,
                stop_token_ids=fmt.stop_token_ids,
                affinity=episode_id,
            )
            for i in range(request.n)
        ]
        try:
            results = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        except EngineError as exc:
            raise RequestError(f"the engine failed this request: {exc}", status=503) from exc
        calls = [
            self._record(
                episode_id, call_index, i, request, prompt_ids, result, fmt, tools, extends
            )
            for i, result in enumerate(results)
        ]
        self.recorder.add(calls)
        return self._response(episode_id, call_index, request, prompt_ids, calls)

    def _refuse_other_truncation(self, asked: RequestedTruncation) -> None:
        """A request may repeat the run's min-p, top-k and top-p, never ask for others."""
        run = self.config.truncation
        for name, value, own in (
            ("top_p", asked.top_p, run.top_p),
            ("top_k", asked.top_k, run.top_k),
            ("min_p", asked.min_p, run.min_p),
        ):
            if value is not None and value != own:
                raise RequestError(
                    f"{name} {value} differs from the run's {own}: the trainer replays the "
                    f"kept set of the run's sampling settings. Leave '{name}' out or send the "
                    "run's value (rollout.top_p, rollout.top_k, rollout.min_p).",
                    param=name,
                )

    def _prompt(
        self,
        episode_id: str,
        request: ChatRequest,
        fmt: ChatFormat,
        tools: Sequence[dict[str, Any]],
    ) -> tuple[list[int], tuple[int, int] | None]:
        messages = request.messages
        earlier = sorted(
            self.recorder.calls(episode_id),
            key=lambda c: (len(c.messages), c.call_index),
            reverse=True,
        )
        for call in earlier:
            k = len(call.messages)
            rest = messages[k + 1 :]
            if (
                call.tool_schemas == tuple(tools)
                and rest
                and messages[:k] == call.messages
                and same_assistant_turn(messages[k], call.response)
                and all(m.role != Role.ASSISTANT for m in rest)
            ):
                closed = bool(call.completion_ids) and call.completion_ids[-1] == fmt.end_of_turn_id
                ids = call.token_ids + fmt.render_env_turns(rest, close_turn=not closed)
                return ids, (call.call_index, call.choice_index)
        return fmt.render_prompt(messages), None

    def _record(
        self,
        episode_id: str,
        call_index: int,
        choice_index: int,
        request: ChatRequest,
        prompt_ids: list[int],
        result: GenerateResult,
        fmt: ChatFormat,
        tools: Sequence[dict[str, Any]],
        extends: tuple[int, int] | None,
    ) -> RecordedCall:
        turn = fmt.parse_assistant(result.token_ids)
        content = turn.content
        if turn.errors:  # a malformed block stays in the text the client reads
            ids = list(result.token_ids)
            while ids and ids[-1] in fmt.stop_token_ids:
                ids.pop()
            content = fmt.decode(ids)
        response = Message.assistant(content, turn.tool_calls)
        call_ids = tuple(
            f"call_{call_index}_{choice_index}_{k}" for k in range(len(turn.tool_calls))
        )
        return RecordedCall(
            episode_id=episode_id,
            call_index=call_index,
            choice_index=choice_index,
            messages=request.messages,
            tool_schemas=tuple(tools),
            prompt_ids=list(prompt_ids),
            completion_ids=list(result.token_ids),
            logprobs=list(result.logprobs),
            policy_versions=list(result.policy_versions),
            finish_reason=result.finish_reason,
            response=response,
            call_ids=call_ids,
            extends_call=extends,
        )

    def _response(
        self,
        episode_id: str,
        call_index: int,
        request: ChatRequest,
        prompt_ids: list[int],
        calls: Sequence[RecordedCall],
    ) -> dict[str, Any]:
        choices = []
        for call in calls:
            if call.response.tool_calls:
                finish = "tool_calls"
            elif call.finish_reason == FinishReason.LENGTH:
                finish = "length"
            else:
                finish = "stop"
            choice: dict[str, Any] = {
                "index": call.choice_index,
                "message": assistant_json(call.response, call.call_ids),
                "finish_reason": finish,
                "logprobs": None,
            }
            if request.logprobs:
                choice["logprobs"] = {"content": self._logprobs(call)}
            if request.return_token_ids:
                choice["token_ids"] = call.completion_ids
            choices.append(choice)
        completion_tokens = sum(len(c.completion_ids) for c in calls)
        body: dict[str, Any] = {
            "id": f"chatcmpl-{episode_id}-{call_index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
        if request.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    def _logprobs(self, call: RecordedCall) -> list[dict[str, Any]]:
        decode = self.chat_format(call.tool_schemas).decode
        entries = []
        for token_id, logprob in zip(call.completion_ids, call.logprobs, strict=True):
            text = decode([token_id])
            entries.append(
                {
                    "token": text,
                    "logprob": finite_logprob(logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [],
                }
            )
        return entries
